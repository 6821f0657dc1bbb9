"""The reshard plan: which block of each parameter every proc of a layout holds,
and which byte ranges each proc of a replica's layout reads from which trainer
proc. Pure arithmetic (no torch.distributed), so every pair of layouts can be
checked in a unit test.

A layout is `dp` × `tp` procs, rank r at (i, j) = (r // tp, r % tp), the order
torch's device mesh gives the trainer's procs (`meshrl.procs.parallel`):

- tensor parallelism (`tp` > 1) splits each parameter by its style: `colwise`
  (a linear layer's output features and bias: dim 0), `rowwise` (its input
  features: dim 1; the bias stays whole) or `replicate` (norms, embeddings, the
  head: every tp rank holds all of it);
- `fsdp` then splits dim 0 of each tp block over the `dp` ranks (FSDP2's
  `Shard(0)` of the local tensor); without it the dp ranks are replicas.

Splits follow `torch.chunk` (and so DTensor's `Shard`): parts of ceil(n / k),
the last ones shorter or empty. Each element of a parameter has exactly one
owner: the proc that holds it with coordinate 0 on every mesh dim that
replicates it. Owners publish; a replica proc reads, from the owners, exactly
the intersection of their blocks with its own, so no proc reads more than its
share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

STYLES = ("colwise", "rowwise", "replicate")

Block = tuple[tuple[int, int], ...]
"""[start, stop) per dim of the full parameter."""


@dataclass(frozen=True)
class Layout:
    """`dp` × `tp` procs; `fsdp`: dim 0 of each tp block sharded over dp."""

    dp: int = 1
    tp: int = 1
    fsdp: bool = False

    @property
    def size(self) -> int:
        return self.dp * self.tp

    @staticmethod
    def named(sharding: str, procs: int, tp: int = 1) -> Layout:
        """A trainer's layout from `placement.sharding` over `procs` procs (`tp`:
        the tensor-parallel degree of `fsdp_tp`): ddp, fsdp, tp or fsdp_tp."""
        if sharding == "ddp":
            return Layout(dp=procs)
        if sharding == "fsdp":
            return Layout(dp=procs, fsdp=True)
        if sharding == "tp":
            return Layout(tp=procs)
        if sharding == "fsdp_tp":
            if tp < 1 or procs % tp:
                raise ValueError(f"fsdp_tp: tp={tp} does not divide {procs} procs")
            return Layout(dp=procs // tp, tp=tp, fsdp=True)
        raise ValueError(f"'{sharding}' is not one of ddp, fsdp, tp, fsdp_tp")


def chunk(extent: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part `index` of `extent` split like `torch.chunk`."""
    size = -(-extent // parts) if extent else 0
    start = min(index * size, extent)
    return start, min(start + size, extent)


def span(start: tuple[int, ...], shape: tuple[int, ...]) -> Block:
    """The block of `shape` that starts at `start`."""
    return tuple((a, a + n) for a, n in zip(start, shape, strict=True))


def _splits(layout: Layout, shape: tuple[int, ...], style: str) -> tuple[int | None, bool]:
    """The dim tensor parallelism splits (None: it replicates the parameter), and
    whether FSDP2 splits dim 0 over the dp ranks."""
    if style not in STYLES:
        raise ValueError(f"style '{style}' is not one of {', '.join(STYLES)}")
    dim = {"colwise": 0, "rowwise": 1}.get(style)
    tp_dim = dim if layout.tp > 1 and dim is not None and dim < len(shape) else None
    return tp_dim, layout.fsdp and layout.dp > 1 and len(shape) > 0


def block(layout: Layout, rank: int, shape: tuple[int, ...], style: str) -> Block:
    """The block of a parameter of `shape` and `style` that `rank` holds."""
    i, j = divmod(rank, layout.tp)
    tp_dim, dp_splits = _splits(layout, shape, style)
    spans = [(0, n) for n in shape]
    if tp_dim is not None:
        spans[tp_dim] = chunk(shape[tp_dim], layout.tp, j)
    if dp_splits:
        start, stop = spans[0]
        a, b = chunk(stop - start, layout.dp, i)
        spans[0] = (start + a, start + b)
    return tuple(spans)


def owns(layout: Layout, rank: int, shape: tuple[int, ...], style: str) -> bool:
    """Whether `rank` publishes its block: coordinate 0 on every mesh dim that
    replicates the parameter (dp without fsdp; tp for what tp does not split)."""
    i, j = divmod(rank, layout.tp)
    tp_dim, dp_splits = _splits(layout, shape, style)
    return (j == 0 or tp_dim is not None) and (i == 0 or dp_splits)


def intersect(a: Block, b: Block) -> Block | None:
    """The block both hold, None when they share no element."""
    spans = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return None if any(stop <= start for start, stop in spans) else spans


def numel(b: Block) -> int:
    return math.prod(stop - start for start, stop in b)


def sources(layout: Layout, shape: tuple[int, ...], style: str) -> dict[int, Block]:
    """The owners of a parameter in `layout` and the block each publishes."""
    return {
        r: block(layout, r, shape, style)
        for r in range(layout.size)
        if owns(layout, r, shape, style)
    }


def reads(held: Block, published: dict[int, Block]) -> list[tuple[int, Block]]:
    """What a proc that holds `held` reads: (owner, block) for each owner's
    published block that overlaps it, the overlap only."""
    out = []
    for rank, theirs in published.items():
        common = intersect(held, theirs)
        if common is not None:
            out.append((rank, common))
    return out


def plan(
    source: Layout, target: Layout, shape: tuple[int, ...], style: str
) -> dict[int, list[tuple[int, Block]]]:
    """Per proc of one replica of layout `target`: (trainer rank, block) it reads
    of a parameter of `shape` and `style` published from layout `source`."""
    published = sources(source, shape, style)
    return {r: reads(block(target, r, shape, style), published) for r in range(target.size)}


def relative(inner: Block, outer: Block) -> tuple[slice, ...]:
    """`inner`'s index within a tensor that holds `outer` (inner ⊆ outer)."""
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(inner, outer, strict=True))


def replica_parts(model, tp: int):
    """`split` for a `WeightPublisher` whose replicas are tensor-parallel over
    `tp` procs: per parameter of `model` (by its HF name), the blocks those procs
    hold, by the model's tp plan (`meshrl.procs.tensor_parallel`)."""
    from meshrl.procs.tensor_parallel import parameter_styles

    styles = parameter_styles(model)
    layout = Layout(tp=tp)

    def parts(name: str, shape: tuple[int, ...]) -> list[Block]:
        style = styles.get(name, "replicate")
        return [block(layout, rank, shape, style) for rank in range(tp)]

    return parts
