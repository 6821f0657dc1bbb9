"""Relay weight distribution: the tree's plan (pure), and a 3-level tree across
`process` hosts: bitwise-equal replicas, one copy of the model out of the
trainer, delta sync reading only what changed (from the trainer and from a
relay), a relay lost under its children routed around, and a torn relay copy
never served."""

import contextlib

import pytest
import torch
from monarch.actor import Actor, endpoint

from actors.policy import Policy
from algorithms.grpo import GRPOConfig
from meshrl.config import ConfigError, GenerationConfig, load_config
from meshrl.loop.run import Run
from meshrl.loop.state import LoopState
from meshrl.loop.supervisor import Supervisor
from meshrl.loop.weight_sync import WeightSync, plan
from meshrl.model.models import load_model
from meshrl.procs.faults import FaultsConfig
from meshrl.procs.mesh import RemoteCallError, call_all, wait
from meshrl.weights.publisher import WeightHandle, WeightPublisher, WeightSource
from tests.conftest import DEFAULT_CONFIG


@pytest.mark.unit
def test_the_plan_reads_the_trainer_at_most_fanout_times():
    # 7 replicas on hosts of their own: a complete binary tree, 3 levels.
    levels = plan([f"h{i}" for i in range(7)], {"t"}, 2)
    assert levels == [[(0, None), (1, None)], [(2, 0), (3, 0), (4, 1), (5, 1)], [(6, 2)]]
    # Unknown hosts (before the first pull) are leaders too; fanout 1 is a chain.
    assert plan([None, None, None], {"t"}, 1) == [[(0, None)], [(1, 0)], [(2, 1)]]
    # On the trainer's host: shared memory, level 1, never a relay; a host's mates
    # pull from its leader one level below it.
    hosts = ["t", "a", "a", "b", "t", "c", "a"]
    levels = plan(hosts, {"t"}, 2)
    assert levels[0] == [(0, None), (4, None), (1, None), (3, None)]
    assert sorted(levels[1]) == [(2, 1), (5, 1), (6, 1)]  # mates 2, 6; 5 by RDMA
    for fanout in (1, 2, 3, 4):
        for count in range(1, 40):
            levels = plan([f"h{i}" for i in range(count)], {"t"}, fanout)
            pairs = [pair for level in levels for pair in level]
            assert sorted(rank for rank, _ in pairs) == list(range(count))
            assert sum(parent is None for _, parent in pairs) == min(fanout, count)
            children = [parent for _, parent in pairs if parent is not None]
            assert all(children.count(p) <= fanout for p in set(children))
            # Each parent pulls in a level before its children.
            level_of = {rank: i for i, level in enumerate(levels) for rank, _ in level}
            assert all(level_of[p] < level_of[r] for r, p in pairs if p is not None)
            # As shallow as fanout allows: levels 1..L-1 full (fanout, fanout^2, ...).
            assert sum(fanout**i for i in range(1, len(levels))) < count
    # The star: one level.
    assert plan(["a", "b", "c"], {"t"}, 0) == [[(0, None), (1, None), (2, None)]]
    for bad in ("weights.fanout=-1", "weights.relay_timeout_s=0"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            load_config(GRPOConfig, DEFAULT_CONFIG, [bad])


@pytest.mark.unit
def test_replicas_that_join_are_in_the_next_pulls_tree():
    """The tree is planned at each pull from the mesh's size then: ranks added since
    the last pull join it, their hosts asked first; a replaced mesh is asked again.
    (The controller's bookkeeping alone: a pool that answers `host_id` like a
    replica mesh stands in for one.)"""

    class Answers(dict):  # what a mesh call's future gives: (rank, value) items
        pass

    class Pool:
        def __init__(self, hosts, respawns=0):
            self.hosts, self.size, self.respawns = hosts, len(hosts), respawns
            self.name = "policy"
            self.asked = 0
            self.host_id = self

        def call(self):
            self.asked += 1
            return Answers(enumerate(self.hosts))

    class Sup:
        def wait(self, future, what):
            return future

    sync = WeightSync(Sup(), fanout=2)
    trainer = WeightHandle(0, [WeightSource("t", [], [], [], [], 0)])
    pool = Pool(["a", "b"])
    assert sync.plan(pool, trainer) == [[(0, None), (1, None)]] and pool.asked == 0  # no tree
    grown = Pool(["a", "b", "c", "a", "d"])
    levels = sync.plan(grown, trainer)
    assert grown.asked == 1  # the new ranks' hosts, before they are placed
    assert sorted(rank for level in levels for rank, _ in level) == [0, 1, 2, 3, 4]
    assert levels[0] == [(0, None), (1, None)]
    assert sorted(levels[1]) == [(2, 0), (3, 0), (4, 0)]  # 3 copies 0's shared memory
    assert sync.plan(grown, trainer) == levels and grown.asked == 1  # known now
    local = Pool(["t", "t", "t"], respawns=1)  # replaced, on the trainer's host
    assert sync.plan(local, trainer) == [[(0, None), (1, None), (2, None)]] and local.asked == 1


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
