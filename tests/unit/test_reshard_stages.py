"""The reshard plan (`meshrl.procs.reshard`) with pipeline stages and expert
parallelism: for every trainer layout of up to 4 procs (ddp, fsdp, tp, fsdp_tp,
pp, fsdp_pp, fsdp_tp_pp, ep, fsdp_ep) and every tensor-parallel replica of up to
4 procs, each parameter (of every style, on every pipeline rank) has exactly one
owner per element, all on its pipeline rank, and each replica proc reads every
element of its share exactly once, from an owner that publishes it. Pure
arithmetic, element by element; the torch.chunk splits themselves are checked in
tests/unit/test_reshard.py."""

import contextlib
import itertools
from collections import Counter

import pytest

from meshrl.procs.reshard import (
    FIRST_STAGE,
    LAST_STAGE,
    NAMES,
    Layout,
    block,
    chunk,
    holds,
    intersect,
    numel,
    owns,
    parameter_style,
    pipeline_rank,
    plan,
    sources,
    stage_layers,
    stage_of,
)

pytestmark = pytest.mark.unit


def source_layouts() -> list[Layout]:
    """Every trainer layout `Layout.named` gives for 1..4 procs, tp and pp in
    {1, 2, 4}, with and without ep."""
    out = set()
    for name, procs, tp, pp in itertools.product(NAMES, range(1, 5), (1, 2, 4), (1, 2, 4)):
        for ep in {1, procs}:
            with contextlib.suppress(ValueError):  # not a layout of these degrees
                out.add(Layout.named(name, procs, tp, pp, ep))
    return sorted(out, key=lambda x: (x.size, x.pp, x.dp, x.tp, x.fsdp, x.ep))


SOURCES = source_layouts()
TARGETS = [Layout(tp=t) for t in (1, 2, 4)]
PARAMETERS = [  # (shape, style): 2-D weights divisible or not, 1-D biases and norms, experts
    ((12, 8), "colwise"),
    ((10, 6), "colwise"),
    ((5, 3), "rowwise"),
    ((7, 9), "rowwise"),
    ((1, 9), "replicate"),
    ((6, 4), "replicate"),
    ((7,), "colwise"),
    ((7,), "rowwise"),
    ((3,), "replicate"),
    ((4, 3, 2), "expert"),
    ((5, 2, 3), "expert"),
    ((3, 4, 2), "expert"),
    ((1, 2, 2), "expert"),
]


def elements(b) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(start, stop) for start, stop in b)))


def whole(shape) -> tuple[tuple[int, int], ...]:
    return tuple((0, n) for n in shape)


def test_the_layouts_cover_pipelines_and_experts():
    assert Layout(dp=1, tp=2, pp=2, fsdp=True) in SOURCES
    assert Layout(dp=2, pp=2) in SOURCES and Layout(dp=1, pp=4, fsdp=True) in SOURCES
    assert Layout(dp=4, ep=4) in SOURCES and Layout(dp=3, ep=3, fsdp=True) in SOURCES


def test_rank_order_is_dp_pp_tp():
    """Rank r = (i * pp + s) * tp + j: a data-parallel shard's procs are adjacent."""
    layout = Layout(dp=3, tp=2, pp=2)
    want = [(s, i, j) for i, s, j in itertools.product(range(3), range(2), range(2))]
    assert [layout.coords(r) for r in range(layout.size)] == want
    assert [layout.rank(*c) for c in want] == list(range(12))


@pytest.mark.parametrize("source", SOURCES, ids=str)
def test_every_replica_reads_its_share_once_from_owners_on_the_stage(source):
    for (shape, style), stage in itertools.product(PARAMETERS, range(source.pp)):
        owners = sources(source, shape, style, stage=stage)
        # (c) the owners' published blocks split the parameter exactly once,
        # and every owner is on the parameter's pipeline rank.
        count = Counter(e for b in owners.values() for e in elements(b))
        assert set(count) == set(elements(whole(shape))), (source, shape, style, stage)
        assert set(count.values()) <= {1}, (source, shape, style, stage)
        for rank in range(source.size):
            on_stage = source.coords(rank)[0] == stage
            assert holds(source, rank, stage=stage) == on_stage
            assert (block(source, rank, shape, style, stage=stage) is None) != on_stage
            if rank in owners:
                assert on_stage and owners[rank] == block(source, rank, shape, style, stage=stage)
            else:
                assert not owns(source, rank, shape, style, stage=stage)
        for target in TARGETS:
            held_by_replica = Counter()
            for rank, reads in plan(source, target, shape, style, stage=stage).items():
                held = block(target, rank, shape, style)
                held_by_replica.update(elements(held))
                got = Counter()
                for owner, part in reads:
                    # (a) read from an owner on the stage, within what it publishes
                    assert owner in owners and intersect(part, owners[owner]) == part
                    got.update(elements(part))
                # (b) each element of its share exactly once, nothing else
                assert got == Counter(elements(held)), (source, target, shape, style, stage)
                assert sum(numel(part) for _, part in reads) == numel(held)
            assert set(held_by_replica) == set(elements(whole(shape)))  # the replica has it all


@pytest.mark.parametrize("source", [s for s in SOURCES if s.pp > 1], ids=str)
def test_a_stage_holds_what_the_layout_without_pipeline_holds(source):
    """On its pipeline rank a parameter is split over dp × tp as without pp."""
    flat = Layout(dp=source.dp, tp=source.tp, fsdp=source.fsdp)
    for (shape, style), stage in itertools.product(PARAMETERS, range(source.pp)):
        for i, j in itertools.product(range(source.dp), range(source.tp)):
            rank = source.rank(stage, i, j)
            assert block(source, rank, shape, style, stage=stage) == block(
                flat, flat.rank(0, i, j), shape, style
            )
            assert owns(source, rank, shape, style, stage=stage) == owns(
                flat, flat.rank(0, i, j), shape, style
            )


@pytest.mark.parametrize("fsdp", [False, True])
@pytest.mark.parametrize("ep", [2, 3, 4])
def test_experts_are_split_over_ep_whole_and_other_parameters_follow_fsdp(ep, fsdp):
    layout = Layout(dp=ep, ep=ep, fsdp=fsdp)
    for experts in (1, 3, 5, 8):
        shape = (experts, 4, 6)
        for i in range(ep):
            want = (chunk(experts, ep, i), (0, 4), (0, 6))  # FSDP does not split them further
            assert block(layout, i, shape, "expert") == want
            assert owns(layout, i, shape, "expert")
    plain = Layout(dp=ep, fsdp=fsdp)
    for (shape, style), i in itertools.product(PARAMETERS[:9], range(ep)):
        # every other parameter: split over dp by fsdp, or replicated, as without ep
        assert block(layout, i, shape, style) == block(plain, i, shape, style)
        assert owns(layout, i, shape, style) == owns(plain, i, shape, style)
    # without ep an expert parameter is a replicated one
    for other in (plain, Layout(tp=ep)):
        for rank in range(other.size):
            assert block(other, rank, (5, 2, 3), "expert") == block(
                other, rank, (5, 2, 3), "replicate"
            )


def test_parameter_style_finds_stacked_experts():
    assert parameter_style("model.layers.0.mlp.experts.gate_up_proj", (8, 32, 16)) == "expert"
    assert parameter_style("model.layers.3.mlp.experts.down_proj", (8, 16, 16)) == "expert"
    assert parameter_style("model.layers.0.mlp.experts.3.up_proj.weight", (16, 16)) is None
    assert parameter_style("model.layers.0.mlp.gate.weight", (8, 16)) is None
    assert parameter_style("model.layers.0.mlp.up_proj.weight", (32, 16)) is None


def test_stage_layers():
    assert stage_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert stage_layers(4, 4) == [range(k, k + 1) for k in range(4)]
    for layers, stages in itertools.product(range(1, 13), range(1, 13)):
        if stages > layers:
            continue
        split = stage_layers(layers, stages)
        assert [n for r in split for n in r] == list(range(layers))  # contiguous, in order
        sizes = [len(r) for r in split]
        assert sizes == sorted(sizes, reverse=True) and sizes[0] - sizes[-1] <= 1


def test_pipeline_rank_loops_virtual_stages_over_the_ranks():
    assert [pipeline_rank(k, 2, 3) for k in range(6)] == [0, 1, 0, 1, 0, 1]
    assert [pipeline_rank(k, 4, 1) for k in range(4)] == [0, 1, 2, 3]
    assert [pipeline_rank(k, 1, 2) for k in range(2)] == [0, 0]


def test_stage_of():
    assert FIRST_STAGE == ("model.embed_tokens",) and "lm_head" in LAST_STAGE
    assert stage_of("model.embed_tokens.weight", 8, 2) == 0
    assert stage_of("model.layers.3.self_attn.q_proj.weight", 8, 2) == 0
    assert stage_of("model.layers.4.input_layernorm.weight", 8, 2) == 1
    assert stage_of("model.layers.7.mlp.up_proj.weight", 8, 2) == 1
    assert stage_of("model.norm.weight", 8, 2) == 1
    assert stage_of("lm_head.weight", 8, 4) == 3
    assert stage_of("model.layers.2.mlp.up_proj.weight", 5, 2) == 0  # layers 0-2, 3-4
    assert stage_of("model.layers.3.mlp.up_proj.weight", 5, 2) == 1
    # interleaved: 8 layers, 4 virtual stages of 2 layers on 2 ranks, 0 1 0 1
    ranks = [stage_of(f"model.layers.{n}.mlp.up_proj.weight", 8, 2, 2) for n in range(8)]
    assert ranks == [0, 0, 1, 1, 0, 0, 1, 1]
    assert stage_of("model.embed_tokens.weight", 8, 2, 2) == 0
    assert stage_of("lm_head.weight", 8, 2, 2) == 1
    assert stage_of("model.norm.weight", 5, 1) == 0


def one_line_naming(error, value):
    message = str(error.value)
    assert "\n" not in message and value in message, message


@pytest.mark.parametrize(
    "name",
    [
        "model.rotary_emb.inv_freq",
        "model.visual.blocks.0.attn.qkv.weight",
        "model.normalizer.weight",
        "model.layers.9.mlp.up_proj.weight",
    ],
)
def test_stage_of_refuses_parameters_of_no_stage(name):
    with pytest.raises(ValueError) as error:
        stage_of(name, 8, 2)
    one_line_naming(error, name)


def test_stage_refusals():
    with pytest.raises(ValueError) as error:
        stage_layers(2, 3)
    one_line_naming(error, "3 pipeline stages do not fit 2 decoder layers")
    with pytest.raises(ValueError) as error:
        pipeline_rank(6, 2, 3)
    one_line_naming(error, "stage=6")
    with pytest.raises(ValueError) as error:
        block(Layout(dp=2, pp=2), 0, (4, 4), "colwise", stage=2)
    one_line_naming(error, "stage=2")
    with pytest.raises(ValueError) as error:
        plan(Layout(dp=2), Layout(pp=2), (4, 4), "colwise")
    one_line_naming(error, "pp=2")


def test_layouts_by_name():
    assert Layout.named("pp", 4, pp=2) == Layout(dp=2, pp=2)
    assert Layout.named("fsdp_pp", 4, pp=4) == Layout(dp=1, pp=4, fsdp=True)
    assert Layout.named("fsdp_tp_pp", 4, 2, 2) == Layout(dp=1, tp=2, pp=2, fsdp=True)
    assert Layout.named("ep", 3) == Layout(dp=3, ep=3) == Layout.named("ddp", 3, ep=3)
    assert Layout.named("fsdp_ep", 4, ep=4) == Layout(dp=4, ep=4, fsdp=True)
    assert Layout.named("fsdp", 4, ep=4) == Layout.named("fsdp_ep", 4)
    # the old names and arguments are unchanged
    assert Layout.named("ddp", 4, 2) == Layout(dp=4)
    assert Layout.named("fsdp_tp", 4, 2) == Layout(dp=2, tp=2, fsdp=True)
    assert Layout.named("tp", 4) == Layout(tp=4)


@pytest.mark.parametrize(
    "args, kwargs, value",
    [
        (("pp", 4), {"pp": 3}, "pp=3"),
        (("pp", 2), {}, "pp=1"),
        (("fsdp_pp", 1), {"pp": 2}, "pp=2"),
        (("fsdp_tp_pp", 4, 2), {"pp": 4}, "pp=4"),
        (("fsdp_tp_pp", 4, 3), {"pp": 2}, "tp=3"),
        (("pp", 4), {"tp": 2, "pp": 2}, "tp=2"),
        (("ddp", 4), {"pp": 2}, "pp=2"),
        (("ep", 4), {"ep": 2}, "ep=2"),
        (("ddp", 4), {"ep": 3}, "ep=3"),
        (("ep", 4, 2), {}, "tp=2"),
        (("fsdp_tp", 4, 2), {"ep": 2}, "ep=2"),
        (("tp", 2), {"ep": 2}, "ep=2"),
        (("pp", 4), {"pp": 2, "ep": 2}, "pp=2"),
        (("fsdp_ep", 4), {"pp": 2}, "pp=2"),
        (("dualpipe", 4), {}, "dualpipe"),
    ],
)
def test_layout_refusals(args, kwargs, value):
    with pytest.raises(ValueError) as error:
        Layout.named(*args, **kwargs)
    one_line_naming(error, value)


@pytest.mark.parametrize(
    "kwargs, value",
    [
        ({"dp": 2, "tp": 2, "ep": 2}, "ep=2"),
        ({"dp": 2, "pp": 2, "ep": 2}, "ep=2"),
        ({"dp": 4, "ep": 2}, "ep=2"),
        ({"pp": 0}, "pp=0"),
    ],
)
def test_layout_refuses_what_it_cannot_place(kwargs, value):
    with pytest.raises(ValueError) as error:
        Layout(**kwargs)
    one_line_naming(error, value)
