"""Host and proc health (`meshrl.procs.health`): how preflight figures are judged,
the run directory's check, and the stacks of a stopped process (a real one)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from meshrl.config.files import ConfigError
from meshrl.config.health import HealthConfig
from meshrl.procs import proc_pool
from meshrl.procs.health import cpu_cores, disk_figures, dump_and_kill, judge, medians_of, versions

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_a_host_below_min_ratio_of_the_median_is_found_and_one_that_fails_a_check():
    hosts = {
        "c1": {"matmul_gflops": 10.0, "rdma_gb_s": 1.0},
        "c2": {"matmul_gflops": 50.0, "rdma_gb_s": 1.1},
        "c3": {"matmul_gflops": 55.0, "rdma_gb_s": 0.9},
        "c4": {"matmul_gflops": 60.0},
    }
    failures = {"c3": ["run_dir: cannot write /x: Read-only file system"]}
    found = judge(hosts, failures, 0.5)
    assert [(f.host, f.check) for f in found] == [("c3", "run_dir"), ("c1", "matmul")]
    assert "matmul_gflops 10 is 0.19 of the median 52.5" in found[1].line()
    assert found[0].line() == (
        "host c3 failed the run_dir check: cannot write /x: Read-only file system"
    )
    assert judge(hosts, {}, 0.15) == []  # 0.19 of the median passes a lower bar


def test_one_host_has_no_median_but_a_later_one_is_judged_against_the_first_allocation():
    assert judge({"c1": {"matmul_gflops": 1.0}}, {}, 0.5) == []
    baseline = {**medians_of({f"c{i}": {"matmul_gflops": 50.0} for i in range(4)}), "hosts": 4}
    found = judge({"c9": {"matmul_gflops": 5.0}}, {}, 0.5, baseline)
    assert [(f.host, f.check) for f in found] == [("c9", "matmul")]


def test_a_process_under_a_cpu_quota_reads_its_cores_from_the_kernel():
    """A real cgroup v1 quota of a quarter core (where this machine has a writable CPU
    controller), and the same parse of cgroup v2's `cpu.max` on a written tree."""
    root = "/sys/fs/cgroup/cpu"
    if os.access(os.path.join(root, "cgroup.procs"), os.W_OK):
        group = os.path.join(root, f"meshrl-test-cores-{os.getpid()}")
        os.makedirs(group, exist_ok=True)
        try:
            for name, value in (("cpu.cfs_period_us", "100000"), ("cpu.cfs_quota_us", "25000")):
                with open(os.path.join(group, name), "w") as f:
                    f.write(value)
            code = (  # joins the group, then reads what the kernel holds it to
                "import os, sys; open(sys.argv[1], 'w').write(str(os.getpid()));"
                "from meshrl.procs.health import cpu_cores; print(cpu_cores())"
            )
            said = subprocess.run(
                [sys.executable, "-c", code, f"{group}/cgroup.procs"],
                capture_output=True, text=True, timeout=30, check=True,
            ).stdout  # fmt: skip
            assert float(said) == 0.25
        finally:
            os.rmdir(group)
    assert cpu_cores() == min(len(os.sched_getaffinity(0)), cpu_cores())


def test_cpu_max_of_cgroup_v2_caps_the_cores_at_the_tightest_level(tmp_path):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "cgroup").write_text("0::/job/step\n")
    (tmp_path / "cg" / "job" / "step").mkdir(parents=True)
    (tmp_path / "cg" / "cpu.max").write_text("max 100000\n")
    (tmp_path / "cg" / "job" / "cpu.max").write_text("50000 100000\n")
    (tmp_path / "cg" / "job" / "step" / "cpu.max").write_text("max 100000\n")
    got = cpu_cores(str(tmp_path / "proc"), str(tmp_path / "cg"))
    assert got == min(0.5, len(os.sched_getaffinity(0)))


def test_versions_that_differ_from_the_controller_are_a_finding():
    mine = versions()
    assert set(mine) == {"python", "torch", "transformers", "monarch"}
    other = {**mine, "torch": "0.0.1"}
    found = judge({"c1": {"versions": other}}, {}, 0.5, controller=mine)
    assert [(f.host, f.check) for f in found] == [("c1", "versions")]
    assert f"torch 0.0.1 (controller {mine['torch']})" in found[0].detail


def test_the_run_directory_is_written_and_its_free_space_checked(tmp_path):
    figures, failures = disk_figures(str(tmp_path), need_bytes=1)
    assert not failures and figures["free_gb"] > 0 and figures["disk_mb_s"] > 0
    assert os.listdir(tmp_path) == []  # nothing left behind
    _, failures = disk_figures(str(tmp_path), need_bytes=1 << 60)
    assert failures and failures[0].startswith("run_dir: ") and "the next checkpoint" in failures[0]
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    _, failures = disk_figures(str(blocked), need_bytes=1)
    assert failures == [f"run_dir: cannot write {blocked}: Not a directory"]


def test_bad_health_keys_are_one_error_naming_the_key():
    for key, value in (("preflight_s", 0.0), ("min_ratio", 1.5), ("hang_s", -1.0)):
        with pytest.raises(ConfigError, match=f"health.{key}"):
            HealthConfig(**{key: value}).validate()


SLEEPER = """
import threading, time
from meshrl.procs.health import install_stack_dump
install_stack_dump()
lock = threading.Lock()
lock.acquire()
def stuck_in_a_deadlock():
    print("ready", flush=True)
    lock.acquire()  # never returns
def beside():
    time.sleep(600)
threading.Thread(target=beside, name="beside", daemon=True).start()
stuck_in_a_deadlock()
"""


@pytest.mark.parametrize("stopped", [True, False], ids=["sigstop", "deadlock"])
def test_every_threads_stack_of_a_stopped_or_deadlocked_proc_is_taken_then_it_is_killed(stopped):
    proc = subprocess.Popen(
        [sys.executable, "-c", SLEEPER], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.2)  # (into the lock's wait)
        if stopped:
            os.kill(proc.pid, signal.SIGSTOP)
        began = time.monotonic()
        stacks = dump_and_kill(proc.pid)
        assert time.monotonic() - began < 5
        assert "stuck_in_a_deadlock" in stacks, stacks
        assert "beside" in stacks  # every thread's
        assert proc.wait(timeout=10) == -signal.SIGKILL
        assert not proc_pool.alive(proc.pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
