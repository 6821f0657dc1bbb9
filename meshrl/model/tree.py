"""The `tree` layout at reasoning lengths: each distinct prompt once into a KV
cache, and every completion run over its prompt's cache, with no L x L mask.

`meshrl.model.packing` lays a group out as one sequence, the prompt followed by
each completion, under a dense additive mask of L x L entries (L = prompt + the
group's completion tokens). That is one forward and the fastest way for short
trees. Its mask grows with the square of the group's tokens: at a 512-token
prompt and 8 completions of 1,024 tokens, L = 8,704, 76M entries per tree, and
every query scores every key of the tree. On an H200 that forward took 14x the
padded layout's (`make gpu-check`, tree_layout).

Past `DENSE_TREE_TOKENS` a micro-batch runs two forwards instead: its distinct
prompts, left-padded, fill a KV cache; the cache is copied to the rows (an
index_select, whose backward sums each row's gradient into its prompt's keys
and values, the sum the padded layout computes G times over); the rows'
completions then run over it with a 2D mask, at the positions the padded
layout gives them. The attention done is what the rows need (each completion
over its prompt and its own earlier tokens) and the memory is the padded
layout's attention less the prompt copies. Same math as `padded` and the
dense tree, up to the order of float sums (tests/unit/test_packing.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import repeat_kv
from transformers.masking_utils import AttentionMaskInterface

from meshrl.model.packing import _spans, distinct_prompts, hf_config, take_rows

DENSE_TREE_TOKENS = 2048
"""The most tokens one tree of the dense layout holds (its mask is the square of it:
16 MB of float32 at 2,048); a micro-batch with a larger tree runs the KV-cache path."""


LOWER_RIGHT = "meshrl_lower_right"
"""The attention the completions' forward runs with when no row of it has padding
before its last real token: the queries are the last positions of the keys, and
each attends to every key up to its own position (lower-right causal), with no
mask tensor."""


def _lower_right_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, **_
):
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    # Zero queries stand in for the keys' first positions, so that SDPA's own causal
    # mode (top-left, the one its kernels skip masked blocks in) lines the real
    # queries up with the last keys; their outputs are dropped. An explicit
    # lower-right mask made the CPU kernel compute every block (1.2x padded's step).
    extra = key.size(2) - query.size(2)
    padded = torch.cat([query.new_zeros(*query.shape[:2], extra, query.size(3)), query], 2)
    out = torch.nn.functional.scaled_dot_product_attention(
        padded, key, value, is_causal=True, dropout_p=0.0, scale=scaling
    )[:, :, extra:]
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(LOWER_RIGHT, _lower_right_attention)
# No mask is built for it: the rows hold no padding that a key must be hidden from.
AttentionMaskInterface.register(LOWER_RIGHT, lambda *args, **kwargs: None)


def lower_right_applies(model: torch.nn.Module) -> bool:
    """Whether `model` can run its completions with `LOWER_RIGHT`: it attends through
    SDPA with full attention in every layer (a sliding window needs its mask)."""
    config = hf_config(model)
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    return getattr(config, "_attn_implementation", None) == "sdpa" and kinds == {"full_attention"}


@contextlib.contextmanager
def lower_right(model: torch.nn.Module) -> Iterator[None]:
    """`model`'s forwards run with `LOWER_RIGHT` attention during the block."""
    config = hf_config(model)
    saved = config._attn_implementation
    config._attn_implementation = LOWER_RIGHT
    try:
        yield
    finally:
        config._attn_implementation = saved


def by_prompt_length(attention_mask: torch.Tensor, T: int) -> list[torch.Tensor]:
    """The batch's rows grouped by their prompt's length (each group's prompts then
    need no left padding), in row order within each group."""
    lengths = attention_mask[:, : attention_mask.size(1) - T].sum(1).long()
    return [(lengths == n).nonzero().flatten() for n in lengths.unique().tolist()]


def largest_tree(input_ids: torch.Tensor, attention_mask: torch.Tensor, T: int) -> int:
    """Tokens of the largest tree the dense layout would build: a distinct prompt
    and all its rows' completion tokens but their last."""
    P = input_ids.size(1) - T
    mask = attention_mask.bool()
    _, inverse = distinct_prompts(input_ids[:, :P], mask[:, :P])
    fed = (mask[:, P:].sum(1) - 1).clamp(min=0)
    per_tree = torch.zeros(int(inverse.max()) + 1, dtype=torch.long, device=fed.device)
    per_tree.index_add_(0, inverse, fed)
    firsts = torch.zeros_like(per_tree).scatter_(0, inverse, mask[:, :P].sum(1))
    return int((per_tree + firsts).max())


def takes_kv_tree(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    T: int,
    limit: int | None = None,
) -> bool:
    """Whether the tree layout runs this micro-batch through the KV cache: its
    largest tree is over `limit` tokens and every layer of `model` is attention
    (a linear-attention or state-space layer's cache holds a state, not keys and
    values that can be copied to the rows). `limit`: `DENSE_TREE_TOKENS` unless given."""
    if not len(input_ids) or T < 1:
        return False
    config = hf_config(model)
    if config is None:
        return False
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    if not kinds <= {"full_attention", "sliding_attention"}:
        return False
    return largest_tree(input_ids, attention_mask, T) > (
        DENSE_TREE_TOKENS if limit is None else limit
    )


@dataclass
class Tree:
    """A batch as its distinct prompts and its rows' completions."""

    prompt_ids: torch.Tensor  # [U, Q] distinct prompts, left-padded
    prompt_mask: torch.Tensor  # [U, Q]
    prompt_positions: torch.Tensor  # [U, Q] (padding: 0)
    inverse: torch.Tensor  # [B] each row's distinct prompt
    completion_ids: torch.Tensor  # [B, T - 1] each completion but its last column
    mask: torch.Tensor  # [B, Q + T - 1] the completions' forward's 2D mask
    completion_positions: torch.Tensor  # [B, T - 1], going on from the row's prompt
    scored: torch.Tensor  # [B, T] bool: the completion tokens (not padding)
    prompt_source: torch.Tensor  # [U, Q] flat index (b * (P + T) + column), -1: padding
    completion_source: torch.Tensor  # [B, T - 1] the same for the completions

    def gather(self, per_token: torch.Tensor, fill: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, P + T, ...] values of the batch's tokens (MoE routes) in the order of
        the two forwards: ([U * Q, ...], [B * (T - 1), ...]), `fill` on padding."""
        flat = per_token.reshape(-1, *per_token.shape[2:])

        def take(source: torch.Tensor) -> torch.Tensor:
            index = source.reshape(-1).to(flat.device)
            out = flat[index.clamp(min=0)]
            return out.masked_fill((index < 0).view(-1, *[1] * (out.dim() - 1)), fill)

        return take(self.prompt_source), take(self.completion_source)


def tree(input_ids: torch.Tensor, attention_mask: torch.Tensor, T: int) -> Tree:
    """Lay out `input_ids` [B, P + T] (prompts left-padded, completions
    right-padded, no holes) as its distinct prompts and the completions."""
    B, width = input_ids.shape
    P = width - T
    mask = attention_mask.bool()
    _spans(mask, P)  # refuses holes, naming the key
    prompt_len = mask[:, :P].sum(1)
    first, inverse = distinct_prompts(input_ids[:, :P], mask[:, :P])
    rows = torch.arange(B, device=input_ids.device)
    Q = int(prompt_len.max())  # every row's prompt ends at column P
    columns = torch.arange(P - Q, P, device=input_ids.device)
    prompt_mask = mask[first][:, P - Q : P]
    fed = mask[:, P : P + T - 1]  # a completion's last token is fed nowhere
    completion_columns = torch.arange(P, P + T - 1, device=input_ids.device)
    return Tree(
        prompt_ids=input_ids[first][:, P - Q : P],
        prompt_mask=prompt_mask.long(),
        prompt_positions=(prompt_mask.long().cumsum(-1) - 1).clamp(min=0),
        inverse=inverse,
        completion_ids=input_ids[:, P : P + T - 1],
        mask=torch.cat([prompt_mask[inverse], fed], 1).long(),
        completion_positions=prompt_len[:, None] + completion_columns - P,
        scored=mask[:, P:],
        prompt_source=torch.where(prompt_mask, first[:, None] * width + columns, -1),
        completion_source=torch.where(fed, rows[:, None] * width + completion_columns, -1),
    )


def tree_outputs(
    laid: Tree,
    run: Callable[..., torch.Tensor],
    routed: Callable[[torch.Tensor | None], object],
    routes: torch.Tensor | None = None,
    completions_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs that predict each completion token: ([B, ...] at each row's
    last prompt token, for its token 0; [B, T - 1, ...] at its completion tokens
    0..T-2).

    `run(ids, mask, positions, cache, last)` is one forward filling `cache` and
    returning [R, L or 1, ...] per-position outputs (`last`: only the last
    position's are read). `routed(token_routes)` is the context that measures
    and replays MoE routes ([N, layers, k] in the forward's token order, or None);
    `completions_context()` is entered around the completions' forward (`lower_right`)."""
    # Full-attention layers for every kind: HF applies a sliding window through
    # the mask it builds from the cache positions, as in the sampler.
    cache = Cache(layer_class_to_replicate=DynamicLayer)
    prompt_routes = completion_routes = None
    if routes is not None:
        prompt_routes, completion_routes = laid.gather(routes)
    with routed(prompt_routes):
        first = run(laid.prompt_ids, laid.prompt_mask, laid.prompt_positions, cache, True)
    first = take_rows(first[:, -1], laid.inverse)  # a prompt's output, once per row
    if not laid.completion_ids.size(1):
        return first, first.new_zeros(len(first), 0, *first.shape[1:])
    cache.reorder_cache(laid.inverse)
    with routed(completion_routes), completions_context():
        rest = run(laid.completion_ids, laid.mask, laid.completion_positions, cache, False)
    return first, rest
