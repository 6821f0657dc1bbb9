"""The training-side forward pass without padding, each prompt once per group.

A training batch is rectangular: [B, P + T], prompts left-padded, completions
right-padded, and GRPO's G completions of a prompt repeat that prompt G times.
`trainer.layout` chooses how the trainer, the reference and the critic run it:

- `padded`: the batch as it is (every pad token and every prompt copy computed);
- `packed`: each row's real tokens only, rows packed end to end (`pack`), one
  [R, 1, L, L] attention mask keeping each row to itself;
- `tree` (the default): two forwards over a KV cache (`tree`). The batch's
  distinct prompts run once, as a left-padded [U, Q] batch; their cache is
  copied to the B rows (each row's distinct prompt) and the completions
  [B, T - 1] run over it, with a 2D mask over prompt and completion and the
  positions the padded layout gives them. No mask of the packed length is
  built: HF makes the causal part, of size (T - 1) x (Q + T - 1) per row, as
  it does at a decode step. The cache copy is differentiable, so a prompt's
  keys and values receive the gradient of every completion of its group, the
  sum the padded layout computes G times over.

A completion's last token predicts nothing and no later token attends to it,
so neither layout computes it. The outputs that score completion token j of
row b are laid out as the [B, T] the losses read, 0 where the padded layout
has padding. The same math as `padded`, up to the order of float sums (tests
check 1e-5 relative).

`packed` runs on every HF causal LM that takes a 4D attention mask (eager and
sdpa attention); HF applies no sliding window to a mask it is given, so models
with sliding-window layers (Gemma 2/3, Mistral) get one mask per layer kind,
the window cut by position distance. `tree` runs on attention-only models (full
or sliding-window layers), where HF applies the window itself over the cache;
a model with other layers (linear attention, state spaces) runs padded
(`tree_supported`).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch

from meshrl.config.trainer import LAYOUTS  # noqa: F401 - the layouts' names live with their key


@dataclass
class Packed:
    """A batch laid out as packed rows, and where each scored token's output is."""

    input_ids: torch.Tensor  # [R, L]
    position_ids: torch.Tensor  # [R, L]
    allowed: torch.Tensor  # [R, L, L] bool: query (dim 1) may attend to key (dim 2)
    rows: torch.Tensor  # [N] batch row of each scored completion token
    cols: torch.Tensor  # [N] its completion column (0..T-1)
    at: torch.Tensor  # [N] flat packed index (r * L + c) of the position predicting it
    shape: tuple[int, int]  # (B, T) of the batch
    source: torch.Tensor  # [R, L] flat index (b * (P + T) + column) of each token, -1: padding

    def gather(self, per_token: torch.Tensor, fill: int = -1) -> torch.Tensor:
        """[B, P + T, ...] values of the batch's tokens (e.g. MoE routes) laid out as
        the packed rows: [R * L, ...], `fill` on padding."""
        return _take(per_token, self.source, fill)

    def attention_mask(
        self, dtype: torch.dtype, config: object = None
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """[R, 1, L, L] additive mask (0 where allowed), which eager and sdpa read
        alike. For a model `config` with sliding-window layers, HF's per-kind
        mapping instead: the sliding layers' mask also blocks keys `window` or
        more positions back (as HF's own `kv_idx > q_idx - window`)."""
        mask = self._additive(self.allowed, dtype)
        kinds = set(getattr(config, "layer_types", None) or ())
        window = getattr(config, "sliding_window", None)
        if "sliding_attention" not in kinds or not window:
            return mask
        distance = self.position_ids.unsqueeze(2) - self.position_ids.unsqueeze(1)
        near = self._additive(self.allowed & (distance < window), dtype)
        return {"full_attention": mask, "sliding_attention": near}

    @staticmethod
    def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        zero = torch.zeros((), dtype=dtype, device=allowed.device)
        return torch.where(allowed, zero, torch.finfo(dtype).min).unsqueeze(1)

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """[N] per scored token -> [B, T], 0 on padding (differentiable)."""
        out = values.new_zeros(self.shape)
        return out.index_put((self.rows, self.cols), values)


def _take(per_token: torch.Tensor, source: torch.Tensor, fill: int) -> torch.Tensor:
    """[B, W, ...] values at the flat indices `source` (b * W + column; -1: `fill`),
    flattened: [source.numel(), ...]."""
    flat = per_token.reshape(-1, *per_token.shape[2:])
    index = source.reshape(-1).to(flat.device)  # the layout lives on the model's device
    out = flat[index.clamp(min=0)]
    return out.masked_fill((index < 0).view(-1, *[1] * (out.dim() - 1)), fill)


def _spans(mask: torch.Tensor, P: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's prompt and completion lengths [B]; refuses masks with holes."""
    prompt_len = mask[:, :P].sum(1)
    completion_len = mask[:, P:].sum(1)
    columns = torch.arange(mask.size(1), device=mask.device)
    expected = (columns >= P - prompt_len.unsqueeze(1)) & (
        columns < P + completion_len.unsqueeze(1)
    )
    if not torch.equal(expected, mask):
        raise ValueError(
            "config key 'trainer.layout': packed layouts need left-padded prompts and "
            "right-padded completions without holes; use trainer.layout=padded"
        )
    return prompt_len, completion_len


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, T: int) -> Packed:
    """Lay out `input_ids` [B, P + T] as each row's real tokens, packed first-fit,
    longest first, into rows of the longest row's length."""
    B, width = input_ids.shape
    P = width - T
    prompt_len, completion_len = (s.tolist() for s in _spans(attention_mask.bool(), P))
    ids = input_ids.tolist()
    # A row's tokens but the last completion token (an empty completion: the prompt).
    sized = sorted(
        ((prompt_len[b] + max(completion_len[b] - 1, 0), b) for b in range(B)),
        key=lambda s: -s[0],
    )
    capacity = sized[0][0]
    bins: list[list] = []  # [used, [row, ...]]
    for size, b in sized:
        target = next((x for x in bins if x[0] + size <= capacity), None)
        if target is None:
            target = [0, []]
            bins.append(target)
        target[0] += size
        target[1].append(b)
    R = len(bins)
    tokens = torch.zeros(R, capacity, dtype=torch.long)
    positions = torch.zeros(R, capacity, dtype=torch.long)
    segment = torch.arange(-1, -R * capacity - 1, -1).view(R, capacity)  # padding: its own
    source = torch.full((R, capacity), -1, dtype=torch.long)
    rows, cols, at = [], [], []
    for r, (_, members) in enumerate(bins):
        c = 0
        for b in members:
            p, t = prompt_len[b], completion_len[b]
            n = p + max(t - 1, 0)
            columns = torch.arange(P - p, P - p + n)
            tokens[r, c : c + n] = torch.tensor(ids[b], dtype=torch.long)[columns]
            positions[r, c : c + n] = torch.arange(n)
            segment[r, c : c + n] = b
            source[r, c : c + n] = b * width + columns
            rows += [b] * t
            cols += range(t)
            at += range(r * capacity + c + p - 1, r * capacity + c + p - 1 + t)
            c += n
    causal = torch.ones(capacity, capacity, dtype=torch.bool).tril()
    same_row = segment.unsqueeze(2) == segment.unsqueeze(1)
    device = input_ids.device
    return Packed(
        input_ids=tokens.to(device),
        position_ids=positions.to(device),
        allowed=(same_row & causal).to(device),
        rows=torch.tensor(rows, dtype=torch.long, device=device),
        cols=torch.tensor(cols, dtype=torch.long, device=device),
        at=torch.tensor(at, dtype=torch.long, device=device),
        shape=(B, T),
        source=source.to(device),
    )


def distinct_prompts(
    ids: torch.Tensor, mask: torch.Tensor, extra: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(first row of each distinct prompt [U], each row's distinct prompt [B]);
    `extra` [B]: rows differ also where it does (their images)."""
    keys = torch.where(mask.bool(), ids, -1)
    if extra is not None:
        keys = torch.cat([keys, extra[:, None].to(keys)], 1)
    _, inverse = torch.unique(keys, dim=0, return_inverse=True)
    first = torch.full((int(inverse.max()) + 1,), ids.size(0), dtype=torch.long, device=ids.device)
    first = first.scatter_reduce(0, inverse, torch.arange(ids.size(0), device=ids.device), "amin")
    return first, inverse


@dataclass
class Tree:
    """A batch as its distinct prompts and the rows' completions (`tree`): the
    prompts run first and fill a KV cache, the completions run over its copy."""

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
        """[B, P + T, ...] values of the batch's tokens (e.g. MoE routes) laid out as
        the two forwards take them: ([U * Q, ...], [B * (T - 1), ...]), `fill`
        on padding."""
        return (
            _take(per_token, self.prompt_source, fill),
            _take(per_token, self.completion_source, fill),
        )


def tree(input_ids: torch.Tensor, attention_mask: torch.Tensor, T: int) -> Tree:
    """Lay out `input_ids` [B, P + T] as its distinct prompts and the completions."""
    B, width = input_ids.shape
    P = width - T
    mask = attention_mask.bool()
    prompt_len, completion_len = _spans(mask, P)
    first, inverse = distinct_prompts(input_ids[:, :P], mask[:, :P])
    Q = int(prompt_len.max()) if B else 0  # every row's prompt ends at column P
    columns = torch.arange(P - Q, P, device=input_ids.device)
    prompt_mask = mask[first][:, P - Q : P]
    rows = torch.arange(B, device=input_ids.device)[:, None]
    fed = mask[:, P : P + T - 1]  # a completion's last token is fed nowhere
    completion_columns = torch.arange(P, P + max(T - 1, 0), device=input_ids.device)
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
        completion_source=torch.where(fed, rows * width + completion_columns, -1),
    )


def tree_supported(model: torch.nn.Module) -> bool:
    """Whether `tree` runs `model`: its layers are all attention (full or
    sliding-window). A linear-attention or state-space layer's cache holds a
    recurrent state rather than keys and values, which the copy to the rows
    and the gradient through it are not checked for."""
    config = hf_config(model)
    if config is None:
        return False
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    return kinds <= {"full_attention", "sliding_attention"}


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model under a DDP wrapper (`module`) and peft (`get_base_model`); FSDP2
    keeps the class's forward."""
    model = getattr(model, "module", model)
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


@functools.cache
def _takes_logits_to_keep(cls: type) -> bool:
    return "logits_to_keep" in inspect.signature(cls.forward).parameters


def hf_config(model: torch.nn.Module) -> object:
    """The HF config of `model`, through a DDP wrapper (`module`) and a value
    model (its `backbone`); peft and FSDP2 pass `config` through."""
    model = getattr(model, "module", model)
    return getattr(model, "config", None) or getattr(
        getattr(model, "backbone", None), "config", None
    )


def takes_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether the HF model computes logits at chosen positions only
    (`logits_to_keep`). DDP wraps it (`module`); peft passes keyword arguments
    through to it (`get_base_model`); FSDP2 keeps its forward."""
    return _takes_logits_to_keep(type(_unwrapped(model)))


def cache_keyword(model: torch.nn.Module) -> str:
    """The forward's KV-cache argument: transformers renamed `past_key_values` to
    `cache` (5.2x); take either (through DDP and peft, as `takes_logits_to_keep`)."""
    return _cache_keyword_of(type(_unwrapped(model)))


@functools.cache  # asked at every decode step: the signature is read once per class
def _cache_keyword_of(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def cache_of(out) -> object:
    """The KV cache a forward returned, under either name."""
    return out.cache if getattr(out, "cache", None) is not None else out.past_key_values


def packed_logits(model: torch.nn.Module, packed: Packed, dtype: torch.dtype) -> torch.Tensor:
    """[N, V] logits at the positions that predict the scored tokens."""
    width = packed.input_ids.size(1)
    keep = torch.unique(packed.at % width)  # columns any row needs logits at
    kwargs = {}
    if takes_logits_to_keep(model):
        kwargs["logits_to_keep"] = keep
    out = model(
        input_ids=packed.input_ids,
        attention_mask=packed.attention_mask(dtype, hf_config(model)),
        position_ids=packed.position_ids,
        use_cache=False,
        **kwargs,
    )
    logits = out.logits
    if "logits_to_keep" in kwargs:  # column c of the row sits at keep's index of c
        index = (packed.at // width) * keep.numel() + torch.searchsorted(keep, packed.at % width)
    else:
        index = packed.at
    return logits.reshape(-1, logits.size(-1))[index]


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype
