"""In-job recovery, without procs: an exception raised in an actor is reported, not
recovered, and the `faults:` drill's keys are checked."""

import pytest

from algorithms.grpo import GRPOConfig
from meshrl.config import ConfigError, load_config
from meshrl.loop.state import LoopState
from meshrl.loop.supervisor import Supervisor
from meshrl.procs.faults import FaultsConfig
from meshrl.procs.mesh import RemoteCallError


@pytest.mark.unit
def test_an_exception_in_an_actor_is_not_recovered_but_reported():
    state = LoopState()
    sup = Supervisor(None, FaultsConfig(), state)  # no run: no mesh may be touched
    sup.on_respawn("environment")
    error = RemoteCallError("environment.score[0] failed: ValueError: bad", "environment.score[0]")
    with pytest.raises(RemoteCallError, match="ValueError: bad"):
        sup.recover("environment", error)
    assert state.recoveries == []


@pytest.mark.unit
@pytest.mark.parametrize(
    "override, message",
    [
        ("faults.kill=[policy@3]", "faults.kill"),
        ("faults.kill=[learner:0@3]", "the roles are"),
        ("faults.raise_in=[environment:0@3]", "is not role.endpoint@step"),
        ("faults.raise_in=[environment.reward@3]", "the endpoints are .*environment.score"),
        ("faults.max_nonfinite_steps=0", "faults.max_nonfinite_steps"),
        ("faults.weights=[skip_pull@3]", "'faults.weights': 'skip_pull@3' is not corrupt@step"),
    ],
)
def test_fault_drill_keys_are_checked(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(GRPOConfig, None, [override])


@pytest.mark.unit
def test_a_peers_packed_state_restores_a_replica_that_steps_bit_for_bit_alike():
    """What a surviving trainer rank hands to its replacement (`PeerState`): model,
    AdamW and schedule state packed into one buffer and back. The replacement, built
    from another init, then takes the same step as the survivor, bit for bit."""
    import torch

    from meshrl.weights.peer_state import pack, unpack

    def replica(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
        return model, optimizer, schedule

    def step(model, optimizer, schedule, x):
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
        schedule.step()

    x = torch.randn(4, 6)
    survivor = replica(0)
    for _ in range(2):
        step(*survivor, x)
    state = {
        "model": survivor[0].state_dict(),
        "optimizer": survivor[1].state_dict(),
        "scheduler": survivor[2].state_dict(),
        "version": 7,
        "odd": (torch.tensor(True), torch.zeros(0, dtype=torch.bfloat16), None),
    }
    buffer, skeleton = pack(state)
    got = unpack(buffer, skeleton)
    assert got["version"] == 7 and got["odd"][0].item() is True and got["odd"][2] is None
    assert got["odd"][1].dtype == torch.bfloat16 and got["odd"][1].shape == (0,)
    buffer.fill_(0)  # nothing unpacked is a view of the buffer
    new = replica(1)
    new[0].load_state_dict(got["model"])
    new[1].load_state_dict(got["optimizer"])
    new[2].load_state_dict(got["scheduler"])
    step(*survivor, x)
    step(*new, x)
    for a, b in zip(survivor[0].parameters(), new[0].parameters(), strict=True):
        assert torch.equal(a, b)
    assert new[2].get_last_lr() == survivor[2].get_last_lr()
