"""Local procs are forks of one server that imported torch once
(`meshrl.procs.zygote`): each is still a proc Monarch spawned, supervises and
stops, and ends with the process Monarch knows."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from monarch.actor import Actor, endpoint

from meshrl.procs.job import JobConfig
from meshrl.procs.mesh import RemoteCallError, RoleMeshes, wait
from meshrl.procs.proc_pool import CORES_ENV, alive, local_cores, monarch_pids
from meshrl.procs.zygote import STAND_IN_ENV, python_m, server

pytestmark = [pytest.mark.actors, pytest.mark.timeout(180)]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Probe(Actor):
    @endpoint
    def facts(self) -> dict:
        with open("/proc/self/comm") as f:
            comm = f.read().strip()
        return {
            "pid": os.getpid(),
            "comm": comm,
            "stand_in": int(os.environ.get(STAND_IN_ENV, 0)),
            "cwd": os.getcwd(),
            "stdout": os.readlink("/proc/self/fd/1"),
            "threads": int(os.environ["OMP_NUM_THREADS"]),
        }

    @endpoint
    def exit(self, code: int) -> None:
        os._exit(code)


def parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_forked_procs_are_monarchs_procs_and_end_with_their_stand_ins(no_stray_procs):
    with RoleMeshes({"a": 2, "b": 1}) as meshes:
        probes, other = (meshes[role].spawn("probe", Probe) for role in ("a", "b"))
        facts = [answer for _, answer in wait(probes.facts.call(), "facts", 60).items()]
        facts.append(wait(other.facts.call_one(), "facts", 60))
        for proc in facts:
            # A fork of the server, not a fresh Python, named after its stand-in.
            assert proc["comm"] == f"meshrl@{proc['stand_in']}"
            assert parent(proc["stand_in"]) == os.getpid()  # what Monarch spawned, here
            # The fork took over the stand-in's descriptors and directory.
            assert os.readlink(f"/proc/{proc['stand_in']}/fd/1") == proc["stdout"]
            assert proc["cwd"] == os.getcwd() and proc["threads"] == 1
        assert len({proc["pid"] for proc in facts}) == 3
        # Counted as this process's procs, though the server forked them; not another's.
        assert {proc["pid"] for proc in facts} <= monarch_pids(started_by=os.getpid())
        with subprocess.Popen(["sleep", "30"]) as other_process:
            assert not monarch_pids(started_by=other_process.pid)
            other_process.kill()

        # A proc that exits: Monarch sees it end with its exit code.
        with pytest.raises(RemoteCallError, match="code 3") as info:
            wait(probes.slice(procs=0).exit.call_one(3), "a.exit", 60)
        assert info.value.proc_lost
        assert not alive(facts[0]["stand_in"])
        assert wait(probes.slice(procs=1).facts.call_one(), "a.facts", 60) == facts[1]

        # Monarch's process killed outright: its fork ends too, and the proc is lost.
        os.kill(facts[2]["stand_in"], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while alive(facts[2]["pid"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(facts[2]["pid"])
        # Monarch says how it ended ("Killed(sig=9)"), or, its host agent busy, that the
        # agent's query timed out ("The process likely crashed": seen once under load in
        # a full `make test`); the proc is lost either way.
        with pytest.raises(RemoteCallError, match="sig=9|likely crashed") as info:
            wait(other.facts.call_one(), "b.facts", 60)
        assert info.value.proc_lost

        # A stopped fork (SIGSTOP) whose stand-in is killed cannot see it go: the
        # server ends it (else it stays stopped after the run, holding its pipes).
        os.kill(facts[1]["pid"], signal.SIGSTOP)
        os.kill(facts[1]["stand_in"], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while alive(facts[1]["pid"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(facts[1]["pid"])


def test_without_the_fork_server_each_proc_is_a_fresh_python(no_stray_procs):
    with RoleMeshes({"workers": 1}, job=JobConfig(fork_server=False)) as meshes:
        probe = meshes["workers"].spawn("probe", Probe)
        facts = wait(probe.facts.call_one(), "facts", 120)
        assert not facts["comm"].startswith("meshrl@") and facts["stand_in"] == 0
        assert parent(facts["pid"]) == os.getpid()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another user")
def test_another_user_cannot_reach_the_fork_server():
    """The socket's folder is this user's alone (mode 0700): the kernel refuses
    a process of another uid before the server sees it."""
    path = server().path
    assert os.stat(os.path.dirname(path)).st_mode & 0o077 == 0
    probe = (
        "import os, socket, sys\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "try:\n"
        "    s.connect(sys.argv[1])\n"
        "except PermissionError:\n"
        "    sys.exit(7)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe, path], timeout=30)
    assert result.returncode == 7


def test_python_m_runs_a_module_as_a_fork_that_behaves_as_a_fresh_python(tmp_path):
    """`python_m` (the suite's command-line runs): argv, working directory,
    environment, PYTHONPATH, pipes, exit status and signals as `python -m`."""
    command = python_m("tests.actors.test_zygote", "a b", "c")
    assert command[3] == "run", command  # the suite shares its fork server
    (tmp_path / "zygote_extra.py").write_text("VALUE = 7\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "PROBE": "yes"}
    # Three at once: each fork must exit cleanly though the server held sockets to
    # the others when it forked it (their numbers are reused in the child).
    runs = [
        subprocess.Popen(
            command,
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    for run in runs:
        stdout, stderr = run.communicate("in\n", timeout=60)
        assert run.returncode == 5, stderr
        assert stderr == "to stderr\n"
    facts = json.loads(stdout)
    assert facts == {
        "args": ["a b", "c"],
        "file": os.path.join(REPO, "tests", "actors", "test_zygote.py"),
        "cwd": REPO,
        "path0": REPO,
        "extra": 7,
        "env": "yes",
        "stdin": "in\n",
        "comm": "meshrl-run",  # not counted as a Monarch proc
    }
    # Started with SIGINT ignored (as by a background shell), it ignores it as a
    # fresh Python would; SIGTERM ends it, and its stand-in, by that signal.
    with subprocess.Popen(
        python_m("tests.actors.test_zygote", "sleep"),
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    ) as sleeper:
        assert sleeper.stdout.readline() == "ready\n"
        sleeper.send_signal(signal.SIGINT)
        with pytest.raises(subprocess.TimeoutExpired):
            sleeper.wait(timeout=1)
        sleeper.send_signal(signal.SIGTERM)
        assert sleeper.wait(timeout=30) == -signal.SIGTERM


if __name__ == "__main__":  # what the test above runs through `python_m`
    if sys.argv[1:] == ["sleep"]:
        print("ready", flush=True)
        time.sleep(60)
    import zygote_extra

    with open("/proc/self/comm") as f:
        comm = f.read().strip()
    print(
        json.dumps(
            {
                "args": sys.argv[1:],
                "file": sys.argv[0],
                "cwd": os.getcwd(),
                "path0": sys.path[0],
                "extra": zygote_extra.VALUE,
                "env": os.environ["PROBE"],
                "stdin": sys.stdin.read(),
                "comm": comm,
            }
        )
    )
    sys.stderr.write("to stderr\n")
    sys.exit(5)


def test_local_cores_follow_the_affinity_and_meshrl_cores(monkeypatch):
    """A run's local procs share the cores this process may run on (a `taskset` or
    a container's cpuset, not the machine's count), or `MESHRL_CORES` where set."""
    monkeypatch.delenv(CORES_ENV, raising=False)
    assert local_cores() == len(os.sched_getaffinity(0))
    one = min(os.sched_getaffinity(0))
    pinned = subprocess.run(
        [
            sys.executable,
            "-c",
            "from meshrl.procs.proc_pool import local_cores; print(local_cores())",
        ],
        preexec_fn=lambda: os.sched_setaffinity(0, {one}),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert pinned.stdout.strip() == "1"
    monkeypatch.setenv(CORES_ENV, "3")
    assert local_cores() == 3
    for bad in ("0", "two"):
        monkeypatch.setenv(CORES_ENV, bad)
        with pytest.raises(ValueError, match=f"{CORES_ENV}='{bad}'"):
            local_cores()
