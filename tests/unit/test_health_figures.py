"""The arithmetic of the run-health checks (meshrl/loop/health.py): slow procs
against their role's others, flat rewards, non-finite figures, the sampler/trainer
band, idle shares; and the status view of them."""

import math

import pytest

from meshrl.loop.health import busy_share, flat_steps, non_finite, slow_ratios
from meshrl.observe.status import health_lines, preflight_lines

pytestmark = pytest.mark.unit


def test_a_slow_proc_is_measured_against_the_median_of_the_others():
    calls = {
        ("policy", 0): {"policy/generate": (2, 0.4), "policy/load_weights": (1, 0.01)},
        ("policy", 1): {"policy/generate": (1, 0.8), "policy/load_weights": (1, 0.01)},
        ("trainer", 0): {"trainer/train_step": (1, 0.5)},  # one proc: nothing to compare
    }
    ratios = slow_ratios(calls)
    assert set(ratios) == {("policy", 0), ("policy", 1)}
    # Per call: 0.2 + 0.01 against 0.8 + 0.01 (each proc against the other's means).
    assert math.isclose(ratios[("policy", 1)], 0.81 / 0.21)
    assert math.isclose(ratios[("policy", 0)], 0.21 / 0.81)
    # Of three, the slow one does not move the others' medians.
    three = {("env", r): {"env/score": (1, s)} for r, s in enumerate([0.1, 0.11, 0.5])}
    got = slow_ratios(three)
    assert math.isclose(got[("env", 2)], 0.5 / 0.105) and got[("env", 0)] < 1


def test_calls_too_short_to_time_are_not_compared():
    calls = {("policy", r): {"policy/load_weights": (1, s)} for r, s in enumerate([1e-4, 9e-4])}
    assert slow_ratios(calls) == {}


def test_reward_flat_counts_the_steps_in_a_row_within_the_range():
    history = [{"reward/mean": r} for r in (0.1, 0.5, 0.50, 0.505, 0.498)]
    # This step and the four before it, from 0.5 on (not 0.1).
    assert flat_steps(history, 0.502, 0.01) == 5
    assert flat_steps(history, 0.6, 0.01) == 1
    assert flat_steps([], 0.3, 0.01) == 1


def test_non_finite_figures_are_counted():
    assert non_finite({"a": 1.0, "b": math.nan, "c": math.inf, "d": 3, "e": "x"}) == 2


def test_idle_share_is_over_the_procs_of_the_endpoint():
    calls = {
        ("trainer", 0): {"trainer/train_step": (1, 0.3), "trainer/publish": (1, 0.1)},
        ("trainer", 1): {"trainer/train_step": (1, 0.2)},
        ("policy", 0): {"policy/generate": (1, 0.9)},
    }
    assert math.isclose(busy_share(calls, "train_step", 1.0), 0.3)
    assert busy_share(calls, "generate", 0.5) == 1.0  # a call sent earlier ended in this step
    assert busy_share(calls, "values", 1.0) is None


def test_status_shows_alarms_slow_and_evicted_procs():
    assert health_lines(None) == ""
    health = {
        "step": 7,
        "alarms": {"entropy": "entropy collapse: ..."},
        "slow": ["policy[1]"],
        "evicted": ["policy[1]"],
    }
    assert health_lines(health).splitlines() == [
        "health at step 7: entropy collapse: ...",
        "slow procs: policy[1]",
        "evicted (slow): policy[1]",
    ]


def test_status_shows_each_hosts_preflight_figures_and_the_quarantined():
    assert preflight_lines({}) == ""
    status = {
        "preflight": {
            "hosts": {
                "c2": {"role": "policy", "matmul_gflops": 3.1, "rdma_gb_s": 0.25, "free_gb": 70.5},
                "c1": {"role": "trainer", "matmul_gflops": 0.3, "check_s": 0.5},
            },
            "runs": [{"hosts": 2, "s": 0.5}, {"hosts": 1, "s": 0.25}],
        },
        "preflight_quarantined": {"c1": "preflight: host c1 failed the matmul check: ..."},
    }
    assert preflight_lines(status).splitlines() == [
        "preflight: 2 check(s) of 3 host(s), 0.75s",
        "  c1 (trainer): matmul_gflops 0.3, check_s 0.5",
        "  c2 (policy): matmul_gflops 3.1, rdma_gb_s 0.25, free_gb 70.5",
        "  quarantined c1: preflight: host c1 failed the matmul check: ...",
    ]
