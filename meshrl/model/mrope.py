"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: images as patch lists with their grids,
and M-RoPE positions.

A Qwen-VL processor resizes each picture to a multiple of its patch size (any
aspect, within its pixel bounds) and hands back the patches of every image in
one list, `pixel_values` [sum of patches, C x 2 x p x p], with each image's grid
`image_grid_thw` (1, h, w). Its language model places a token by three
positions (time, row, column: M-RoPE): text advances all three; an image's
tokens take their grid's rows and columns, and the text after an image goes
on from the largest of them. So the positions depend on the grids, not only
on the count of tokens before.

meshrl keeps a row's images as one tensor per image, as for fixed-size models:
here [1 + N, D], its first row the grid (t, h, w, 0, ...) and then its N patch
rows, padded with zeros to the longest image beside it (`patches`). The
model's arguments are rebuilt from them (`unpatched`), and every forward is
given its positions (`positions`): the sampler's prefill, each decode step
(the next text position, the same on the three axes) and the trainer's
forward over prompt and completion compute the same ones. Nothing relies on
the positions HF caches on the module between calls (`rope_deltas`), which
shared prefills and rows that leave the decode batch would break.

Their processors also hold a video processor, which needs torchvision; meshrl
sends no video, so its `Image...Processor`s here leave it out.
"""

from __future__ import annotations

import torch
from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor, Qwen3VLProcessor

QWEN_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
"""The special tokens of Qwen2-VL's images (and of the video it is not sent)."""


class _ImagesOnly:
    """A Qwen-VL processor without its video processor: it builds and loads without
    torchvision (its attributes are those its `__init__` names), and saves as the
    stock class, so that a checkout with torchvision loads the export with
    `AutoProcessor`."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    def to_dict(self) -> dict:
        out = super().to_dict()
        out["processor_class"] = type(self).__mro__[2].__name__  # the stock class
        return out


class ImageQwen2VLProcessor(_ImagesOnly, Qwen2VLProcessor):
    """Qwen2-VL's processor, images only."""


class ImageQwen2_5_VLProcessor(_ImagesOnly, Qwen2_5_VLProcessor):  # noqa: N801 - HF's name
    """Qwen2.5-VL's processor, images only."""


class ImageQwen3VLProcessor(_ImagesOnly, Qwen3VLProcessor):
    """Qwen3-VL's processor, images only."""


PROCESSORS = {
    "qwen2_vl": ImageQwen2VLProcessor,
    "qwen2_5_vl": ImageQwen2_5_VLProcessor,
    "qwen3_vl": ImageQwen3VLProcessor,
}
"""Model type -> its processor class, images only."""


def build_processor(arch: str, vision: object, tokenizer: object) -> _ImagesOnly:
    """The embedded Qwen-VL's processor (`arch`): `tokenizer` (with `QWEN_TOKENS`)
    and an image processor making every picture `vision.image_size` square
    (`meshrl.config.vision.VisionConfig`), merged 2 x 2."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    area = vision.image_size**2
    images = Qwen2VLImageProcessorPil(
        size={"shortest_edge": area, "longest_edge": area},
        patch_size=vision.patch_size,
        merge_size=2,
        temporal_patch_size=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    return PROCESSORS[arch](image_processor=images, tokenizer=tokenizer)


KEPT = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
)
"""What the embedded vision-language models' language model keeps of the text
model's config: its sizes and its special tokens."""


def tiny_config(cfg: object, text: object, tokenizer: object) -> object:
    """The embedded Qwen2-VL, Qwen2.5-VL or Qwen3-VL (`cfg.arch`): a language model
    of `text`'s sizes (the embedded Llama's) behind a vision tower of `cfg.vision`'s."""
    import transformers as hf
    from transformers.models.qwen2_5_vl import configuration_qwen2_5_vl as qwen25

    Config, Text, Vision = {
        "qwen2_vl": (hf.Qwen2VLConfig, hf.Qwen2VLTextConfig, hf.Qwen2VLVisionConfig),
        "qwen2_5_vl": (hf.Qwen2_5_VLConfig, hf.Qwen2_5_VLTextConfig, qwen25.Qwen2_5_VLVisionConfig),
        "qwen3_vl": (hf.Qwen3VLConfig, hf.Qwen3VLTextConfig, hf.Qwen3VLVisionConfig),
    }[cfg.arch]
    qwen3 = cfg.arch == "qwen3_vl"
    head_dim = text.hidden_size // text.num_attention_heads
    half = head_dim // 2
    time_axis = max(1, half // 4)  # M-RoPE's rotary pairs: time, rows, columns
    rows = (half - time_axis) // 2
    language = Text(
        **{key: getattr(text, key) for key in KEPT},
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [time_axis, rows, half - time_axis - rows],
            **({"mrope_interleaved": True} if qwen3 else {}),
        },
        **({"head_dim": head_dim} if qwen3 else {}),
    )
    vision = cfg.vision
    sizes = dict(
        depth=vision.num_layers,
        num_heads=max(1, vision.hidden_size // 16),
        patch_size=vision.patch_size,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    if cfg.arch == "qwen2_vl":
        tower = Vision(
            embed_dim=vision.hidden_size, hidden_size=text.hidden_size, mlp_ratio=4, **sizes
        )
    elif qwen3:  # learned positions on the patch grid; the first layer's features also
        side = vision.image_size // vision.patch_size  # go into the LM (deepstack)
        tower = Vision(
            hidden_size=vision.hidden_size,
            intermediate_size=4 * vision.hidden_size,
            out_hidden_size=text.hidden_size,
            num_position_embeddings=side * side,
            deepstack_visual_indexes=[0],
            **sizes,
        )
    else:  # window attention in all but the last layer, windows of 2 x 2 merged patches
        tower = Vision(
            hidden_size=vision.hidden_size,
            intermediate_size=4 * vision.hidden_size,
            out_hidden_size=text.hidden_size,
            window_size=2 * 2 * vision.patch_size,
            fullatt_block_indexes=[vision.num_layers - 1],
            **sizes,
        )
    ids = dict(
        zip(
            ("start", "image", "end", "video"),
            tokenizer.convert_tokens_to_ids(list(QWEN_TOKENS)),
            strict=True,
        )
    )
    return Config(
        text_config=language,
        vision_config=tower,
        image_token_id=ids["image"],
        video_token_id=ids["video"],
        vision_start_token_id=ids["start"],
        vision_end_token_id=ids["end"],
        tie_word_embeddings=False,
    )


# --- pixels -----------------------------------------------------------------------------


def patches(pixel_values: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
    """A processor's `pixel_values` [sum N_i, D] and `image_grid_thw` [I, 3] as one
    tensor per image, [I, 1 + max N_i, D]: its grid in row 0, then its patches."""
    counts = grids.prod(-1).tolist()
    out = torch.zeros(len(counts), 1 + max(counts), pixel_values.size(-1))
    for image, (grid, rows) in enumerate(zip(grids, pixel_values.split(counts), strict=True)):
        out[image, 0, :3] = grid.to(out.dtype)
        out[image, 1 : 1 + len(rows)] = rows
    return out


def unpatched(images: torch.Tensor, dtype: torch.dtype | None = None) -> dict:
    """`patches`' per-image tensors [n, 1 + N, D] back to the model's
    `pixel_values` [sum N_i, D] (in `dtype`) and `image_grid_thw` [n, 3]."""
    grids = images[:, 0, :3].round().long()  # (read before a cast to a narrow dtype)
    counts = grids.prod(-1).tolist()
    pixels = torch.cat([image[1 : 1 + n] for image, n in zip(images, counts, strict=True)])
    return {
        "pixel_values": pixels if dtype is None else pixels.to(dtype),
        "image_grid_thw": grids,
    }


# --- positions --------------------------------------------------------------------------


def rope_owner(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module that computes `model`'s M-RoPE positions (`get_rope_index`), through
    any wrapper (LoRA, a value head); None for a model of plain positions."""
    return next((m for m in model.modules() if hasattr(m, "get_rope_index")), None)


def positions(
    model: torch.nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor,
    grids: torch.Tensor | None,
) -> torch.Tensor | None:
    """[3, B, L] positions of `ids` (left-padded, `mask`) whose images have `grids`
    (in the order of their tokens, row by row); None when `model` is not an
    M-RoPE model or the rows have no images (then plain positions are exact)."""
    owner = rope_owner(model) if grids is not None else None
    if owner is None:
        return None
    kinds = (ids == owner.config.image_token_id).int()  # 1: an image token
    found, _ = owner.get_rope_index(
        ids, mm_token_type_ids=kinds, image_grid_thw=grids, attention_mask=mask.long()
    )
    return found
