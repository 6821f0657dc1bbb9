"""The sandbox against the adversarial pass of issue #66: output read back by
path (FIFO and symlink swaps), metadata changed through descriptors, other
processes of the same user reached by number, the wall kill escaped with
setsid, and a scratch directory filled without bound. Each test asserts the
world afterwards (the caller came back, the file kept its mode, the sibling its
limits, no process is left, the scratch held no more than its bound)."""

import dataclasses
import os
import signal
import subprocess
import tempfile
import threading
import time
import uuid

import pytest

from meshrl.envs.sandbox import probe, run_python
from tests.support.sandbox_escapes import MODES
from tests.unit.test_sandbox import own_scratch, procs_left, sandbox_procs  # noqa: F401

# `own_scratch`: `sandbox_procs` counts this test's programs, not the other worker's.
pytestmark = [pytest.mark.unit, pytest.mark.timeout(120), pytest.mark.usefixtures("own_scratch")]


def shared_uid(mode: str):
    """This machine's isolation in `mode`, with the program keeping the caller's
    uid (as for a non-root caller; the tests run as root, so the program is
    root too: only seccomp and Landlock stand in its way)."""
    return dataclasses.replace(probe(MODES[mode]), run_uid=False)


def in_thread(timeout_s: float, **kwargs):
    """`run_python(**kwargs)` that must return within `timeout_s`."""
    done: dict = {}
    thread = threading.Thread(target=lambda: done.update(result=run_python(**kwargs)), daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert "result" in done, f"run_python did not return within {timeout_s}s"
    return done["result"]


@pytest.mark.parametrize("mode", ["everything", "landlock_and_seccomp"])
def test_a_fifo_in_place_of_stdout_cannot_hang_the_caller(mode):
    program = (
        "import os\nprint('written before', flush=True)\n"
        "for name in ('stdout', 'stderr'):\n"
        "    if os.path.exists(name):\n        os.remove(name)\n    os.mkfifo(name)\n"
    )
    result = in_thread(30, code=program, isolation=probe(MODES[mode]))
    assert result.ok and result.stdout == "written before\n", result


@pytest.mark.parametrize("mode", ["everything", "kernel_only"])
def test_a_symlink_in_place_of_stdout_reads_nothing_outside(mode):
    """The link made from deep below the scratch: its target, judged from the
    working directory, stays inside; the kernel resolves it from the link's
    directory, to the secret."""
    folder = tempfile.mkdtemp(prefix="meshrl-secret-")
    secret = os.path.join(folder, "secret.txt")
    text = f"SECRET-{uuid.uuid4().hex}"
    with open(secret, "w") as f:
        f.write(text)
    os.chmod(secret, 0o600)
    depth = 12
    program = (
        f"import os\nos.makedirs({'/'.join(['d'] * depth)!r})\n"
        f"os.chdir({'/'.join(['d'] * depth)!r})\n"
        f"up = '../' * {depth}\n"
        "for name in ('stdout', 'stderr'):\n"
        "    if os.path.exists(up + name):\n        os.remove(up + name)\n"
        "    try:\n"
        f"        os.symlink(up + {secret.lstrip('/')!r}, up + name)\n"
        "    except PermissionError as error:\n        print(error)\n"
        "print('linked', os.path.islink(up + 'stdout'))\n"
    )
    try:
        result = in_thread(30, code=program, isolation=probe(MODES[mode]))
    finally:
        os.remove(secret)
        os.rmdir(folder)
    assert text not in result.stdout and text not in result.stderr, result
    if mode == "everything":  # the hook judged the target from the link's directory
        assert "sandbox: os.symlink outside the scratch directory" in result.stdout, result
        assert "linked False" in result.stdout
    else:
        assert "linked True" in result.stdout, result  # made, and never read


@pytest.mark.parametrize("mode", ["everything", "kernel_only", "landlock_and_seccomp"])
def test_metadata_cannot_change_through_a_descriptor(mode):
    """A task input the program's user owns: chmod, chown and xattrs through an
    open descriptor (Landlock does not cover them) are refused."""
    folder = tempfile.mkdtemp(prefix="meshrl-owned-")
    owned = os.path.join(folder, "input.txt")
    with open(owned, "w") as f:
        f.write("rows")
    os.chmod(owned, 0o644)
    os.chmod(folder, 0o755)
    program = (
        f"import os\nfd = os.open({owned!r}, os.O_RDONLY)\n"
        "for how, step in (('fchmod', lambda: os.chmod(fd, 0o777)),\n"
        "                  ('fchown', lambda: os.chown(fd, 65534, 65534)),\n"
        "                  ('fsetxattr', lambda: os.setxattr(fd, 'user.meshrl', b'x')),\n"
        "                  ('fremovexattr', lambda: os.removexattr(fd, 'user.keep'))):\n"
        "    try:\n        step()\n        print('CHANGED', how)\n"
        "    except OSError as error:\n        print('refused', how, error)\n"
    )
    try:
        os.setxattr(owned, "user.keep", b"1")
        before = os.stat(owned)
        result = run_python(program, isolation=shared_uid(mode), read_paths=(owned,))
        after = os.stat(owned)
        xattrs = os.listxattr(owned)
    finally:
        os.remove(owned)
        os.rmdir(folder)
    assert "CHANGED" not in result.stdout and result.stdout.count("refused") == 4, result
    assert (after.st_mode, after.st_uid, after.st_gid) == (
        before.st_mode,
        before.st_uid,
        before.st_gid,
    )
    assert xattrs == ["user.keep"]
    if mode == "everything":
        assert "sandbox: os.chmod by file descriptor is not allowed" in result.stdout


SIBLING_PROGRAM = """
import ctypes, os, resource, signal
IOPRIO_SET = {"x86_64": 251, "aarch64": 30}[os.uname().machine]
def ioprio(who):
    lib = ctypes.CDLL(None, use_errno=True)
    if lib.syscall(IOPRIO_SET, 1, who, (3 << 13) | 0) < 0:  # IOPRIO_WHO_PROCESS, idle class
        raise OSError(ctypes.get_errno(), "ioprio_set")
def attempt(how, step):
    try:
        step()
        print("DONE", how)
    except OSError as error:
        print("refused", how, error.errno)
for who, pid in (("self", 0), ("own pid", os.getpid()), ("sibling", SIBLING)):
    attempt(f"prlimit {who}", lambda: resource.prlimit(pid, resource.RLIMIT_NOFILE, (32, 32)))
    attempt(f"setpriority {who}", lambda: os.setpriority(os.PRIO_PROCESS, pid, 5))
    attempt(f"affinity {who}", lambda: os.sched_setaffinity(pid, os.sched_getaffinity(0)))
    attempt(f"ioprio {who}", lambda: ioprio(pid))
attempt("setpriority user", lambda: os.setpriority(os.PRIO_USER, 0, 5))
attempt("kill self 0", lambda: os.kill(os.getpid(), 0))
attempt("kill own group 0", lambda: os.kill(0, 0))
attempt("kill sibling", lambda: os.kill(SIBLING, signal.SIGKILL))
"""


def sibling_state(pid: int) -> tuple:
    with open(f"/proc/{pid}/limits") as f:
        limits = f.read()
    with open(f"/proc/{pid}/stat") as f:
        nice = f.read().rsplit(")", 1)[1].split()[16]
    return limits, nice, os.sched_getaffinity(pid)


@pytest.mark.parametrize("landlock_v5", [False, True])
def test_another_process_of_the_same_user_is_out_of_reach(landlock_v5):
    """No PID namespace, the caller's uid: prlimit, setpriority, affinity and
    I/O priority reach the program itself only; where Landlock cannot scope
    signals (ABI < 6), neither can kill."""
    isolation = shared_uid("landlock_and_seccomp")
    if landlock_v5:
        isolation = dataclasses.replace(isolation, landlock_abi=min(isolation.landlock_abi, 5))
    sibling = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        before = sibling_state(sibling.pid)
        result = run_python(f"SIBLING = {sibling.pid}\n" + SIBLING_PROGRAM, isolation=isolation)
        alive = sibling.poll() is None
        after = sibling_state(sibling.pid) if alive else None
    finally:
        sibling.kill()
        sibling.wait()
    assert alive and after == before, result
    lines = result.stdout.splitlines()
    for how in ("prlimit", "setpriority", "affinity", "ioprio"):
        assert f"DONE {how} self" in lines and f"DONE {how} own pid" in lines, result
        assert f"refused {how} sibling 1" in lines, result
    assert "refused setpriority user 1" in lines
    assert "DONE kill self 0" in lines and "DONE kill own group 0" in lines
    assert "refused kill sibling 1" in lines


def test_the_wall_limit_kills_what_left_the_process_group():
    """Without a PID namespace the wall limit kills the process group: setsid
    and setpgid, which would leave it, are refused (with one, the run's
    namespace dies with it)."""
    program = """
import os, time
for leave in (os.setsid, lambda: os.setpgid(0, 0)):
    if os.fork() == 0:
        try:
            leave()
            print("LEFT", os.getpgrp(), flush=True)
        except OSError as error:
            print("refused", error, flush=True)
        time.sleep(20)  # on a sandbox that lets it out, it ends on its own
        os._exit(0)
time.sleep(20)
"""
    before = sandbox_procs()
    try:
        for mode in ("landlock_and_seccomp", "everything"):
            started = time.monotonic()
            # 3 s: on a loaded machine both forks report before the wall kill.
            result = run_python(program, timeout_s=3.0, isolation=probe(MODES[mode]))
            assert result.timed_out and time.monotonic() - started < 10, result
            assert procs_left(before) == set(), (mode, result)
            if mode == "landlock_and_seccomp":
                assert "LEFT" not in result.stdout and result.stdout.count("refused") == 2, result
    finally:
        for pid in sandbox_procs() - before:
            os.kill(pid, signal.SIGKILL)


FILL_BYTES = """
import os
written = 0
try:
    while True:
        with open(f"f{written}", "wb") as f:
            f.write(b"x" * 60_000)
        written += 1
except OSError as error:
    print("stopped", written, error.errno, flush=True)
"""

FILL_INODES = """
import os
made = 0
try:
    while True:
        os.mkdir(f"d{made}") if made % 2 else open(f"f{made}", "w").close()
        made += 1
except OSError as error:
    print("stopped", made, error.errno, flush=True)
"""


@pytest.mark.parametrize("mode", ["everything", "landlock_and_seccomp"])
def test_the_scratch_directory_is_bounded_in_bytes_and_files(mode):
    """With a mount namespace the scratch is a tmpfs of that size (the program
    meets ENOSPC); without one the parent measures it and stops the run."""
    isolation = probe(MODES[mode])
    started = time.monotonic()
    by_bytes = run_python(FILL_BYTES, timeout_s=20, scratch_mb=2, isolation=isolation)
    by_files = run_python(FILL_INODES, timeout_s=20, scratch_files=300, isolation=isolation)
    assert time.monotonic() - started < 30
    if isolation.launcher:
        assert by_bytes.ok and by_bytes.stdout.startswith("stopped"), by_bytes
        written, errno = map(int, by_bytes.stdout.split()[1:3])
        assert errno == 28 and 20 <= written <= 2 * 2**20 // 60_000, by_bytes
        assert by_files.ok and by_files.stdout.split()[1:3] == ["300", "28"], by_files
    else:
        for result in (by_bytes, by_files):
            assert not result.timed_out, result
            assert result.error.startswith("scratch limit ("), result
            assert "stopped" not in result.stdout
