"""Images in the loop: vision-language models, their processor, pixels as tensors.

Placeholders are expanded once, where an episode is built: the controller's
`VisionFormat` runs the model's processor on each prompt (its text and its
images), which loads the pictures, turns each image placeholder into the
model's image tokens and the pictures into pixel tensors. The policy replicas
generate from those ids and pixels and hand them back with the completions;
the trainer and the reference compute their log-probs from the very same
tensors. Nothing expands a placeholder a second time, which is how the
sampler and the trainer came to disagree elsewhere (sglang #26555, verl #3960).

Pixels travel per row, as the batch's other tensors do: `images` [B, I, C, H, W]
holds a row's images in order (zeros after its `image_counts[b]`), so rows
slice, shard and concatenate like ids and masks.

The embedded VLM (`model.arch: llava`) is HF's LLaVA: a CLIP vision tower and
projector in front of the embedded Llama, with the character tokenizer plus an
`<image>` token and a CLIP image processor, built here in code and saved and
loaded by transformers' auto classes like any checkpoint. `model.arch: qwen2_vl`
(`qwen2_5_vl`, `qwen3_vl`) is a tiny Qwen2-VL (Qwen2.5-VL, Qwen3-VL), whose
images are patch lists with their grids and whose positions come from those
grids (M-RoPE: `meshrl.model.mrope`). Any image-text-to-text model whose processor
gives fixed-size images (Gemma 3 with its token types: `token_types`), LLaVA-NeXT
(`tiles`) and the Qwen-VLs at any resolution, load by `model.path`. Other M-RoPE models (Qwen3-VL-MoE, GLM-4V) are refused with one
line, not yet supported.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

IMAGE_TOKEN = "<image>"
GRIDS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
"""Model types whose images are patch lists and positions M-RoPE (`meshrl.model.mrope`)."""
MROPE = ("qwen3_vl_moe", "glm4v")
"""Later M-RoPE model types (not yet supported)."""


class ImageError(ValueError):
    """An image or a vision setting that cannot be used; one line naming it."""


# --- the model and its processor ----------------------------------------------------


def is_vision(config: Any) -> bool:
    """Whether an HF config is a vision-language model's."""
    return getattr(config, "vision_config", None) is not None


def with_image_token(tokenizer: Any, arch: str = "llava") -> Any:
    """`tokenizer` with the embedded VLM's image placeholder (Qwen-VL: its vision
    tokens) as more tokens."""
    if arch in GRIDS:
        from meshrl.model.mrope import QWEN_TOKENS

        tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_TOKENS)})
    else:
        tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    return tokenizer


def tiny_vlm_config(cfg: Any, text_config: Any, tokenizer: Any) -> Any:
    """The embedded VLM of `model.arch`: `text_config` (the embedded Llama's) behind
    a vision tower of `cfg.vision` (`meshrl.config.vision.VisionConfig`): LLaVA's
    CLIP tower and projector, or a Qwen-VL's (`meshrl.model.mrope`)."""
    from transformers import CLIPVisionConfig, LlavaConfig

    if cfg.arch in GRIDS:
        from meshrl.model import mrope

        return mrope.tiny_config(cfg, text_config, tokenizer)
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    vision = cfg.vision
    return LlavaConfig(
        text_config=text_config,
        vision_config=CLIPVisionConfig(
            hidden_size=vision.hidden_size,
            intermediate_size=4 * vision.hidden_size,
            num_hidden_layers=vision.num_layers,
            num_attention_heads=max(1, vision.hidden_size // 16),
            image_size=vision.image_size,
            patch_size=vision.patch_size,
        ),
        image_token_id=image_token_id,
        vision_feature_select_strategy="full",  # every patch and CLS
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )


def build_processor(cfg: Any, tokenizer: Any) -> Any:
    """The embedded VLM's processor: `tokenizer` (with `<image>`) and a CLIP image
    processor resizing to `model.vision.image_size` (Qwen-VL: `meshrl.model.mrope`)."""
    from transformers import LlavaProcessor
    from transformers.utils import logging as hf_logging

    if cfg.arch in GRIDS:
        from meshrl.model import mrope

        return mrope.build_processor(cfg.arch, cfg.vision, tokenizer)
    side = cfg.vision.image_size
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its note that torchvision is absent (PIL serves)
    try:
        from transformers import CLIPImageProcessor

        images = CLIPImageProcessor(
            size={"shortest_edge": side},
            crop_size={"height": side, "width": side},
            image_mean=[0.5, 0.5, 0.5],
            image_std=[0.5, 0.5, 0.5],
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    return LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=cfg.vision.patch_size,
        vision_feature_select_strategy="full",
        num_additional_image_tokens=1,  # CLS
        image_token=IMAGE_TOKEN,
    )


def saved_processor(path: str) -> Any | None:
    """The processor saved in `path`, or None when there is none (a text model)."""
    names = ("processor_config.json", "preprocessor_config.json")
    if not any(os.path.isfile(os.path.join(path, n)) for n in names):
        return None
    from transformers import AutoConfig, AutoProcessor
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model_type = AutoConfig.from_pretrained(path).model_type
        if model_type in GRIDS:  # its video part needs torchvision
            from meshrl.model.mrope import PROCESSORS

            return PROCESSORS[model_type].from_pretrained(path)
        return AutoProcessor.from_pretrained(path)
    finally:
        hf_logging.set_verbosity(verbosity)


CARRIED = {"input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids"}
"""What meshrl carries of a processor's output (the ids, the pixels, Qwen-VL's grids)."""
TILES = ("llava_next",)
"""Model types whose processor cuts each image into tiles (any resolution) and gives
its size, `image_sizes`: meshrl keeps the size in a first tile of its own (`tiles`)."""
TOKEN_TYPES = ("gemma3",)
"""Model types whose forward takes `token_type_ids`, 1 on image tokens (attended
both ways within an image), which meshrl derives from the ids (`token_types`)."""


def token_types(config: Any, ids: torch.Tensor) -> dict:
    """The forward's `token_type_ids` for a model of `TOKEN_TYPES` (1 on its image
    tokens, as its processor gives them), else {}."""
    if getattr(config, "model_type", None) not in TOKEN_TYPES:
        return {}
    return {"token_type_ids": (ids == config.image_token_id).long()}


def check_pair(processor: Any, config: Any, key: str) -> None:
    """One line naming `key` when the processor cannot feed the model: a text
    model, a later M-RoPE model, a processor whose image token, image or patch
    size is not the model's, or one that gives inputs meshrl does not carry
    (Idefics3's `pixel_attention_mask`, ...)."""
    if not is_vision(config):
        raise ImageError(f"config key '{key}': a {config.model_type} model takes no images")
    if config.model_type in MROPE:
        raise ImageError(
            f"config key '{key}': {config.model_type} (M-RoPE positions from image grids) "
            "is not supported yet; LLaVA-style models, qwen2_vl, qwen2_5_vl and qwen3_vl are"
        )
    token = getattr(processor, "image_token_id", None)
    if token is None:
        token = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    # (Gemma 3's text placeholder opens the image; its image tokens are others.)
    if config.image_token_id not in [token, *(getattr(processor, "image_token_ids", None) or [])]:
        raise ImageError(
            f"config key '{key}': the processor's image token is id {token}, the model's "
            f"image_token_id is {config.image_token_id}: a processor of another model"
        )
    if config.model_type in GRIDS:
        tower, images = config.vision_config, processor.image_processor
        for name, theirs in (
            ("patch_size", "patch_size"),
            ("merge_size", "spatial_merge_size"),
            ("temporal_patch_size", "temporal_patch_size"),
        ):
            if getattr(images, name, None) != getattr(tower, theirs):
                raise ImageError(
                    f"config key '{key}': the processor's {name} is {getattr(images, name, None)}, "
                    f"the model's vision tower's {theirs} is {getattr(tower, theirs)}: "
                    "a processor of another model"
                )
        return
    from PIL import Image

    probe = processor(text=[processor.image_token], images=[Image.new("RGB", (64, 64))])
    derived = {"token_type_ids"} if config.model_type in TOKEN_TYPES else set()
    derived |= {"image_sizes"} if config.model_type in TILES else set()
    extra = sorted(set(probe) - CARRIED - derived)
    if extra:
        raise ImageError(
            f"config key '{key}': the {config.model_type} processor also gives "
            f"{', '.join(extra)}, which meshrl does not carry yet; supported: processors "
            "of pixel values only (LLaVA and its kind), llava_next, gemma3, qwen2_vl, "
            "qwen2_5_vl, qwen3_vl"
        )
    crop = getattr(processor.image_processor, "crop_size", None) or {}
    size = getattr(config.vision_config, "image_size", None)
    if size is not None and crop.get("height", size) != size:
        raise ImageError(
            f"config key '{key}': the processor makes {crop['height']}px images, the "
            f"model's vision tower takes {size}px: a processor of another model"
        )


FROZEN_VISION = r".*(vision_tower|multi_modal_projector|\bvisual)\..*"
"""The modules `model.vision.train: false` freezes (and LoRA leaves alone)."""


def freeze_vision(model: torch.nn.Module) -> None:
    """Stop the vision tower and its projector from training (`model.vision.train`)."""
    for name, parameter in model.named_parameters():
        if re.fullmatch(FROZEN_VISION, name):
            parameter.requires_grad_(False)


# --- images and pixels ----------------------------------------------------------------


def placeholder_ids(config: Any) -> list[int]:
    """The ids only the processor places (an image's, a video's): the sampler never
    draws them, and the trainer's softmax leaves them out the same way."""
    ids = [config.image_token_id, getattr(config, "video_token_id", None)]
    return [i for i in ids if i is not None]


def load_image(image: Any, max_pixels: int, where: str) -> Any:
    """A PIL RGB image from a file path, a PIL image or an [H, W, 3] uint8 array;
    one line naming `where` (and the file) when it cannot be read or has more
    than `max_pixels` pixels (`model.vision.max_pixels`)."""
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, (str, os.PathLike)):
        try:
            with Image.open(image) as opened:
                opened.load()
                picture = opened.convert("RGB")
        except (OSError, UnidentifiedImageError, SyntaxError) as error:
            raise ImageError(f"{where}: cannot read image {image}: {error}") from None
    elif isinstance(image, np.ndarray):
        if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
            raise ImageError(
                f"{where}: an image array must be [H, W, 3] uint8, got "
                f"{list(image.shape)} {image.dtype}"
            )
        picture = Image.fromarray(image)
    elif isinstance(image, Image.Image):
        picture = image.convert("RGB")
    else:
        raise ImageError(
            f"{where}: an image must be a path, a PIL image or an array, not {type(image).__name__}"
        )
    width, height = picture.size
    if width * height > max_pixels:
        name = f"{image} " if isinstance(image, (str, os.PathLike)) else ""
        raise ImageError(
            f"{where}: image {name}is {width}x{height}, "
            f"more than model.vision.max_pixels={max_pixels}"
        )
    return picture


class VisionFormat:
    """Prompts with images to token ids and pixels, through the model's processor:
    a prompt's images go before its text (as the model's chat template puts
    them, when it has one), unless the text places `processor.image_token`s
    itself. A Qwen-VL processor's images come as patch lists with their grids
    (`meshrl.model.mrope.patches`)."""

    def __init__(self, processor: Any, max_pixels: int):
        self.processor, self.max_pixels = processor, max_pixels
        self.chat = bool(getattr(processor, "chat_template", None))
        self.grids = hasattr(processor.image_processor, "merge_size")
        token = processor.image_token
        self.slot = f"<|vision_start|>{token}<|vision_end|>" if self.grids else token

    def text(self, prompt_text: str, count: int) -> str:
        token = self.processor.image_token
        if token in prompt_text:
            return prompt_text
        if not self.chat:
            return self.slot * count + prompt_text
        content = [{"type": "image"}] * count + [{"type": "text", "text": prompt_text}]
        return self.processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )

    def encode(self, text: str, images: list, where: str) -> tuple[list[int], torch.Tensor | None]:
        """One prompt's ids (placeholders expanded) and its pixels [I, C, H, W]."""
        pictures = [load_image(image, self.max_pixels, where) for image in images or []]
        if not pictures:
            ids = self.processor.tokenizer(text).input_ids
            return ids, None
        rendered = self.text(text, len(pictures))
        found = rendered.count(self.processor.image_token)
        if found != len(pictures):
            raise ImageError(f"{where}: {found} image placeholders for {len(pictures)} images")
        out = self.processor(text=[rendered], images=pictures, return_tensors="pt")
        return out["input_ids"][0].tolist(), self._pixels(out)

    def _pixels(self, out: Any) -> torch.Tensor:
        """The processor's pixels, one tensor per image: [I, C, H, W], or with grids
        [I, 1 + N, D] (`meshrl.model.mrope.patches`)."""
        if "image_sizes" in out:
            return tiles(out["pixel_values"].float(), out["image_sizes"])
        if not self.grids:
            return out["pixel_values"].float()
        from meshrl.model.mrope import patches

        return patches(out["pixel_values"].float(), out["image_grid_thw"])

    def reply(
        self, text: str, images: list, where: str, placed: bool = False
    ) -> tuple[list[int], list[torch.Tensor]]:
        """An environment reply's ids (its images first, placeholders expanded; no
        BOS: it continues the episode) and its pixels, one tensor per image.
        `placed`: `text` holds the image placeholders already (a chat template
        rendered the reply: `meshrl.envs.rollout`)."""
        pictures = [load_image(image, self.max_pixels, where) for image in images]
        rendered = text if placed else self.slot * len(pictures) + text
        found = rendered.count(self.processor.image_token)
        if found != len(pictures):
            raise ImageError(f"{where}: {found} image placeholders for {len(pictures)} images")
        out = self.processor(
            text=[rendered], images=pictures, return_tensors="pt", add_special_tokens=False
        )
        return out["input_ids"][0].tolist(), list(self._pixels(out))

    def prompts(self, prompts: list) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        encoded = [self.encode(p.text, p.images, f"prompt {p.text[:30]!r}") for p in prompts]
        return [ids for ids, _ in encoded], [pixels for _, pixels in encoded]


def tiles(pixel_values: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """LLaVA-NeXT's tiles [I, P, C, H, W] and `image_sizes` [I, 2] as one tensor per
    image, [I, 1 + P, C, H, W]: its size (height, width) at the start of a first
    tile, then its tiles (the processor pads them to the most tiles of any image)."""
    out = torch.zeros(pixel_values.size(0), 1 + pixel_values.size(1), *pixel_values.shape[2:])
    out[:, 0].view(len(out), -1)[:, :2] = sizes.to(out.dtype)
    out[:, 1:] = pixel_values
    return out


def stack(images: list[torch.Tensor | None]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Rows' images ([I_b, C, H, W] or None) as `images` [B, I, C, H, W] (zeros
    after a row's own) and `image_counts` [B]; (None, None) without images."""
    present = [x for x in images if x is not None]
    if not present:
        return None, None
    out = pile([x if x is not None else present[0][:0] for x in images])
    counts = torch.tensor([0 if x is None else len(x) for x in images], dtype=torch.long)
    return out, counts


def pile(tensors: list[torch.Tensor]) -> torch.Tensor:
    """`torch.stack` of tensors whose sizes may differ: each padded with zeros to
    the largest size in every dimension (rows of fewer images; patch lists of
    fewer patches, `meshrl.model.mrope.patches`)."""
    shape = [max(x.shape[d] for x in tensors) for d in range(tensors[0].dim())]
    out = torch.zeros(len(tensors), *shape)
    for row, tensor in enumerate(tensors):
        out[row][tuple(slice(0, n) for n in tensor.shape)] = tensor
    return out


def shard(images: list[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`Policy.generate`'s `images` for rows' images (`stack`); None when none has any."""
    return stack(images) if any(x is not None for x in images) else None


def unstack(images: tuple | None, rows: int) -> list[torch.Tensor | None]:
    """`stack`'s (images, counts) back to each row's [I_b, C, H, W] (None for none)."""
    if images is None or images[0] is None:
        return [None] * rows
    pixels, counts = images
    return [pixels[b, :n] if n else None for b, n in enumerate(counts.tolist())]


def inputs(
    images: torch.Tensor | None,
    counts: torch.Tensor | None,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
) -> dict:
    """The model's image arguments for rows with `images` and `image_counts`:
    `pixel_values` [N, C, H, W], every row's images in row order (the order of
    the image tokens in the ids), or a Qwen-VL's patches and `image_grid_thw`
    (`meshrl.model.mrope.unpatched`); {} when the rows have none. Each on
    `device` (the model's: pixels are made on the CPU) when it is given."""
    if images is None or counts is None or int(counts.sum()) == 0:
        return {}
    present = torch.arange(images.size(1), device=counts.device) < counts[:, None]
    pixels = images[present.to(images.device)]
    if pixels.dim() == 3:  # patch lists with their grids
        from meshrl.model.mrope import unpatched

        made = unpatched(pixels, dtype)
    elif pixels.dim() == 5:  # tiles, after their image's size (`tiles`)
        sizes = pixels[:, 0].flatten(1)[:, :2].round().long()  # (read before a cast)
        tiled = pixels[:, 1:]
        made = {"pixel_values": tiled if dtype is None else tiled.to(dtype), "image_sizes": sizes}
    else:
        made = {"pixel_values": pixels if dtype is None else pixels.to(dtype)}
    return made if device is None else {k: v.to(device) for k, v in made.items()}


def row_keys(images: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """[B] an id per distinct image set (rows with the same ids and images share
    a prefill: `meshrl.model.generation`)."""
    flat = torch.cat([counts[:, None].to(images.dtype), images.flatten(1)], 1)
    return torch.unique(flat, dim=0, return_inverse=True)[1]
