"""Same-host weight sync served in place (`zero_copy`) and delta sync, on the
real publisher and receiver (shared memory; tests/actors/test_relay.py runs the RDMA
side across `process` hosts, tests/unit/test_models.py a publisher racing a replica)."""

import pytest
import torch

from meshrl.config import ModelConfig
from meshrl.model.models import load_model
from meshrl.weights.publisher import WeightMismatch, WeightPublisher
from meshrl.weights.receiver import WeightReceiver

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


def bump(model, names=None, by=0.5):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if names is None or name in names:
                p.add_(by)


def equal(a, b):
    pairs = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    return all(torch.equal(x, y.to(x.dtype)) for x, y in pairs)


def in_slot(param, receiver, publisher, slot):
    """Whether `param` is a view of `publisher`'s slot as `receiver` maps it."""
    mapped = receiver._mapped.get(publisher.paths[slot])
    if mapped is None:
        return False
    return mapped.data_ptr() <= param.data_ptr() < mapped.data_ptr() + mapped.numel()


@pytest.fixture
def pair():
    source, replica = load_model(ModelConfig(), seed=0), load_model(ModelConfig(), seed=1)
    publisher = WeightPublisher(source, rdma=False)
    yield source, replica, publisher
    publisher.close()


def test_a_zero_copy_replica_serves_the_published_slot_until_it_is_rewritten(pair):
    source, replica, publisher = pair
    receiver = WeightReceiver(replica, zero_copy=True)
    pulled = receiver.pull(publisher.publish(0))
    assert pulled.verified and pulled.bytes_moved == 0 and equal(source, replica)
    assert all(in_slot(p, receiver, publisher, 0) for p in replica.parameters())  # views, no copy
    assert receiver.intact()
    bump(source)
    receiver_v0 = {n: p.clone() for n, p in replica.named_parameters()}
    publisher.publish(1)  # the other slot: what the replica serves is untouched
    assert receiver.intact()
    assert all(torch.equal(p, receiver_v0[n]) for n, p in replica.named_parameters())
    bump(source)
    handle = publisher.publish(2)  # its slot again: the replica must not serve it
    assert not receiver.intact()
    receiver.pull(handle)
    assert receiver.intact() and equal(source, replica)
    assert all(in_slot(p, receiver, publisher, 0) for p in replica.parameters())

    # The checks hold in place: a slot corrupted after publishing, a pull that moved nothing.
    bump(source)
    handle = publisher.publish(3)
    publisher.corrupt(3)
    with pytest.raises(WeightMismatch, match="version 3"):
        receiver.pull(handle)
    assert receiver.torn
    bump(source)
    with pytest.raises(WeightMismatch, match="version 4"):
        receiver.pull(publisher.publish(4), skip_copy=True)


def test_a_replica_in_another_dtype_copies_and_a_copy_never_writes_the_slot(pair):
    source, replica, publisher = pair
    viewing = WeightReceiver(replica, zero_copy=True)
    viewing.pull(publisher.publish(0))
    # The same receiver made to copy (as over RDMA): its views get memory of their own
    # first, so the copy leaves the trainer's slot as it was.
    viewing.zero_copy = False
    bump(source)
    slot = publisher.slots[0].clone()
    viewing.pull(publisher.publish(1))
    assert torch.equal(publisher.slots[0], slot)  # version 0's slot: not written by the copy
    assert not any(in_slot(p, viewing, publisher, s) for p in replica.parameters() for s in (0, 1))
    assert equal(source, replica)
    sampler = load_model(ModelConfig(), seed=2).to(torch.bfloat16)
    cast = WeightReceiver(sampler, zero_copy=True)
    pulled = cast.pull(publisher.publish(3))
    assert pulled.verified and pulled.bytes_moved > 0
    assert equal(sampler, source.to(torch.bfloat16))


def test_delta_sync_moves_what_changed_and_stays_exact(pair):
    source, replica, publisher = pair
    receiver = WeightReceiver(replica)
    sizes = {n: p.numel() * p.element_size() for n, p in source.named_parameters()}
    moving = "model.layers.0.self_attn.q_proj.weight"

    pulled = receiver.pull(publisher.publish(0, delta=True))
    assert pulled.bytes_moved == sum(sizes.values()) and equal(source, replica)
    bump(source, {moving})  # as LoRA or a frozen rest: one matrix changes
    pulled = receiver.pull(publisher.publish(1, delta=True))
    assert pulled.verified and pulled.bytes_moved == sizes[moving] and equal(source, replica)
    assert receiver.pull(publisher.publish(2, delta=True)).bytes_moved == 0  # nothing moved
    bump(source, {moving})
    publisher.publish(3, delta=True)  # skipped by this replica: it is two publishes behind
    bump(source, {"lm_head.weight"})
    pulled = receiver.pull(publisher.publish(4, delta=True))
    assert pulled.bytes_moved == sizes[moving] + sizes["lm_head.weight"]
    assert equal(source, replica)

    # A rewind (the trainer back at a checkpoint: versions go back) stays exact.
    bump(source, {moving}, by=-1.0)
    pulled = receiver.pull(publisher.publish(2, delta=True))
    assert pulled.bytes_moved == sizes[moving] and equal(source, replica)

    # A new replica, and one whose last pull failed, take everything.
    fresh = load_model(ModelConfig(), seed=3)
    other = WeightReceiver(fresh)
    bump(source, {moving})
    handle = publisher.publish(5, delta=True)
    assert other.pull(handle).bytes_moved == sum(sizes.values()) and equal(source, fresh)
    bump(source, {moving})
    handle = publisher.publish(6, delta=True)
    publisher.corrupt(6)  # flips a byte of a piece that did not change: a fresh pull sees it
    with pytest.raises(WeightMismatch):
        WeightReceiver(load_model(ModelConfig(), seed=4)).pull(handle)
    bump(source, {moving})
    with pytest.raises(WeightMismatch):
        receiver.pull(publisher.publish(7, delta=True), skip_copy=True)
    pulled = receiver.pull(publisher.publish(8, delta=True))
    assert pulled.bytes_moved == sum(sizes.values()) and equal(source, replica)


def test_a_version_short_of_a_block_is_refused_not_pulled_as_verified(pair):
    """A handle that names every parameter but lacks a block of one (a proc that
    did not publish) is refused in one line naming it, before any byte moves:
    its checksums cover only the pieces it has, so it would pull "verified"
    with that block left as it was."""
    import dataclasses

    from meshrl.procs.reshard import replica_parts

    source, replica, _ = pair
    publisher = WeightPublisher(source, rdma=False, split=replica_parts(source, 2))
    try:
        handle = publisher.publish(0)
        (whole,) = handle.sources
        name = "model.layers.0.self_attn.q_proj.weight"
        halves = [i for i, p in enumerate(whole.pieces) if p.name == name]
        assert len(halves) == 2  # its rows in two parts, one for each TP proc
        keep = [i for i in range(len(whole.pieces)) if i != halves[1]]
        short = dataclasses.replace(
            whole,
            pieces=[whole.pieces[i] for i in keep],
            checksums=[whole.checksums[i] for i in keep],
        )
        receiver = WeightReceiver(replica)
        before = {n: p.clone() for n, p in replica.named_parameters()}
        with pytest.raises(ValueError, match=rf"^replica: version 0 holds only part of 1 .*{name}"):
            receiver.pull(dataclasses.replace(handle, sources=[short]))
        assert all(torch.equal(p, before[n]) for n, p in replica.named_parameters())
        assert receiver.pull(handle).verified and equal(source, replica)
    finally:
        publisher.close()
