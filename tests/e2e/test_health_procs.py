"""Health on one machine (`local` jobs, real procs): a policy proc stopped with
SIGSTOP mid-run is found by its heartbeat within `health.hang_s`, its stacks are
in faults.log, it is killed and replaced and no sample is lost; a run directory
that cannot take a file is refused by the preflight before step 1, in one line."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time

import pytest

from meshrl.observe.status import alive_pid
from meshrl.procs import proc_pool, zygote
from tests.conftest import DEFAULT_CONFIG, REPO

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def command(run_dir, name: str, *overrides: str) -> list[str]:
    return zygote.python_m(
        "algorithms.grpo",
        "--config",
        DEFAULT_CONFIG,
        "eval.every=0",
        "warm_start.steps=2",
        "run.progress=false",
        f"run.dir={run_dir}",
        f"run.name={name}",
        *overrides,
    )


def records(path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_stopped_policy_proc_is_found_by_its_heartbeat_its_stacks_logged_and_replaced(
    tmp_path, no_stray_procs
):
    run = tmp_path / "hang"
    proc = subprocess.Popen(
        # Steps enough that the stop is found (hang_s and a beat) before the run's end.
        command(tmp_path, "hang", "steps=8", "health.hang_s=2"),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    stopped = None
    try:
        deadline = time.monotonic() + 150
        while len(records(run / "metrics.jsonl")) < 1 and proc.poll() is None:
            assert time.monotonic() < deadline, "no step 2"
            time.sleep(0.1)
        while (stopped := alive_pid(run, "policy")) is None:
            assert time.monotonic() < deadline and proc.poll() is None, "no policy proc"
            time.sleep(0.2)
        os.kill(stopped, signal.SIGSTOP)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:  # Ctrl-C: the run stops its procs
            proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=60)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        if stopped is not None and proc_pool.alive(stopped):
            os.kill(stopped, signal.SIGKILL)  # (a failed test leaves nothing behind)
    assert proc.returncode == 0, out[-3000:]
    assert f"hung: policy[0] (pid {stopped}" in out, out[-3000:]
    assert not proc_pool.alive(stopped)  # killed, not left stopped after the run
    faults = (run / "faults.log").read_text()
    assert "--- stacks of the hung proc ---" in faults
    stacks = faults.split("--- stacks of the hung proc ---", 1)[1]
    assert "Thread 0x" in stacks and 'File "' in stacks, faults[-3000:]
    history = records(run / "metrics.jsonl")
    assert [r["step"] for r in history] == list(range(8))
    last = history[-1]
    assert last["faults/recoveries"] == 1
    assert last["samples/generated_total"] == last["samples/trained_total"]
    assert last["samples/dropped_total"] == 0
    preflight = json.loads((run / "status.json").read_text())["preflight"]
    (host,) = preflight["hosts"].values()
    assert host["matmul_gflops"] > 0 and host["free_gb"] > 0 and host["versions"]["torch"]


def test_a_run_directory_that_cannot_take_a_file_is_refused_before_step_1(
    small_disk, no_stray_procs
):
    # Room for the run's config, not for the preflight's file (4 MB).
    filler = small_disk / "filler"
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    filler.write_bytes(b"\0" * (free - (512 << 10)))
    done = subprocess.run(
        command(small_disk, "refused", "steps=2"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode != 0
    errors = [
        line for line in done.stdout.splitlines() + done.stderr.splitlines() if "error:" in line
    ]
    assert len(errors) == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "config key 'health.preflight': host " in errors[0]
    assert "failed the run_dir check: " in errors[0]
    assert "No space left on device" in errors[0] or "free in" in errors[0]
    assert "Traceback" not in done.stdout + done.stderr
    assert not (small_disk / "refused" / "metrics.jsonl").exists()  # no step ran
