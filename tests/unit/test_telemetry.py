"""Reductions of metrics recorded in actors (pure math: two procs' drains)."""

import pytest

from meshrl.observe.telemetry import drain, record, reduce_partials

pytestmark = pytest.mark.unit


def test_each_reduction_over_the_values_of_every_proc():
    drain()
    for value in (1.0, 2.0, 3.0):  # proc A
        for reduce in ("mean", "sum", "min", "max"):
            record(f"x/{reduce}", value, reduce)
    proc_a = drain()
    record("x/mean", 10.0)  # proc B: one value
    for reduce in ("sum", "min", "max"):
        record(f"x/{reduce}", 10.0, reduce)
    proc_b = drain()
    assert drain() == {}
    reduced = reduce_partials([proc_a, proc_b, {}])
    # the mean of all four values, not the mean of the procs' means (6.0)
    assert reduced == {"x/mean": 4.0, "x/sum": 16.0, "x/min": 1.0, "x/max": 10.0}


def test_a_key_keeps_one_reduction_and_bad_names_are_refused():
    drain()
    record("y", 1.0, "sum")
    with pytest.raises(ValueError, match="'y' is recorded with reduce 'max' and 'sum'"):
        record("y", 1.0, "max")
    with pytest.raises(ValueError, match="'y' is recorded with"):
        reduce_partials([{"y": ("sum", 1.0, 1)}, {"y": ("mean", 1.0, 1)}])
    with pytest.raises(ValueError, match="reduce 'median' is not one of mean, sum, min, max"):
        record("z", 1.0, "median")
    drain()
