"""Relay weight distribution: the tree's plan (pure), and the next pull's tree with
the replicas that joined."""

import pytest

from algorithms.grpo import GRPOConfig
from meshrl.config import ConfigError, load_config
from meshrl.loop.weight_sync import WeightSync, plan
from meshrl.weights.publisher import WeightHandle, WeightSource
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
