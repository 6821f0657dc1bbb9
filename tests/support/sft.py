"""What tests/unit/test_sft.py and tests/e2e/test_sft.py share: the shipped config and a
chat tokenizer over the character tokenizer."""

import os

from meshrl.model.tokenizer import build_char_tokenizer
from tests.conftest import REPO

CONFIG = os.path.join(REPO, "algorithms", "configs", "sft.yaml")


# A chat template over the character tokenizer: "s:" system, "u:" user, "a:"
# assistant, each assistant turn closed by EOS.
TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}|{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def chat_tokenizer():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return tokenizer
