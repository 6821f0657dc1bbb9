"""What tests/unit/test_vision.py and tests/e2e/test_vision.py share: the shipped config,
the embedded vision-language models, a Qwen-VL chat template and left padding."""

import os

import torch

from meshrl.config import ModelConfig
from tests.conftest import REPO

VISION_CONFIG = os.path.join(REPO, "algorithms", "configs", "grpo_vision.yaml")
LLAVA = ModelConfig(arch="llava")
QWEN = ModelConfig(arch="qwen2_vl")  # M-RoPE: patch lists with grids (meshrl.model.mrope)
QWEN25 = ModelConfig(arch="qwen2_5_vl")  # and a vision tower of window attention
QWEN3 = ModelConfig(arch="qwen3_vl")  # and interleaved M-RoPE, deepstack features


def left_padded(ids: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`ids`' rows padded on the left with `pad` to the longest: the ids and their mask."""
    width = max(map(len, ids))
    out = torch.full((len(ids), width), pad)
    mask = torch.zeros(len(ids), width)
    for row, x in enumerate(ids):
        out[row, width - len(x) :], mask[row, width - len(x) :] = torch.tensor(x), 1
    return out, mask


# A chat template of ChatML's shape whose messages may hold pictures (Qwen-VL's tokens).
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
