"""Tokenizers: the embedded default's character tokenizer, built in code, or the one
saved beside a model.

Its own module, apart from `meshrl.model.models`: a proc that only reads and
writes text (an environment, a reward function's host) needs a tokenizer, not
transformers' modelling code, which costs a proc ~4 s of CPU to import.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import WordLevel

# From its own module, not transformers' lazy top level: a colocated policy and
# trainer import their modules in two threads of one proc at once, and the lazy
# top level broke under that (`meshrl.model.models`).
from transformers.tokenization_utils_tokenizers import PreTrainedTokenizerFast

from meshrl.config import ModelConfig
from meshrl.model import vision
from meshrl.model.architectures import VISION_ARCHITECTURES, saved_tokenizer

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
# Printable ASCII, space to tilde: enough for digits, arithmetic and short text.
CHARACTERS = [chr(c) for c in range(32, 127)]
assert set(string.digits) <= set(CHARACTERS)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character; BOS is prepended on encode."""
    vocab = {token: i for i, token in enumerate([PAD, BOS, EOS, *CHARACTERS])}
    core = Tokenizer(WordLevel(vocab, unk_token=PAD))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS, padding_side="left"
    )


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerFast:
    if cfg.path is None:
        tokenizer = build_char_tokenizer()
        if cfg.arch in VISION_ARCHITECTURES:
            return vision.with_image_token(tokenizer, cfg.arch)
        return tokenizer
    tokenizer = saved_tokenizer(cfg.path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
