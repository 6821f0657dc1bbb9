"""The code sandbox against hostile programs: each test asserts the containment
itself (the file is absent, the variable unseen, the connection never made)."""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from meshrl.envs.sandbox import run_python

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


def sandbox_procs() -> set[int]:
    """Live processes running the sandbox's interpreter (its guard is on the command line)."""
    found = set()
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if b"addaudithook" in cmdline and state != "Z":
            found.add(int(entry))
    return found


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
    assert not sandbox_procs()


def test_a_fork_bomb_is_bounded_and_nothing_outlives_the_run():
    before = sandbox_procs()
    bomb = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    started = time.monotonic()
    result = run_python(bomb, timeout_s=2.0, max_procs=8)
    assert result.timed_out and time.monotonic() - started < 10
    assert sandbox_procs() - before == set()


def test_a_huge_allocation_fails_inside_the_sandbox():
    result = run_python("x = bytearray(4 * 1024**3)\nprint('allocated')", memory_mb=256)
    assert result.error == "memory limit (256 MB)" and "allocated" not in result.stdout
    assert "MemoryError" in result.stderr


def test_huge_output_is_cut_at_the_bound():
    result = run_python("while True:\n    print('x' * 1000)", max_output_bytes=10_000)
    assert len(result.stdout) <= 10_000 and result.stdout.startswith("xxx")
    assert result.error == "output limit (10000 bytes)"


def test_writes_outside_the_scratch_directory_do_not_happen():
    target = f"/tmp/meshrl-escape-{uuid.uuid4().hex}"
    for code in (
        f"open({target!r}, 'w').write('escaped')",
        f"import os\nfd = os.open({target!r}, os.O_WRONLY | os.O_CREAT)\nos.write(fd, b'x')",
        f"import os\nopen('a', 'w').write('x')\nos.rename('a', {target!r})",
        f"import shutil\nopen('a', 'w').write('x')\nshutil.copy('a', {target!r})",
    ):
        result = run_python(code)
        assert result.exit_code == 1 and "outside the scratch directory" in result.error, code
        assert not os.path.exists(target)


def test_the_parents_environment_is_not_visible(monkeypatch):
    monkeypatch.setenv("MESHRL_SANDBOX_SECRET", "hunter2")
    result = run_python(
        "import os\nprint(os.environ.get('MESHRL_SANDBOX_SECRET'))\nprint(sorted(os.environ))\n"
        "print(open(f'/proc/{os.getppid()}/environ').read())"
    )
    assert "hunter2" not in result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "None"
    assert "MESHRL_SANDBOX_SECRET" not in lines[1]
    assert "another process's environment" in result.error


def test_a_network_connection_is_never_made():
    with socket.socket() as server:  # a listener the program could reach without the sandbox
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.5)
        port = server.getsockname()[1]
        for code in (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')",
            "import os\nos.system('curl http://127.0.0.1')",
            "import ctypes\nprint(ctypes.CDLL(None).getpid())",
        ):
            result = run_python(code)
            assert result.exit_code == 1 and "connected" not in result.stdout, code
            assert "sandbox:" in result.error, result.error
        with pytest.raises(TimeoutError):
            server.accept()  # nobody connected


UNPRIVILEGED_DRIVER = """
import json, os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sandbox import _launcher, run_python
target, port = sys.argv[1], int(sys.argv[2])
runs = {
    "ok": run_python("print(6 * 7)"),
    "net": run_python(f"import socket\\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)"),
    "write": run_python(f"open({target!r}, 'w').write('escaped')"),
    "env": run_python("import os\\nprint(os.environ.get('MESHRL_SANDBOX_SECRET'))"),
    "loop": run_python("while True:\\n    pass", timeout_s=1.0),
    "bomb": run_python("import os\\nwhile True:\\n    try:\\n        os.fork()\\n    except OSError:\\n        pass", timeout_s=2.0, max_procs=8),
}
print(json.dumps({"uid": os.getuid(), "launcher": list(_launcher()),
                  **{k: [r.stdout, r.error] for k, r in runs.items()}}))
"""


DROP = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--")


def unprivileged_python(home: str) -> str | None:
    """An interpreter with which the user nobody can run the sandbox copied into
    `home` (this one may sit under /root, out of nobody's reach)."""
    if not shutil.which("setpriv"):
        return None
    probe = "from sandbox import run_python; assert run_python('pass').ok"
    for python in (os.path.realpath(sys.executable), "/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(python):
            run = subprocess.run([*DROP, python, "-c", probe], cwd=home, capture_output=True)
            if run.returncode == 0:
                return python
    return None


@pytest.mark.skipif(
    os.geteuid() != 0, reason="as a non-root user the tests above take the unprivileged path"
)
def test_the_unprivileged_path_contains_the_same_programs(monkeypatch):
    """The tests above run as root here (the sandbox drops to nobody); this runs
    the sandbox itself as an unprivileged user, as on a researcher's machine."""
    monkeypatch.setenv("MESHRL_SANDBOX_SECRET", "hunter2")
    home = tempfile.mkdtemp(prefix="meshrl-unpriv-")
    target = f"/tmp/meshrl-escape-{uuid.uuid4().hex}"
    try:
        os.chmod(home, 0o755)
        # The sandbox module is stdlib-only: a copy runs under an interpreter the
        # unprivileged user can execute.
        shutil.copy(Path(run_python.__code__.co_filename), Path(home, "sandbox.py"))
        Path(home, "driver.py").write_text(UNPRIVILEGED_DRIVER)
        python = unprivileged_python(home)
        if python is None:
            pytest.skip("no setpriv, or no interpreter the user nobody may run")
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen()
            server.settimeout(0.5)
            out = subprocess.run(
                [
                    *DROP,
                    python,
                    "driver.py",
                    target,
                    str(server.getsockname()[1]),
                ],
                cwd=home,
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            ).stdout
            with pytest.raises(TimeoutError):
                server.accept()  # nobody connected
    finally:
        shutil.rmtree(home, ignore_errors=True)
    seen = json.loads(out.splitlines()[-1])
    assert seen["uid"] == 65534
    assert seen["ok"] == ["42\n", ""], seen
    assert "sandbox:" in seen["net"][1]
    assert "outside the scratch directory" in seen["write"][1] and not os.path.exists(target)
    assert seen["env"][0] == "None\n"
    assert seen["loop"][1] == "wall time limit (1s)" and seen["bomb"][1].startswith("wall time")
    assert not sandbox_procs()
