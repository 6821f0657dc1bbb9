"""The code sandbox against hostile programs: each test asserts the containment
itself (the file is absent, the variable unseen, the connection never made)."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from meshrl.envs import sandbox
from meshrl.envs.sandbox import Isolation, SandboxUnavailable, probe, run_python
from tests.support import sandbox_escapes as escapes
from tests.support.sandbox_escapes import ESCAPES, MODES, cross_run, run_escapes

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


@pytest.fixture(autouse=True)
def own_scratch(monkeypatch):
    """This test's runs make their scratch directories (and the escapes their
    folders) in a folder of its own: tempfile's default directory, pointed
    there. `sandbox_procs` counts the programs running in it, so with
    `pytest -n 2` a test neither sees nor kills the other worker's programs."""
    folder = tempfile.mkdtemp(prefix="meshrl-sbtest-")
    os.chmod(folder, 0o1777)  # as /tmp: a run's own uid, and nobody, make their scratch here
    monkeypatch.setattr(tempfile, "tempdir", folder)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def sandbox_procs() -> set[int]:
    """Live processes running the sandbox's interpreter (its guard is on the
    command line) for this test: their HOME, the run's scratch directory, lies
    in `tempfile.gettempdir()` (`own_scratch`). A process whose environment
    cannot be read counts as this test's."""
    found, folder = set(), tempfile.gettempdir()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if b"addaudithook" not in cmdline or state == "Z":
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            environ = None
        homes = [os.fsdecode(item[5:]) for item in environ or () if item.startswith(b"HOME=")]
        if not homes or (
            os.path.dirname(homes[0]) == folder
            and os.path.basename(homes[0]).startswith("meshrl-sandbox-")
        ):
            found.add(int(entry))
    return found


def procs_left(before: set[int] = frozenset(), within_s: float = 5.0) -> set[int]:
    """This test's sandbox processes beyond `before` once they had up to
    `within_s` to go: a SIGKILLed process on a loaded machine takes a moment
    to exit. Empty as soon as none is left."""
    deadline = time.monotonic() + within_s
    while (left := sandbox_procs() - before) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


def test_a_program_gets_stdin_and_reports_output_and_status():
    result = run_python(
        "import os, sys\nprint(sys.stdin.read()[::-1])\nprint(os.getcwd())\nsys.exit(3)",
        stdin="abc",
    )
    out, cwd = result.stdout.splitlines()
    assert out == "cba" and result.exit_code == 3 and not result.timed_out
    assert result.error == "exit status 3"
    assert not os.path.exists(cwd)  # the scratch directory is gone
    ok = run_python(
        "open('note.txt', 'w').write('kept in scratch'); print(open('note.txt').read())"
    )
    assert ok.ok and ok.stdout == "kept in scratch\n" and ok.exit_code == 0


def test_an_infinite_loop_is_stopped_at_the_wall_limit():
    started = time.monotonic()
    result = run_python("while True:\n    pass", timeout_s=1.0)
    assert result.timed_out and result.error == "wall time limit (1s)"
    assert time.monotonic() - started < 5
    assert not procs_left()


def test_a_fork_bomb_is_bounded_and_nothing_outlives_the_run():
    before = sandbox_procs()
    bomb = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    started = time.monotonic()
    result = run_python(bomb, timeout_s=2.0, max_procs=8)
    assert result.timed_out and time.monotonic() - started < 10
    assert procs_left(before) == set()


def test_a_huge_allocation_fails_inside_the_sandbox():
    result = run_python("x = bytearray(4 * 1024**3)\nprint('allocated')", memory_mb=256)
    assert result.error == "memory limit (256 MB)" and "allocated" not in result.stdout
    assert "MemoryError" in result.stderr


def test_huge_output_is_cut_at_the_bound():
    result = run_python("while True:\n    print('x' * 1000)", max_output_bytes=10_000)
    assert len(result.stdout) <= 10_000 and result.stdout.startswith("xxx")
    assert result.error == "output limit (10000 bytes)"


@pytest.mark.parametrize("mode", MODES)
def test_no_escape_gets_out(mode, monkeypatch):
    """Each of tests/support/sandbox_escapes.py's programs (the audit hook switched off
    from inside, dir_fd, symlinks, hard links, /proc/self/fd, fork/exec and
    posix_spawn, raw syscalls through ctypes, the parent's files and environment,
    TCP/UDP/unix connections to live listeners, signals) is contained."""
    monkeypatch.setenv("MESHRL_SANDBOX_SECRET", "hunter2")
    breaches = run_escapes(run_python, probe(MODES[mode]))
    assert not any(breaches.values()), breaches


@pytest.mark.parametrize("mode", ["everything", "landlock_and_seccomp"])
def test_concurrent_runs_cannot_touch_each_other(mode):
    assert cross_run(run_python, isolation=probe(MODES[mode])) == []


def test_each_result_says_what_was_in_force_and_the_hook_explains_refusals():
    result = run_python("import socket\nsocket.create_connection(('127.0.0.1', 9))")
    assert {"landlock-v1", "seccomp", "rlimits"} <= {
        name if not name.startswith("landlock") else "landlock-v1" for name in result.isolation
    }
    assert "sandbox: module _socket is not allowed" in result.error
    bare = run_python("open('/etc/hostname-x', 'w')", isolation=probe(MODES["kernel_only"]))
    assert "audit-hook" not in bare.isolation and "Permission denied" in bare.error
    # The task's inputs are readable when named, and only then.
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as data:
        data.write("input rows")
        data.flush()
        os.chmod(data.name, 0o644)
        read = f"print(open({data.name!r}).read())"
        assert run_python(read, read_paths=(data.name,)).stdout == "input rows\n"
        assert "Permission denied" in run_python(read).error


def test_a_machine_without_the_minimum_refuses_with_one_line(monkeypatch, capsys):
    weak = Isolation(landlock_abi=0, seccomp=False, launcher=())
    monkeypatch.setattr(sandbox, "probe", lambda without=frozenset(): weak)
    with pytest.raises(SandboxUnavailable) as refused:
        sandbox.require(allow_weak=False)
    message = str(refused.value)
    assert "\n" not in message and "files: needs Landlock" in message
    assert "network: needs a network namespace" in message and "sandbox.allow_weak" in message
    with pytest.raises(SandboxUnavailable):
        run_python("print(1)")  # run_python itself refuses, not only the task
    assert sandbox.require(allow_weak=True) is weak
    assert "WARNING sandbox: weak isolation" in capsys.readouterr().err
    # The config refuses a task that runs programs before anything is spawned.
    from algorithms.grpo import GRPOConfig
    from meshrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="task 'code': sandbox: this machine cannot isolate"):
        load_config(GRPOConfig, None, ["task.name=code"])
    load_config(GRPOConfig, None, ["task.name=code", "sandbox.allow_weak=true"])
    load_config(GRPOConfig, None, ["task.name=countdown"])  # runs no programs: no refusal


UNPRIVILEGED_DRIVER = """
import json, os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from meshrl.envs.sandbox import probe, run_python
from sandbox_escapes import MODES, cross_run, run_escapes
seen = {"uid": os.getuid(), "launcher": list(probe().launcher)}
for mode, without in MODES.items():
    for name, found in run_escapes(run_python, probe(without)).items():
        seen[f"{mode}/{name}"] = found
    seen[f"{mode}/cross_run"] = cross_run(run_python, isolation=probe(without))
seen["ok"] = [run_python("print(6 * 7)").stdout]
seen["loop"] = [run_python("while True:\\n    pass", timeout_s=0.5).error]
bomb = "import os\\nwhile True:\\n    try:\\n        os.fork()\\n    except OSError:\\n        pass"
seen["bomb"] = [run_python(bomb, timeout_s=1.0, max_procs=8).error]
# Without namespaces: leaving the process group (refused), and a full scratch.
bare = probe(MODES["landlock_and_seccomp"])
leave = "import os, time\\nfor leave in (os.setsid, lambda: os.setpgid(0, 0)):\\n    if os.fork() == 0:"
leave += "\\n        try:\\n            leave()\\n        except OSError:\\n            pass"
leave += "\\n        time.sleep(5)\\n        os._exit(0)\\ntime.sleep(20)"
seen["setsid"] = [run_python(leave, timeout_s=0.5, isolation=bare).error]
fill = "made = 0\\ntry:\\n    while True:\\n        open(f'f{made}', 'w').close()\\n        made += 1"
fill += "\\nexcept OSError as error:\\n    print('stopped', made, error.errno)"
seen["scratch"] = [
    (lambda r: r.error or r.stdout)(run_python(fill, scratch_files=100, isolation=isolation))
    for isolation in (probe(), bare)
]
print(json.dumps(seen))
"""


DROP = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--")


def unprivileged_python(home: str) -> str | None:
    """An interpreter with which the user nobody can run the sandbox copied into
    `home` (this one may sit under /root, out of nobody's reach)."""
    if not shutil.which("setpriv"):
        return None
    check = "from meshrl.envs.sandbox import run_python; assert run_python('pass').ok"
    for python in (os.path.realpath(sys.executable), "/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(python):
            run = subprocess.run([*DROP, python, "-c", check], cwd=home, capture_output=True)
            if run.returncode == 0:
                return python
    return None


@pytest.mark.skipif(
    os.geteuid() != 0, reason="as a non-root user the tests above take the unprivileged path"
)
def test_the_unprivileged_path_contains_the_same_programs(monkeypatch):
    """The tests above run as root here (each run gets a uid of its own); this
    runs the whole escape suite again as the user nobody, as on a researcher's
    machine: the caller's uid kept, user namespaces, and without them."""
    monkeypatch.setenv("MESHRL_SANDBOX_SECRET", "hunter2")
    home = tempfile.mkdtemp(prefix="meshrl-unpriv-")
    try:
        os.chmod(home, 0o755)
        # The sandbox and the escapes are stdlib-only: copies run under an
        # interpreter the unprivileged user can execute.
        # The package layout with empty __init__s: nothing beyond the sandbox loads.
        envs = Path(home, "meshrl", "envs")
        envs.mkdir(parents=True)
        for folder in (envs.parent, envs):
            Path(folder, "__init__.py").touch()
        for name in ("sandbox.py", "sandbox_child.py", "sandbox_probe.py"):
            shutil.copy(Path(sandbox.__file__).with_name(name), envs / name)
        shutil.copy(escapes.__file__, Path(home, "sandbox_escapes.py"))
        subprocess.run(["chmod", "-R", "a+rX", home], check=True)
        Path(home, "driver.py").write_text(UNPRIVILEGED_DRIVER)
        python = unprivileged_python(home)
        if python is None:
            pytest.skip("no setpriv, or no interpreter the user nobody may run")
        out = subprocess.run(
            [*DROP, python, "driver.py"],
            cwd=home,
            capture_output=True,
            text=True,
            timeout=90,
            env={**os.environ, "TMPDIR": tempfile.gettempdir()},  # its runs: `own_scratch`
        )
        assert out.returncode == 0, out.stderr[-2000:]
    finally:
        shutil.rmtree(home, ignore_errors=True)
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen.pop("uid") == 65534 and seen.pop("launcher")[1] == "--user"
    assert seen.pop("ok") == ["42\n"]
    assert seen.pop("loop") == ["wall time limit (0.5s)"]
    assert seen.pop("bomb")[0].startswith("wall time")
    # The forks that tried to leave the process group died with it (below: none left).
    assert seen.pop("setsid") == ["wall time limit (0.5s)"]
    assert seen.pop("scratch") == ["stopped 100 28\n", "scratch limit (64 MB, 100 files)"]
    assert len(seen) == len(MODES) * (len(ESCAPES) + 1)
    assert not any(seen.values()), {k: v for k, v in seen.items() if v}
    assert not procs_left()
