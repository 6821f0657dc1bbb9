"""The reshard plan: which block of each parameter every proc of a layout holds,
and which byte ranges each proc of a replica's layout reads from which trainer
proc. Pure arithmetic (no torch.distributed), so every pair of layouts can be
checked in a unit test.

A layout is `pp` × `dp` × `tp` procs (the device mesh ("pp", "dp", "tp") of
`meshrl.procs.parallel`), numbered data-parallel coordinate first: rank
r = (i * pp + s) * tp + j at pipeline rank s, dp coordinate i, tp coordinate j,
so the procs that take one data-parallel shard of a batch (a pipeline of
tensor-parallel groups) are adjacent, as the controller hands shards out:

- pipeline parallelism (`pp` > 1) puts each parameter on one pipeline rank `s`
  (the `stage` argument; `stage_of` finds it from an HF name): the procs of the
  other pipeline ranks hold none of it (`block` is None for them);
- tensor parallelism (`tp` > 1) splits each parameter by its style: `colwise`
  (a linear layer's output features and bias: dim 0), `rowwise` (its input
  features: dim 1; the bias stays whole) or `replicate` (norms, embeddings, the
  head: every tp rank holds all of it);
- `fsdp` then splits dim 0 of each tp block over the `dp` ranks (FSDP2's
  `Shard(0)` of the local tensor); without it the dp ranks are replicas;
- expert parallelism (`ep` > 1, always over every dp rank: ep == dp, tp == pp
  == 1) splits the `expert` parameters, a mixture of experts' stacked experts
  of shape [E, ...] (`parameter_style`), on dim 0 over the dp ranks: dp rank i
  holds experts chunk(E, ep, i) whole. FSDP leaves them out of its sharding, so
  with `fsdp` too they are split over ep only; every other parameter follows
  dp/fsdp as above. With ep == 1 an `expert` parameter is a `replicate` one.

Splits follow `torch.chunk` (and so DTensor's `Shard`): parts of ceil(n / k),
the last ones shorter or empty. Each element of a parameter has exactly one
owner: the proc of its pipeline rank that holds it with coordinate 0 on every
mesh dim that replicates it. Owners publish; a replica proc reads, from the
owners, exactly the intersection of their blocks with its own, so no proc reads
more than its share.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

STYLES = ("colwise", "rowwise", "replicate", "expert")

NAMES = ("ddp", "fsdp", "tp", "fsdp_tp", "pp", "fsdp_pp", "fsdp_tp_pp", "ep", "fsdp_ep")
"""The layouts `Layout.named` knows (`placement.sharding`)."""

FIRST_STAGE = ("model.embed_tokens",)
"""HF name prefixes of the parameters before the decoder layers: the first stage."""
LAST_STAGE = ("model.norm", "lm_head")
"""HF name prefixes of the parameters after the decoder layers: the last stage."""
LAYER = re.compile(r"model\.layers\.(\d+)\.")
"""An HF decoder layer's parameter: the layer's index."""

Block = tuple[tuple[int, int], ...]
"""[start, stop) per dim of the full parameter."""


@dataclass(frozen=True)
class Layout:
    """`pp` × `dp` × `tp` procs; `fsdp`: dim 0 of each tp block sharded over dp;
    `ep`: the expert parameters split on dim 0 over the dp ranks (1 or dp)."""

    dp: int = 1
    tp: int = 1
    fsdp: bool = False
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for dim in ("dp", "tp", "pp", "ep"):
            if getattr(self, dim) < 1:
                raise ValueError(f"Layout: {dim}={getattr(self, dim)} is not a degree (>= 1)")
        if self.ep > 1 and (self.tp > 1 or self.pp > 1):
            raise ValueError(
                f"Layout: ep={self.ep} with tp={self.tp}, pp={self.pp} is not supported"
                " (experts are split over the data-parallel procs only)"
            )
        if self.ep not in (1, self.dp):
            raise ValueError(f"Layout: ep={self.ep} is neither 1 nor dp={self.dp}")

    @property
    def size(self) -> int:
        return self.pp * self.dp * self.tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pipeline rank s, dp coordinate i, tp coordinate j) of `rank`."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank={rank} is not one of the {self.size} procs of {self}")
        i, rest = divmod(rank, self.pp * self.tp)
        s, j = divmod(rest, self.tp)
        return s, i, j

    def rank(self, s: int, i: int, j: int) -> int:
        """The rank at pipeline rank `s`, dp coordinate `i`, tp coordinate `j`."""
        return (i * self.pp + s) * self.tp + j

    @staticmethod
    def named(sharding: str, procs: int, tp: int = 1, pp: int = 1, ep: int = 1) -> Layout:
        """A trainer's layout from `placement.sharding` over `procs` procs, one of
        `NAMES`. `tp`: the tensor-parallel degree of fsdp_tp and fsdp_tp_pp; `pp`:
        the pipeline degree (> 1) of pp, fsdp_pp and fsdp_tp_pp, the dp ranks of
        each pipeline rank DDP replicas or FSDP2 shards; `ep`: the expert-parallel
        degree, which must be the number of data-parallel procs, `procs` (ep and
        fsdp_ep take it when left 1; ddp and fsdp given it are ep and fsdp_ep);
        ep goes with neither tp nor pp."""
        if sharding not in NAMES:
            raise ValueError(f"'{sharding}' is not one of {', '.join(NAMES)}")
        fsdp = sharding.startswith("fsdp")
        if sharding.endswith("ep") or ep != 1:
            if sharding not in ("ddp", "fsdp", "ep", "fsdp_ep") or tp != 1 or pp != 1:
                raise ValueError(
                    f"{sharding}: ep={ep} is not supported with tensor or pipeline"
                    f" parallelism (tp={tp}, pp={pp}): experts split over the dp procs only"
                )
            ep = procs if ep == 1 else ep
            if ep != procs:
                raise ValueError(
                    f"{sharding}: ep={ep} is not the {procs} data-parallel procs"
                    " (experts are split over every data-parallel proc)"
                )
            return Layout(dp=procs, ep=ep, fsdp=fsdp)
        if not sharding.endswith("pp"):
            if pp != 1:
                raise ValueError(
                    f"{sharding}: pp={pp} is not supported (pipelined: pp, fsdp_pp, fsdp_tp_pp)"
                )
            if sharding == "tp":
                return Layout(tp=procs)
            if sharding in ("ddp", "fsdp"):
                return Layout(dp=procs, fsdp=fsdp)
        if "tp" in sharding:
            if tp < 1 or procs % tp:
                raise ValueError(f"{sharding}: tp={tp} does not divide {procs} procs")
        elif tp != 1:
            raise ValueError(f"{sharding}: tp={tp} is not supported (fsdp_tp_pp has tp and pp)")
        dp = procs // tp
        if sharding.endswith("pp"):
            degrees = [d for d in range(2, dp + 1) if dp % d == 0]
            if pp not in degrees:
                at = f" at tp={tp}" if tp > 1 else ""
                listed = ", ".join(map(str, degrees)) or "none (pp > 1 must divide them)"
                raise ValueError(
                    f"{sharding}: pp={pp} is not one of the pipeline degrees of"
                    f" {procs} procs{at}: {listed}"
                )
            dp //= pp
        return Layout(dp=dp, tp=tp, pp=pp, fsdp=fsdp)


def parameter_style(name: str, shape: tuple[int, ...]) -> str | None:
    """ "expert" for a mixture of experts' stacked experts: a 3-D parameter under
    `.mlp.experts.` (HF transformers 5 stores Qwen3-MoE's as
    `model.layers.N.mlp.experts.gate_up_proj` [E, 2I, H] and `.down_proj`
    [E, H, I]); None for any other (its style is its tensor-parallel one).
    Per-expert modules (`...experts.3.up_proj.weight`, 2-D) are not stacked."""
    return "expert" if ".mlp.experts." in name and len(shape) == 3 else None


def stage_layers(num_layers: int, stages: int) -> list[range]:
    """The decoder layers of each of `stages` pipeline stages: contiguous, as even
    as can be, the earlier stages taking the extra layers (5 over 2: 0-2, 3-4)."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"{stages} pipeline stages do not fit {num_layers} decoder layers")
    size, extra = divmod(num_layers, stages)
    out, start = [], 0
    for k in range(stages):
        stop = start + size + (k < extra)
        out.append(range(start, stop))
        start = stop
    return out


def pipeline_rank(stage: int, pp: int, virtual: int) -> int:
    """The pipeline rank that runs `stage` of pp × `virtual` stages when each of
    the `pp` ranks holds `virtual` of them in loop style (interleaved schedules):
    stage k on rank k % pp."""
    if pp < 1 or virtual < 1 or not 0 <= stage < pp * virtual:
        raise ValueError(f"stage={stage} is not one of the {pp} × {virtual} pipeline stages")
    return stage % pp


def stage_of(name: str, num_layers: int, pp: int, virtual: int = 1) -> int:
    """The pipeline rank that holds the HF parameter `name` of a model of
    `num_layers` decoder layers split into pp × `virtual` stages (`stage_layers`,
    `pipeline_rank`): a layer's parameter its layer's stage's, `FIRST_STAGE`'s
    the first stage's, `LAST_STAGE`'s the last's."""
    stages = pp * virtual
    layers = stage_layers(num_layers, stages)
    if any(name.startswith(prefix + ".") for prefix in FIRST_STAGE):
        return pipeline_rank(0, pp, virtual)
    if any(name.startswith(prefix + ".") for prefix in LAST_STAGE):
        return pipeline_rank(stages - 1, pp, virtual)
    match = LAYER.match(name)
    if match is None:
        raise ValueError(
            f"'{name}' is neither a decoder layer's parameter (model.layers.N.) nor"
            f" under {', '.join(FIRST_STAGE + LAST_STAGE)}: no pipeline stage holds it"
        )
    layer = int(match.group(1))
    for stage, held in enumerate(layers):
        if layer in held:
            return pipeline_rank(stage, pp, virtual)
    raise ValueError(f"'{name}': layer {layer} is not one of the {num_layers} decoder layers")


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
    whether dim 0 is split over the dp ranks: by FSDP2, or by expert parallelism
    for an expert parameter (tp is 1 then, so the split is the same chunk)."""
    if style not in STYLES:
        raise ValueError(f"style '{style}' is not one of {', '.join(STYLES)}")
    dim = {"colwise": 0, "rowwise": 1}.get(style)
    tp_dim = dim if layout.tp > 1 and dim is not None and dim < len(shape) else None
    experts = style == "expert" and layout.ep > 1
    return tp_dim, (layout.fsdp or experts) and layout.dp > 1 and len(shape) > 0


def _check_stage(layout: Layout, stage: int) -> None:
    if not 0 <= stage < layout.pp:
        raise ValueError(f"stage={stage} is not one of the pp={layout.pp} pipeline ranks")


def holds(layout: Layout, rank: int, *, stage: int = 0) -> bool:
    """Whether `rank` is on pipeline rank `stage`, the one holding the parameter."""
    _check_stage(layout, stage)
    return layout.coords(rank)[0] == stage


def block(
    layout: Layout, rank: int, shape: tuple[int, ...], style: str, *, stage: int = 0
) -> Block | None:
    """The block of a parameter of `shape` and `style` on pipeline rank `stage`
    that `rank` holds; None when `rank` is on another pipeline rank."""
    if not holds(layout, rank, stage=stage):
        return None
    _, i, j = layout.coords(rank)
    tp_dim, dp_splits = _splits(layout, shape, style)
    spans = [(0, n) for n in shape]
    if tp_dim is not None:
        spans[tp_dim] = chunk(shape[tp_dim], layout.tp, j)
    if dp_splits:
        start, stop = spans[0]
        a, b = chunk(stop - start, layout.dp, i)
        spans[0] = (start + a, start + b)
    return tuple(spans)


def owns(layout: Layout, rank: int, shape: tuple[int, ...], style: str, *, stage: int = 0) -> bool:
    """Whether `rank` publishes its block: on pipeline rank `stage`, with
    coordinate 0 on every mesh dim that replicates the parameter (dp without fsdp
    or experts split over ep; tp for what tp does not split)."""
    if not holds(layout, rank, stage=stage):
        return False
    _, i, j = layout.coords(rank)
    tp_dim, dp_splits = _splits(layout, shape, style)
    return (j == 0 or tp_dim is not None) and (i == 0 or dp_splits)


def intersect(a: Block, b: Block) -> Block | None:
    """The block both hold, None when they share no element."""
    spans = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return None if any(stop <= start for start, stop in spans) else spans


def numel(b: Block) -> int:
    return math.prod(stop - start for start, stop in b)


def sources(
    layout: Layout, shape: tuple[int, ...], style: str, *, stage: int = 0
) -> dict[int, Block]:
    """The owners of a parameter on pipeline rank `stage` of `layout` and the
    block each publishes."""
    out = {}
    for r in range(layout.size):
        if owns(layout, r, shape, style, stage=stage):
            out[r] = block(layout, r, shape, style, stage=stage)
    return out


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
    source: Layout, target: Layout, shape: tuple[int, ...], style: str, *, stage: int = 0
) -> dict[int, list[tuple[int, Block]]]:
    """Per proc of one replica of layout `target` (not pipelined): (trainer rank,
    block) it reads of a parameter of `shape` and `style` published from pipeline
    rank `stage` of layout `source`."""
    if target.pp != 1:
        raise ValueError(f"a replica is not pipelined: target pp={target.pp}")
    published = sources(source, shape, style, stage=stage)
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
