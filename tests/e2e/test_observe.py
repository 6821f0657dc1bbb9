"""Monarch's telemetry, dashboard and mesh admin for a run, and the profiler
across procs (`meshrl.observe.monarch`, `meshrl.observe.profile`): one real GRPO run, watched
from outside while it goes, as a user would."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from meshrl.observe.monarch import ACTORS_SQL, STEP_MESSAGES_SQL, STEPS_SQL
from meshrl.procs.proc_pool import monarch_pids
from tests.conftest import REPO, descendants, listeners, own_pids
from tests.support import other_user
from tests.support.runs import grpo_command


def _get(url: str, token: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def _sql(telemetry_url: str, sql: str) -> list[dict]:
    request = urllib.request.Request(
        f"{telemetry_url}/api/query",
        data=json.dumps({"sql": sql}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())["rows"]


def _until(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = check()
            if result:
                return result
        except (OSError, KeyError, ValueError):
            result = None
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


def _meshrl(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "meshrl.commands", *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.e2e
def test_dashboard_telemetry_and_profile_of_a_running_run(tmp_path, no_stray_procs):
    """While a GRPO run goes: the dashboard (its asked-for port taken, so on a
    free one) lists the policy, trainer and environment actors and counts
    `generate` and `train_step` messages; SQL through the telemetry returns the
    actors by role and joins each step's record with its messages; the profile
    of steps 1-2 has a trace per proc whose roles' times add up to the step.
    The dashboard answers only with the run's token, and nothing of the run
    listens beyond loopback. After Ctrl-C nothing listens on the dashboard's
    port and no proc is left."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy_port = taken.getsockname()[1]
        command = grpo_command(
            tmp_path,
            "dash",
            "steps=1000",
            "warm_start.steps=0",
            "run.dashboard=true",
            f"run.dashboard_port={busy_port}",
            "run.profile_steps=[1,2]",
            "run.status_every_s=1",
            "checkpoint.every=0",
            "run.save_final=false",
        )
        proc = subprocess.Popen(
            command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        run_dir = tmp_path / "dash"
        try:
            status = _until(
                lambda: json.loads((run_dir / "status.json").read_text()), 120, "status.json"
            )
            assert (run_dir / "status.json").stat().st_mode & 0o077 == 0  # it holds the token
            url, telemetry = status["dashboard_url"], status["telemetry_url"]
            dashboard, token = url.split("/?token=")
            port = int(dashboard.rsplit(":", 1)[1])
            assert port != busy_port and dashboard.startswith("http://127.0.0.1:")
            with pytest.raises(urllib.error.HTTPError, match="401"):
                _get(f"{dashboard}/api/summary")
            with pytest.raises(urllib.error.HTTPError, match="401"):
                _get(f"{dashboard}/api/summary", token="not-" + token)
            # The run's own processes: the CLI's tree (its procs, Monarch's sidecar).
            ours = descendants(proc.pid) | {
                pid
                for pid in monarch_pids() & own_pids()
                if b"_job_sidecar" in Path(f"/proc/{pid}/cmdline").read_bytes()
            }
            wide = [(a, p) for a, p in listeners(ours) if not a.startswith(("127.", "::1"))]
            assert not wide, f"the run listens beyond loopback: {wide}"
            if other_user.available():  # another local user: no channel, no file of the run
                reached = other_user.reached_by_nobody(ours, [str(run_dir)])
                assert reached == {"sockets": [], "files": []}, reached

            def summary_ready():
                summary = _get(f"{dashboard}/api/summary", token)
                counts = summary["message_counts"]["by_endpoint"]
                return summary if counts.get("generate") and counts.get("train_step") else None

            summary = _until(summary_ready, 120, "generate and train_step messages")
            assert summary["errors"]["failed_actors"] == []
            meshes = {m["given_name"] for m in _get(f"{dashboard}/api/meshes", token)}
            assert {"policy", "trainer", "environment"} <= meshes

            by_role = {(r["role"], r["actor"]) for r in _sql(telemetry, ACTORS_SQL)}
            for role in ("policy", "trainer", "environment"):
                assert (role, role) in by_role and (role, "watch") in by_role

            steps = _until(lambda: _sql(telemetry, STEPS_SQL), 60, "step records")
            assert all(s["end_us"] > s["start_us"] for s in steps)
            assert "reward/mean=" in steps[0]["metrics"]
            joined = _until(lambda: _sql(telemetry, STEP_MESSAGES_SQL), 60, "joined steps")
            assert {"generate", "train_step"} <= {r["endpoint"] for r in joined}

            shown = _meshrl("status", str(run_dir))  # any shell: Monarch's states, live
            assert shown.returncode == 0, shown.stderr
            lines = shown.stdout.splitlines()
            assert f"dashboard: {url}" in lines
            (head,) = [line for line in lines if line.startswith("mesh ")]
            assert head.split()[:4] == ["mesh", "actor", "state", "monarch"]
            (row,) = [line for line in lines if line.startswith("trainer[0]")]
            assert {"idle", "processing"} & set(row.split()), row  # Monarch's column

            _until((run_dir / "profile" / "steps_1-2" / "summary.json").exists, 120, "profile")
            asked = _meshrl("profile", str(run_dir), "--steps", "1")  # from another shell
            assert asked.returncode == 0, asked.stderr
            requested = _until(
                lambda: [
                    p for p in run_dir.glob("profile/steps_*/summary.json") if "_1-2" not in str(p)
                ],
                120,
                "asked",
            )
        finally:
            proc.send_signal(signal.SIGINT)  # stops at the end of the step, cleanly
            out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-3000:]  # the CLI's code for a run stopped by Ctrl-C
    assert "USDT" not in out  # torch's profiler kept quiet
    assert f"run.dashboard_port {busy_port} is in use" in out
    assert f"dashboard at {url}" in out
    assert not _listening(port), f"the dashboard still listens on {port}"

    finished = _meshrl("profile", str(run_dir))
    assert finished.returncode == 1 and "has finished" in finished.stderr
    (later,) = [json.loads(p.read_text()) for p in requested]
    assert len(later["steps"]) == 1 and later["steps"][0]["step"] > 2
    profile = json.loads((run_dir / "profile" / "steps_1-2" / "summary.json").read_text())
    assert profile["traces"] == [
        "environment-0.trace.json",
        "policy-0.trace.json",
        "trainer-0.trace.json",
    ]
    assert [s["step"] for s in profile["steps"]] == [1, 2]
    for step in profile["steps"]:
        assert set(step["roles"]) == {"environment", "policy", "trainer", "profiler"}
        assert abs(step["sum_s"] - step["step_s"]) <= 0.1 * step["step_s"], step
        assert step["between_s"] < step["step_s"]
    names = {
        e.get("name")
        for e in json.loads((run_dir / "profile/steps_1-2/policy-0.trace.json").read_text())[
            "traceEvents"
        ]
    }
    assert "policy.generate" in names and any(str(n).startswith("aten::") for n in names)
