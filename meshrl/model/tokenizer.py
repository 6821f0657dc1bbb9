"""What a model reads and writes: its tokenizer (the embedded default's character
tokenizer, built in code, or the one saved beside a model), a vision-language
model's processor, and its context length.

Apart from `meshrl.model.models`: a proc that only reads and writes text (an
environment) needs these, not transformers' modelling code, which costs a
process ~3 s of CPU to import. (The controller still imports that code, with the
actor classes it spawns.)
"""

from __future__ import annotations

import os
import string
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import WordLevel

# This module is the one way into transformers (`meshrl.model.models` imports it
# first): a colocated policy and trainer import their modules in two threads of
# one proc at once, and two threads entering transformers by two routes (here
# and the modelling code) met its circular imports half done ("cannot import
# name ... from partially initialized module 'transformers.utils'"). The
# import lock of this module makes the second thread wait until the first is in.
from transformers.models.auto.configuration_auto import AutoConfig
from transformers.tokenization_utils_tokenizers import PreTrainedTokenizerFast

from meshrl.config import ConfigError, ModelConfig
from meshrl.config.files import check, first_paragraph
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


def check_tokenizer_fits(cfg: ModelConfig, prefix: str = "model") -> None:
    """The tokenizer saved with a model has no id past the model's embedding
    table (every id it can emit indexes a row): a `ConfigError` naming
    `<prefix>.path` otherwise. Nothing to check for the embedded model, or for
    another run's directory until it is resolved (`meshrl.loop.export.start_from`).
    Run when a run starts, before any proc is spawned."""
    if cfg.path is None or not os.path.isfile(os.path.join(cfg.path, "config.json")):
        return
    key = f"{prefix}.path"
    try:
        config = AutoConfig.from_pretrained(cfg.path)
        vocab = config.get_text_config().vocab_size  # (a VLM's: its LM's)
        tokenizer = saved_tokenizer(cfg.path)
    except (OSError, ValueError) as error:
        raise ConfigError(
            f"config key '{key}': cannot load {cfg.path}: {first_paragraph(error)}"
        ) from None
    check(
        len(tokenizer) <= vocab,
        key,
        f"the tokenizer in {cfg.path} has {len(tokenizer)} tokens but the model's vocabulary "
        f"(vocab_size in config.json) has {vocab}",
    )


def max_token_chars(tokenizer: Any) -> int:
    """The most characters one token of `tokenizer` stands for (its longest
    vocabulary entry): a text of more than n times this has more than n tokens,
    known without tokenizing it."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return max((len(t) for t in vocab), default=64) or 1


def context_length(cfg: ModelConfig) -> int:
    """Tokens the model attends over (prompt + completion), from its config."""
    if cfg.path is None:
        return cfg.max_positions
    config = AutoConfig.from_pretrained(cfg.path)
    return getattr(config, "text_config", config).max_position_embeddings


def vision_format(cfg: ModelConfig) -> vision.VisionFormat | None:
    """The controller's `VisionFormat` for a vision-language model (its processor
    checked against the model's config); None for a text model."""
    processor = load_processor(cfg)
    if processor is None:
        return None
    if cfg.path is not None:
        vision.check_pair(processor, AutoConfig.from_pretrained(cfg.path), "model.path")
    return vision.VisionFormat(processor, cfg.vision.max_pixels)


def load_processor(cfg: ModelConfig):
    """A vision-language model's processor (`meshrl.model.vision`); None for a text model."""
    if cfg.path is None:
        if cfg.arch not in VISION_ARCHITECTURES:
            return None
        return vision.build_processor(cfg, load_tokenizer(cfg))
    return vision.saved_processor(cfg.path)
