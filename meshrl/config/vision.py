"""The `model.vision:` section: images, for vision-language models (`meshrl.model.vision`)."""

from __future__ import annotations

from dataclasses import dataclass

from meshrl.config.files import check as _check


@dataclass
class VisionConfig:
    """Images in prompts and tool replies. The sizes shape the embedded VLMs
    (`model.arch: llava`, `qwen2_vl`, `qwen2_5_vl`, `qwen3_vl`) only; `train` and `max_pixels` hold for any VLM."""

    train: bool = True
    """Whether the vision tower and its projector train; false freezes them
    (the language model trains either way)."""
    max_pixels: int = 1_000_000
    """The most pixels (width x height) an image may have before the processor
    resizes it; a larger one is refused with one line naming its source."""
    image_size: int = 32
    """Embedded VLM only: the side in pixels the processor resizes images to."""
    patch_size: int = 8
    """Embedded VLM only: the vision tower's patch side; an image becomes
    (image_size / patch_size)^2 + 1 tokens (its patches and CLS), or for Qwen-VL
    a quarter of its patches (merged 2 x 2)."""
    hidden_size: int = 32
    """Embedded VLM only: width of the vision tower."""
    num_layers: int = 2
    """Embedded VLM only: vision tower layers."""

    def validate(self, prefix: str = "model.vision") -> None:
        for name in ("max_pixels", "image_size", "patch_size", "hidden_size", "num_layers"):
            _check(getattr(self, name) > 0, f"{prefix}.{name}", "must be > 0")
        _check(
            self.image_size % self.patch_size == 0,
            f"{prefix}.patch_size",
            f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}",
        )
