"""Relay weight distribution: a 3-level tree across `process` hosts: bitwise-equal
replicas, one copy of the model out of the trainer, delta sync reading only what
changed (from the trainer and from a relay), a relay lost under its children routed
around, and a torn relay copy never served."""

import contextlib

import pytest
import torch
from monarch.actor import Actor, endpoint

from actors.policy import Policy
from algorithms.grpo import GRPOConfig
from meshrl.config import GenerationConfig, load_config
from meshrl.loop.run import Run
from meshrl.loop.state import LoopState
from meshrl.loop.supervisor import Supervisor
from meshrl.loop.weight_sync import WeightSync
from meshrl.model.models import load_model
from meshrl.procs.faults import FaultsConfig
from meshrl.procs.mesh import RemoteCallError, call_all, wait
from meshrl.weights.publisher import WeightHandle, WeightPublisher
from tests.conftest import DEFAULT_CONFIG


class Publisher(Actor):
    """Stands in for a trainer's owning rank: a tiny Llama and its publisher."""

    def __init__(self, model_cfg, shm_prefix):
        self.model = load_model(model_cfg, 0)
        self.publisher = WeightPublisher(self.model, prefix=shm_prefix)
        self.version = -1
        self.moving: list[str] | None = None  # the parameters a new version moves: all

    @endpoint
    def publish(self, verify: bool = True, delta: bool = False) -> WeightHandle:
        self.version += 1
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if self.moving is None or name in self.moving:
                    param.add_(0.01 * (self.version + 1))
        return self.publisher.publish(self.version, verify, delta)

    @endpoint
    def move_only(self, names: list[str] | None) -> None:
        self.moving = names

    @endpoint
    def parameters(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}


class KillingSync(WeightSync):
    """Kills one relay right after its level has pulled, before its children read."""

    kill: int | None = None

    def after_level(self, number, replicas):
        if number == 0 and self.kill is not None:
            replicas.slice(procs=self.kill).exit_now.call_one()
            self.kill = None


@contextlib.contextmanager
def hosts(tmp_path, name: str, policy_hosts: int):
    """A run whose policy replicas are on `policy_hosts` `process` hosts of their
    own, one each, and a stand-in trainer: (run, trainer, policy)."""
    cfg = load_config(
        GRPOConfig,
        DEFAULT_CONFIG,
        ["job.kind=process", f"job.hosts.policy={policy_hosts}"]
        + [f"prompts_per_step={policy_hosts}", f"run.dir={tmp_path}", f"run.name={name}"],
    )
    with Run(cfg, name, {"trainer": 1, "policy": 1}) as run:
        trainer = run.spawn("trainer", Publisher, cfg.model, run.shm_prefix)
        policy = run.spawn("policy", Policy, cfg.model, 7, shm_prefix=run.shm_prefix)
        yield run, trainer, policy


def same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.actors
@pytest.mark.timeout(300)
def test_a_relay_chain_across_hosts(tmp_path, no_stray_procs):
    """Policy replicas on 3 `process` hosts, fanout 1: a chain trainer -> 0 -> 1 -> 2,
    with delta sync (`weights.delta`): after a full first pull each replica reads
    only the pieces that changed, from the trainer and from its relay."""
    with hosts(tmp_path, "relay", 3) as (run, trainer, policy):
        sup = Supervisor(run, FaultsConfig(), LoopState())
        sync = KillingSync(sup, fanout=1, relay_timeout_s=10, delta=True)
        sup.on_respawn("policy", lambda: sync.catch_up(policy))

        def pull_and_check():
            sync.pull(policy, sync.publish(trainer))
            want = wait(trainer.slice(procs=0).parameters.call_one(), "params", 60)
            replicas = call_all(policy, "parameters", what="params", timeout_s=60)
            assert all(same(want, got) for got in replicas)  # bitwise, 3 hops down
            assert sync.paths == ["rdma"] * 3 and sync.depth == 3 and sync.verified == 3
            return {n: p.numel() * p.element_size() for n, p in want.items()}

        sizes = pull_and_check()
        model_bytes = sum(sizes.values())
        # One copy of the model left the trainer (and two 64-byte headers).
        assert model_bytes <= sync.egress_bytes <= model_bytes + 128
        assert sync.bytes_moved == 3 * sync.egress_bytes  # new replicas: everything

        # Delta: two tensors change; each replica reads those and its source's header
        # twice, from the trainer (replica 0) or from its relay (1 and 2).
        moving = ["model.layers.1.mlp.down_proj.weight", "lm_head.weight"]
        wait(trainer.move_only.call_one(moving), "move", 60)
        for _ in range(2):
            pull_and_check()
            assert sync.bytes_moved == 3 * (sum(sizes[n] for n in moving) + 128)
        wait(trainer.move_only.call_one([]), "move", 60)
        pull_and_check()
        assert sync.bytes_moved == 3 * 128  # a version that changed nothing
        wait(trainer.move_only.call_one(None), "move", 60)

        # Then relay 0 dies after its own pull, before replica 1 reads from it.
        sync.kill = 0
        sync.pull(policy, sync.publish(trainer))
        want = wait(trainer.slice(procs=0).parameters.call_one(), "params", 60)
        for rank in (1, 2):
            got = wait(policy.slice(procs=rank).parameters.call_one(), "params", 60)
            assert same(want, got), rank
        assert sync.rerouted >= 1  # replica 1 went to the trainer instead
        assert sync.egress_bytes >= 2 * model_bytes  # relay 0's copy, then replica 1's
        with pytest.raises(RemoteCallError):
            wait(policy.slice(procs=0).parameters.call_one(), "dead relay", 60)

        # A relay's slot that no longer holds the version asked for is never served:
        # replica 2 asked for version 3 from replica 1's slot of version 1 (the same slot).
        relay = wait(
            policy.slice(procs=1).load_weights.call_one(sync.handle, True), "relay", 60
        ).relay
        stale = WeightHandle(relay.version + 2, relay.sources)
        with pytest.raises(RemoteCallError, match="TornWeights|not complete"):
            wait(policy.slice(procs=2).load_weights.call_one(stale), "torn", 60)
        with pytest.raises(RemoteCallError, match="pull a complete version first"):
            wait(
                policy.slice(procs=2).generate.call_one([[1, 2, 3]], GenerationConfig()),
                "gen",
                60,
            )
