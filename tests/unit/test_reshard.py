"""The reshard plan (`meshrl.procs.reshard`) for every pair of layouts of up to
4 procs each: the owners' blocks split each parameter exactly once, a replica
proc reads exactly its share, and what it assembles from the reads equals its
block of the full tensor. The blocks are checked against `torch.chunk`, the
split DTensor and FSDP2 make (the real DTensors' blocks are checked against the
plan in tests/actors/test_invariance.py)."""

import itertools

import pytest
import torch

from meshrl.procs.reshard import (
    STYLES,
    Layout,
    block,
    chunk,
    intersect,
    numel,
    plan,
    relative,
    sources,
)

pytestmark = pytest.mark.unit


def layouts(procs: int = 4) -> list[Layout]:
    """Every trainer layout of 1..`procs` procs."""
    out = set()
    for n in range(1, procs + 1):
        out |= {Layout.named("ddp", n), Layout.named("fsdp", n), Layout.named("tp", n)}
        out |= {Layout.named("fsdp_tp", n, tp) for tp in range(2, n + 1) if n % tp == 0}
    return sorted(out, key=lambda x: (x.size, x.dp, x.tp, x.fsdp))


def replica_layouts(procs: int = 4) -> list[Layout]:
    """A policy replica: 1 proc, or tensor-parallel over up to `procs`."""
    return [Layout(tp=k) for k in range(1, procs + 1)]


SHAPES = [(12, 8), (10, 6), (5, 3), (1, 9), (7,), (3,), (16, 4)]


def as_slices(b) -> tuple[slice, ...]:
    return tuple(slice(start, stop) for start, stop in b)


def test_chunk_is_torch_chunk():
    for extent, parts in itertools.product(range(0, 13), range(1, 6)):
        pieces = torch.arange(extent).chunk(parts) if extent else ()
        for index in range(parts):
            start, stop = chunk(extent, parts, index)
            want = pieces[index].tolist() if index < len(pieces) else []
            assert list(range(start, stop)) == want, (extent, parts, index)


@pytest.mark.parametrize("layout", layouts(), ids=str)
def test_blocks_are_the_dtensor_and_fsdp2_splits(layout):
    """tp splits dim 0 (colwise) or 1 (rowwise) like DTensor's Shard; FSDP2 then
    splits dim 0 of each rank's tp block like its Shard(0) of the local tensor."""
    for shape, style in itertools.product(SHAPES, STYLES):
        full = torch.arange(numel(tuple((0, n) for n in shape))).reshape(shape)
        for rank in range(layout.size):
            i, j = divmod(rank, layout.tp)
            local = full
            dim = {"colwise": 0, "rowwise": 1}.get(style)
            if layout.tp > 1 and dim is not None and dim < len(shape):
                parts = local.chunk(layout.tp, dim)
                local = parts[j] if j < len(parts) else local.narrow(dim, 0, 0)
            if layout.fsdp and layout.dp > 1:
                parts = local.chunk(layout.dp, 0)
                local = parts[i] if i < len(parts) else local.narrow(0, 0, 0)
            got = full[as_slices(block(layout, rank, shape, style))]
            assert torch.equal(got, local), (layout, shape, style, rank)


@pytest.mark.parametrize("source", layouts(), ids=str)
def test_every_replica_layout_reads_exactly_its_share_from_the_owners(source):
    for target, shape, style in itertools.product(replica_layouts(), SHAPES, STYLES):
        full = torch.randn(shape)
        owners = sources(source, shape, style)
        # The owners' blocks split the parameter exactly once.
        assert sum(numel(b) for b in owners.values()) == full.numel()
        for a, b in itertools.combinations(owners.values(), 2):
            assert intersect(a, b) is None
        for rank, reads in plan(source, target, shape, style).items():
            held = block(target, rank, shape, style)
            assembled = torch.full([stop - start for start, stop in held], float("nan"))
            for owner, part in reads:
                assert intersect(part, owners[owner]) == part  # within what it owns
                published = full[as_slices(owners[owner])]  # the owner's slot
                assembled[relative(part, held)] = published[relative(part, owners[owner])]
            assert sum(numel(part) for _, part in reads) == numel(held)  # its share, no more
            assert torch.equal(assembled, full[as_slices(held)]), (source, target, shape, style)


def test_layouts_by_name_and_refusals():
    assert Layout.named("fsdp_tp", 4, 2) == Layout(dp=2, tp=2, fsdp=True)
    assert Layout.named("tp", 4) == Layout(tp=4)
    with pytest.raises(ValueError, match="does not divide"):
        Layout.named("fsdp_tp", 4, 3)
    with pytest.raises(ValueError, match="not one of"):
        Layout.named("pp", 2)
    with pytest.raises(ValueError, match="style"):
        block(Layout(), 0, (2, 2), "diagonal")
