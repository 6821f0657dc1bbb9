"""Monarch's failure reports read without procs: a report about a stopped mesh or a
SLURM worker still starting is not the loss of the caller's procs."""

import os
import time

import pytest

from meshrl.procs.mesh import call_error


@pytest.mark.unit
@pytest.mark.timeout(180)
def test_a_report_about_a_stopped_mesh_is_not_the_loss_of_the_callers_procs():
    """Monarch's report that stopping a replaced mesh failed can reach a call on its
    replacement (seen on SLURM under load): it is marked stray, the call's procs are
    asked before anything is replaced (`Supervisor.stray`)."""
    from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError

    stopped = SupervisionError(
        "actor proc_mesh_controller_policy-5n3<q>.local<8p>@tcp://127.0.0.1:1 failed:\n"
        "  error stopping proc mesh: statuses: Timeout(30.0s)=0..1)"
    )
    error = call_error(stopped, "policy.generate[1]")
    assert error.proc_lost and error.stray and error.role == "policy"
    assert "error stopping proc mesh" in str(error) and "\n" not in str(error)
    died = call_error(SupervisionError("actor policy[1] failed: process exited"), "policy.x[1]")
    assert died.proc_lost and not died.stray
    raised = call_error(ValueError("bad"), "policy.x[0]")
    assert not raised.proc_lost and not raised.stray


@pytest.mark.unit
@pytest.mark.timeout(180)
def test_a_slurm_worker_still_starting_is_not_a_lost_one():
    """`WorkerWatch` dials real sockets: a worker that has not answered yet (a new
    allocation's, starting slowly on a busy node) is left alone; one that answered
    and then stops answering has its procs entered as lost."""
    import socket

    from meshrl.procs import proc_pool
    from meshrl.procs.slurm import Allocation
    from meshrl.procs.slurm_faults import WorkerWatch

    def listener(port: int) -> socket.socket | None:
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            s.close()
            return None
        s.listen()
        return s

    for port in range(42000, 43000, 2):  # two free ports in a row, as a job lays them out
        first, second = listener(port), listener(port + 1)
        if first and second:
            second.close()  # worker 1 still starting
            break
        for s in (first, second):
            if s:
                s.close()
    alloc = Allocation("policy", count=2, port=port, addresses=["127.0.0.1"] * 2)
    watch = WorkerWatch(lambda: [(alloc, lambda down: [f"policy[{i}]" for i in down])], 0.05)
    try:
        time.sleep(0.6)  # a dozen rounds
        assert not proc_pool.lost
        second = listener(port + 1)  # worker 1 up; then worker 0's node is lost
        time.sleep(0.3)
        first.close()
        deadline = time.monotonic() + 5
        while "policy[0]" not in proc_pool.lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert set(proc_pool.lost) == {"policy[0]"}
    finally:
        watch.close()
        second.close()
        proc_pool.lost.clear()


@pytest.mark.unit
def test_a_fast_exit_runs_the_exit_hooks_flushes_open_files_and_keeps_the_code(tmp_path):
    """`zygote.fast_exit` (how procs and command-line runs end) skips the interpreter's
    teardown, not what the teardown would have written."""
    import subprocess
    import sys

    from meshrl.procs import zygote

    probe = (
        "import atexit, sys\n"
        f"sys.path.insert(0, {os.path.dirname(zygote.__file__)!r})\n"
        "from zygote import fast_exit\n"
        "log = open(sys.argv[1], 'w')\n"
        "log.write('a line never flushed\\n')\n"
        "atexit.register(lambda: print('hook ran', end=''))\n"
        "fast_exit(3)\n"
    )
    path = tmp_path / "log.txt"
    done = subprocess.run(
        [sys.executable, "-S", "-c", probe, str(path)], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 3 and done.stdout == "hook ran", done
    assert path.read_text() == "a line never flushed\n"


@pytest.mark.unit
def test_a_late_report_goes_to_the_ended_runs_log_for_a_minute_then_to_the_console(
    tmp_path, monkeypatch
):
    """A killed proc's report that arrives after its run ended (Monarch: ~10 s, or a
    30 s stop timeout) is that run's; one much later (a mesh made by hand in a
    notebook afterwards) is nobody's run's and goes to the console."""
    from meshrl.procs import faultlog

    clock = [100.0]
    monkeypatch.setattr(faultlog, "_clock", lambda: clock[0])
    monkeypatch.setattr(faultlog, "path", str(tmp_path / "faults.log"))
    monkeypatch.setattr(faultlog, "ended", None)
    monkeypatch.setattr(faultlog, "ended_at", 0.0)
    assert faultlog.current() == str(tmp_path / "faults.log")
    faultlog.end(faultlog.path)
    assert faultlog.path is None
    clock[0] += 30.0
    faultlog.log_fault("mesh failure: late")
    assert "mesh failure: late" in (tmp_path / "faults.log").read_text()
    clock[0] += faultlog.LATE_S
    assert faultlog.current() is None
