"""The training-side forward pass without padding, each prompt once per group
(trees past 2,048 tokens run over a KV cache instead: `meshrl.model.tree`).

A training batch is rectangular: [B, P + T], prompts left-padded, completions
right-padded, and GRPO's G completions of a prompt repeat that prompt G times.
`trainer.layout` chooses how the trainer, the reference and the critic run it:

- `padded`: the batch as it is (every pad token and every prompt copy computed);
- `packed`: each row's real tokens only, rows packed end to end;
- `tree` (the default): rows with the same prompt become one tree, the prompt
  once followed by each completion; a completion attends to the prompt and to
  its own earlier tokens only (a 4D attention mask), at the positions the
  padded layout gives it. The prompt's positions are computed once and receive
  the gradient of every completion of the group, which is the sum the padded
  layout computes G times over.

A completion's last token predicts nothing and no later token attends to it,
so it is not computed either. Trees (or rows) are packed first-fit, longest first, into rows as long as the
longest tree, so padding is left only at the ends of rows. The outputs that
score completion token j of row b are gathered back into the [B, T] layout the
losses read, with 0 where the padded layout has padding. The same math as
`padded`, up to the order of float sums (tests check 1e-5 relative).

Every HF causal LM that takes a 4D attention mask (transformers' eager and sdpa
attention) runs these layouts. HF applies no sliding window to a mask it is
given, so models with sliding-window layers (Gemma 2/3, Mistral) get one mask
per layer kind, the window cut by position distance.
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
        flat = per_token.reshape(-1, *per_token.shape[2:])
        index = self.source.reshape(-1).to(flat.device)  # the layout lives on the model's device
        out = flat[index.clamp(min=0)]
        return out.masked_fill((index < 0).view(-1, *[1] * (out.dim() - 1)), fill)

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


def _spans(mask: torch.Tensor, P: int) -> tuple[list[int], list[int]]:
    """Each row's prompt and completion lengths; refuses masks with holes."""
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
    return prompt_len.tolist(), completion_len.tolist()


def pack(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, T: int, share: bool = True
) -> Packed:
    """Lay out `input_ids` [B, P + T] as trees (`share`: rows with the same prompt
    share it) or as single rows, packed into rows of the longest tree's length."""
    B, width = input_ids.shape
    P = width - T
    prompt_len, completion_len = _spans(attention_mask.bool(), P)
    ids = input_ids.tolist()
    trees: dict = {}  # key -> (prompt tokens, member rows)
    for b in range(B):
        prompt = ids[b][P - prompt_len[b] : P]
        key = tuple(prompt) if share else b
        trees.setdefault(key, (prompt, []))[1].append(b)
    sized = [
        (len(p) + sum(max(completion_len[b] - 1, 0) for b in m), p, m) for p, m in trees.values()
    ]
    sized.sort(key=lambda s: -s[0])
    capacity = sized[0][0]
    bins: list[list] = []  # [used, [(prompt, members), ...]]
    for size, prompt, members in sized:
        target = next((x for x in bins if x[0] + size <= capacity), None)
        if target is None:
            target = [0, []]
            bins.append(target)
        target[0] += size
        target[1].append((prompt, members))
    # The layout is written into flat Python lists, row r at r * capacity, and made
    # tensors once: per-row tensor writes cost more than the model's step on small batches.
    R = len(bins)
    size = R * capacity
    tokens, positions = [0] * size, [0] * size
    tree = list(range(-1, -size - 1, -1))  # padding: each position a tree of its own
    member = [-2] * size  # -1: a prompt token; b: row b's completion
    source = [-1] * size  # flat index (b * width + column) of each token in the batch
    rows: list[int] = []
    cols: list[int] = []
    at: list[int] = []
    tree_id = 0
    for r, (_, content) in enumerate(bins):
        c = r * capacity
        for prompt, members in content:
            p = len(prompt)
            tokens[c : c + p] = prompt
            positions[c : c + p] = range(p)
            tree[c : c + p], member[c : c + p] = [tree_id] * p, [-1] * p
            first = members[0] * width + P - p
            source[c : c + p] = range(first, first + p)
            last_prompt = c + p - 1
            c += p
            for b in members:  # its tokens but the last, which predicts nothing
                t = completion_len[b]
                n = max(t - 1, 0)  # an empty completion (t = 0) lays out nothing
                tokens[c : c + n] = ids[b][P : P + n]
                positions[c : c + n] = range(p, p + n)
                tree[c : c + n], member[c : c + n] = [tree_id] * n, [b] * n
                source[c : c + n] = range(b * width + P, b * width + P + n)
                rows += [b] * t
                cols += range(t)
                at += [last_prompt, *range(c, c + n)][:t]
                c += n
            tree_id += 1

    def grid(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).view(R, capacity)

    tokens, positions, tree, member, source = map(grid, (tokens, positions, tree, member, source))
    causal = torch.ones(capacity, capacity, dtype=torch.bool).tril()
    same_tree = tree.unsqueeze(2) == tree.unsqueeze(1)
    visible = (member.unsqueeze(1) == -1) | (member.unsqueeze(2) == member.unsqueeze(1))
    device = input_ids.device
    return Packed(
        input_ids=tokens.to(device),
        position_ids=positions.to(device),
        allowed=(same_tree & visible & causal).to(device),
        rows=torch.tensor(rows, dtype=torch.long, device=device),
        cols=torch.tensor(cols, dtype=torch.long, device=device),
        at=torch.tensor(at, dtype=torch.long, device=device),
        shape=(B, T),
        source=source.to(device),
    )


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


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model under DDP (`module`) and peft (`get_base_model`), which pass
    keyword arguments through to it; FSDP2 keeps the class's forward."""
    model = getattr(model, "module", model)
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


def takes_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether the HF model computes logits at chosen positions only (`logits_to_keep`)."""
    return _takes_logits_to_keep(type(_unwrapped(model)))


@functools.cache  # asked at every decode step: the signature is read once per class
def _cache_keyword_of(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def cache_arg(model: torch.nn.Module, cache: object) -> dict:
    """`cache` as the keyword argument `model`'s forward takes it: transformers
    renamed `past_key_values` to `cache` (5.2x)."""
    return {_cache_keyword_of(type(_unwrapped(model))): cache}


def _cache_of(out) -> object:
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
    return take_rows(logits.reshape(-1, logits.size(-1)), index)


def take_rows(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`values[index]` along dim 0 for an `index` that repeats rows (a prompt's last
    position predicts the first token of each completion of its group), whose
    backward sums each row's copies in the same order every time. On the CPU,
    indexing's backward (index_put_ with accumulate) adds them from every thread
    at once past torch's grain of 32,768 elements, in whatever order they come:
    the same batch gave float-rounding-different weights now and then
    (benchmarks/elastic.py's run against a fixed pool). index_select's backward
    (index_add_) adds them in index order there. On CUDA it is the other way
    round (indexing's backward sorts; index_add_ adds atomically), so indexing stays."""
    if values.device.type == "cpu":
        return values.index_select(0, index)
    return values[index]


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


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device
