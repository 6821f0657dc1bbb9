"""Tiny models of the mainstream HF architectures, built from a config.

`model.arch` picks the embedded model's architecture. Each is the family's own
transformers class at `ModelConfig`'s width and depth, with what sets that
family apart from Llama kept on, so a run on the tiny model meets what a run
on the real one meets:

- llama: the default (every key/value head, untied embeddings);
- qwen2, qwen3: grouped-query attention, tied embeddings (Qwen3: q/k norms);
- qwen3_moe: a mixture of experts in every layer (`MOE_EXPERTS`, top
  `MOE_TOP_K`), routers that `meshrl.model.routing` can record and replay;
- gemma2, gemma3: sliding-window layers alternating with full ones (a window
  of `GEMMA_WINDOW` tokens: the default task's episodes, 10 tokens, cross it), embedding
  scaling, tied embeddings; Gemma 2 also soft-caps attention and final logits;
- phi3: fused qkv and gate/up projections;
- gpt2: learned absolute positions, LayerNorm, tied embeddings.

Grouped-query attention uses half as many key/value heads as query heads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

# The architectures' names live with their key (`model.arch`), as the config checks them.
from meshrl.config import ARCHITECTURES, VISION_ARCHITECTURES  # noqa: F401

if TYPE_CHECKING:
    import transformers

MOE_EXPERTS, MOE_TOP_K = 4, 2
GEMMA_WINDOW = 8


def tiny_config(
    arch: str,
    *,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    intermediate_size: int,
    max_positions: int,
    pad_token_id: int | None = 0,
    bos_token_id: int = 1,
    eos_token_id: int = 2,
) -> transformers.PretrainedConfig:
    """The HF config of the tiny `arch` model (one of ARCHITECTURES)."""
    import transformers  # here: the config check imports this module's names only

    ids = dict(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    if arch == "gpt2":
        return transformers.GPT2Config(
            vocab_size=vocab_size,
            n_positions=max_positions,
            n_embd=hidden_size,
            n_layer=num_layers,
            n_head=num_heads,
            n_inner=intermediate_size,
            tie_word_embeddings=True,
            **ids,
        )
    head_dim = hidden_size // num_heads
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        max_position_embeddings=max_positions,
        **ids,
    )
    if arch == "llama":
        common.update(num_key_value_heads=num_heads, tie_word_embeddings=False)
        return transformers.LlamaConfig(**common)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=head_dim, tie_word_embeddings=True)
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common,
            head_dim=head_dim,
            moe_intermediate_size=max(1, intermediate_size // MOE_EXPERTS),
            num_experts=MOE_EXPERTS,
            num_experts_per_tok=MOE_TOP_K,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        )
    if arch in ("gemma2", "gemma3"):
        cls = transformers.Gemma2Config if arch == "gemma2" else transformers.Gemma3TextConfig
        return cls(
            **common,
            head_dim=head_dim,
            query_pre_attn_scalar=head_dim,
            sliding_window=GEMMA_WINDOW,
            tie_word_embeddings=True,
        )
    if arch == "phi3":
        return transformers.Phi3Config(**common, tie_word_embeddings=False)
    raise ValueError(f"model.arch '{arch}' is not one of {', '.join(ARCHITECTURES)}")


GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def saved_tokenizer(path: str):
    """The tokenizer saved in `path`, of the class it was saved as. transformers
    5's `AutoTokenizer` picks the class from the model's type instead, and a
    family's class adds tokens of its own (Qwen2's adds `<|endoftext|>`), so a
    generic tokenizer saved beside a Qwen model (meshrl's character tokenizer)
    would come back one token longer than the model's vocabulary."""
    import json
    import os

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config = os.path.join(path, "tokenizer_config.json")
    saved_as = None
    if os.path.isfile(config):
        with open(config) as f:
            saved_as = json.load(f).get("tokenizer_class")
    if saved_as in GENERIC_TOKENIZERS:
        return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)
