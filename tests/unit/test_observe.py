"""Monarch's telemetry and mesh admin for a run, without procs: telemetry Monarch did
not start is one line, `close` waits for Monarch's sidecar, and `meshrl status` shows
Monarch's state beside meshrl's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from meshrl.config import ConfigError
from meshrl.observe.monarch import Observe


@pytest.mark.unit
def test_telemetry_that_monarch_did_not_start_is_one_line():
    """Monarch starts telemetry best-effort; a job it could not start it for
    (no URL in its state) is refused naming the key and the job kind."""
    observe = Observe(telemetry=True)
    state = SimpleNamespace(telemetry_url=None, dashboard_url=None, query_engine_client=None)
    with pytest.raises(ConfigError, match=r"'run.telemetry'.*job.kind=slurm") as info:
        observe.started(SimpleNamespace(apply_id=None), state, "slurm")
    assert "\n" not in str(info.value)


@pytest.mark.unit
def test_close_waits_for_the_sidecar_with_the_pid_check_the_run_hands_in():
    """observe/ stands below procs/: the run hands `Observe.of` the pid check
    (`alive` of procs/proc_pool.py), and `close` waits with it for the sidecar."""
    answers, asked = iter([True, True, False]), []
    run = SimpleNamespace(telemetry=True, dashboard=False, dashboard_port=0, dashboard_host="")
    observe = Observe.of(run, lambda pid: asked.append(pid) or next(answers))
    observe._sidecar_pid = 4242  # what `started` took from Monarch's sidecar
    observe.close()
    assert asked == [4242, 4242, 4242]


@pytest.mark.unit
def test_status_shows_monarchs_state_beside_meshrls():
    from meshrl.observe.monarch import merge_states, states_from_rows
    from meshrl.observe.status import table

    rows = [
        {
            "role": "policy",
            "rank": 0,
            "actor": "policy",
            "status": "Idle",
            "reason": None,
            "timestamp_us": 2,
        },
        {
            "role": "policy",
            "rank": 0,
            "actor": "policy",
            "status": "Processing",
            "reason": None,
            "timestamp_us": 1,
        },
        {
            "role": "policy",
            "rank": 1,
            "actor": "policy",
            "status": "Failed",
            "reason": "proc exited",
            "timestamp_us": 3,
        },
    ]
    procs = [
        {
            "role": "policy",
            "rank": 0,
            "state": "alive",
            "host": "h",
            "pid": 1,
            "actors": [{"actor": "policy", "version": 3}],
        },
        {"role": "policy", "rank": 1, "state": "dead"},
    ]
    merge_states(procs, states_from_rows(rows))
    assert procs[0]["monarch"] == {"policy": "idle"}
    assert procs[1]["failure"] == "policy: proc exited"
    lines = table(procs, now=0).splitlines()
    assert "monarch" in lines[0]
    assert "idle" in lines[1] and "dead: policy: proc exited" in lines[2]
