"""Elastic pools without procs: scale requests and their limits, and a pool's future
answering in rank order."""

import pytest

from meshrl.loop.elastic import check, parse_sizes
from meshrl.procs.pool import PoolFuture, ScaleError


@pytest.mark.unit
def test_scale_input_and_limits():
    pools = {"policy": (3, "x"), "environment": (None, "")}
    fixed = {"critic": "its state lives in its procs"}
    assert check("policy", 2, pools) is None
    assert check("critic", 2, pools, fixed) == (
        "scale: critic cannot be scaled (its state lives in its procs); "
        "elastic roles: policy, environment"
    )
    assert check("policy", 5, {"policy": (4, "job.max_procs.policy=4")}) == (
        "scale: policy=5: past this job's limit of 4 (job.max_procs.policy=4)"
    )
    assert check("policy", 0, pools) == "scale: policy=0: a pool keeps at least 1 proc"
    assert "no role 'polcy'" in check("polcy", 2, pools, fixed)
    assert parse_sizes(["policy=3", "environment=2"]) == {"policy": 3, "environment": 2}
    with pytest.raises(ScaleError, match="'policy:3' is not role=size"):
        parse_sizes(["policy:3"])


class _Later:
    """A Monarch-like future that answers on its `ready`-th `get`."""

    def __init__(self, value, ready: int = 1, error: Exception | None = None):
        self.value, self.ready, self.error, self.asked = value, ready, error, 0

    def get(self, timeout=None):
        self.asked += 1
        if self.asked < self.ready:
            raise TimeoutError
        if self.error is not None:
            raise self.error
        return self.value


@pytest.mark.unit
def test_pool_future_answers_in_rank_order_and_asks_each_member_once():
    first, second = _Later("a", ready=3), _Later("b")
    future = PoolFuture([first, second])
    for _ in range(2):
        with pytest.raises(TimeoutError):
            future.get(timeout=0.01)
    assert [v for _, v in future.get(timeout=0.01).items()] == ["a", "b"]
    assert second.asked == 1  # its answer was kept while the first one was awaited
    failing = PoolFuture([_Later("a"), _Later(None, error=RuntimeError("lost"))])
    with pytest.raises(RuntimeError, match="lost"):
        failing.get(timeout=0.01)
