"""Run model-written Python where it cannot hurt the host: `run_python`.

Each call starts a fresh interpreter in its own process group and returns a
`SandboxResult`; hostile code gets a result (a reason in `error`), never a hang
or a crash of the caller. The layers, outermost first:

- **Namespaces.** Where the kernel allows them (root, or unprivileged user
  namespaces), the code runs in network and PID namespaces of its own
  (`unshare`): no network device but loopback, and every process it forks
  dies with the run.
- **Network.** Always, also without namespaces: an audit hook, installed
  before the code runs and impossible to remove from Python, refuses sockets.
- **Limits** (setrlimit, inherited by every child):
  - wall time (the caller kills the process group) and CPU time;
  - address space (`memory_mb`);
  - file size (`max_output_bytes`: output and files alike);
  - open files;
  - processes: run as `nobody` when the caller is root, since root ignores
    the process limit.
- **Files.**
  - The working directory, HOME and TMPDIR are a fresh scratch directory,
    removed afterwards.
  - The audit hook refuses writes, renames, removals and links outside it.
  - Other programs cannot be started: exec, spawn, subprocess, `os.system`.
  - ctypes is refused, as it could sidestep the hook.
- **Environment.** Nothing is inherited: PATH, HOME, TMPDIR and LANG only,
  and `python -I` ignores PYTHON* variables and the user's site directory.
- **Output.** stdout and stderr go to files in the scratch directory, bounded
  by the file-size limit, and are read back truncated to `max_output_bytes`.

This is a best-effort sandbox for RL rewards on a machine you own. It is not a
boundary against a determined attacker with kernel exploits: run untrusted
code at scale in a VM or container as well.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

NOBODY = 65534
# No network; a PID namespace whose processes all die with its first one, which
# dies with `unshare` (--kill-child): nothing the code forks outlives the run.
NAMESPACES = ("--net", "--pid", "--fork", "--kill-child", "--")


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None
    """The process's exit status; negative: killed by that signal."""
    timed_out: bool
    error: str
    """Empty when the program ran and exited by itself with status 0; else a
    short reason: 'exit status 1', 'wall time limit (5s)', 'CPU time limit',
    'memory limit (512 MB)', 'output limit (65536 bytes)', 'killed by signal 9'."""
    duration_s: float

    @property
    def ok(self) -> bool:
        return not self.error


# Runs in the child before the user's code. An audit hook cannot be removed once
# added (sys.addaudithook), so the code below it cannot undo these refusals.
_GUARD = r"""
import os, resource, sys
for _limit, _value in %(limits)r:
    resource.setrlimit(getattr(resource, _limit), (_value, _value))
_scratch = os.path.realpath(os.getcwd())
_code = open("main.py").read()
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_BLOCKED = ("socket.", "ctypes.", "os.exec", "os.posix_spawn", "os.spawn",
            "os.system", "subprocess.", "os.fork")  # os.fork: see _FORK_OK
_PATH_EVENTS = {"os.rename": 2, "os.remove": 1, "os.rmdir": 1, "os.mkdir": 1,
                "os.symlink": 2, "os.link": 2, "os.chmod": 1, "os.chown": 1,
                "os.truncate": 1, "os.utime": 1, "shutil.rmtree": 1, "shutil.move": 2}
_NO_IMPORT = {"_ctypes", "_posixsubprocess", "_socket"}
_FORK_OK = %(fork_ok)s

def _inside(path):
    if isinstance(path, int):
        return True  # an open descriptor: its opening was checked
    real = os.path.realpath(os.fsdecode(path))
    return real == _scratch or real.startswith(_scratch + os.sep)

def _guard(event, args):
    if event == "os.fork" and _FORK_OK:
        return
    if event.startswith(_BLOCKED):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "import" and args[0] in _NO_IMPORT:
        raise ImportError(f"sandbox: module {args[0]} is not allowed")
    if event == "open":
        path, mode, flags = args
        if path is None:
            return
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & _WRITE)
        real = os.path.realpath(os.fsdecode(path)) if not isinstance(path, int) else ""
        if "/environ" in real and real.startswith("/proc/"):
            raise PermissionError("sandbox: reading another process's environment is not allowed")
        if writes and not _inside(path):
            raise PermissionError(f"sandbox: writing outside the scratch directory: {path}")
    elif event in _PATH_EVENTS:
        for path in args[: _PATH_EVENTS[event]]:
            if path is not None and not _inside(path):
                raise PermissionError(f"sandbox: {event} outside the scratch directory: {path}")

sys.addaudithook(_guard)
del _guard
exec(compile(_code, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""


@functools.cache
def _launcher() -> tuple[str, ...]:
    """The command prefix that gives the child its own network and PID
    namespaces and, when this process is root, the user nobody (root ignores
    the process-count limit); without namespaces where the kernel allows none
    here (the audit hook still refuses sockets; the process group is killed)."""
    unshare, setpriv = shutil.which("unshare"), shutil.which("setpriv")
    if os.geteuid() == 0:
        drop = (setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--")
        candidates = [(unshare, *NAMESPACES, *drop), drop] if setpriv else []
    else:
        candidates = [(unshare, "--user", *NAMESPACES)] if unshare else []
    for prefix in candidates:
        if None in prefix:
            continue
        try:
            probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            continue
        if probe.returncode == 0:
            return prefix
    if os.geteuid() == 0:
        raise RuntimeError("sandbox: running as root needs setpriv (util-linux) to drop to nobody")
    return ()


def _user_procs(uid: int) -> int:
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    count += 1
            except OSError:
                pass
    return count


def run_python(
    code: str,
    stdin: str = "",
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_output_bytes: int = 65536,
    max_procs: int = 8,
) -> SandboxResult:
    """Run `code` with `stdin` in a fresh sandboxed interpreter (see the module
    docstring for the limits). `max_procs` > 1 lets it fork that many processes."""
    started = time.monotonic()
    scratch = tempfile.mkdtemp(prefix="meshrl-sandbox-")
    root = os.geteuid() == 0
    try:
        with open(os.path.join(scratch, "main.py"), "w") as f:
            f.write(code)
        with open(os.path.join(scratch, "stdin.txt"), "w") as f:
            f.write(stdin)
        uid = NOBODY if root else os.getuid()
        if root:
            os.chown(scratch, NOBODY, NOBODY)
        # The process limit counts every process of the user: allow this many more.
        nproc = (_user_procs(uid) if not root else _user_procs(NOBODY)) + max_procs
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": scratch,
            "TMPDIR": scratch,
            "LANG": "C.UTF-8",
        }
        limits = [
            # A second past the wall limit: a one-thread loop reaches both at the
            # same moment, and when the CPU limit's signal won, `unshare --fork`
            # exited 1 ("sigprocmask unblock failed") instead of reporting the
            # wall limit. Threads that burn CPU faster than the wall clock still
            # meet this limit first.
            ("RLIMIT_CPU", int(timeout_s + 0.999) + 1),
            ("RLIMIT_AS", memory_mb * 2**20),
            ("RLIMIT_FSIZE", max_output_bytes),
            ("RLIMIT_NOFILE", 64),
            ("RLIMIT_CORE", 0),
            ("RLIMIT_NPROC", nproc),
        ]
        guard = _GUARD % {"fork_ok": max_procs > 1, "limits": limits}
        out_path, err_path = os.path.join(scratch, "stdout"), os.path.join(scratch, "stderr")
        with (
            open(os.path.join(scratch, "stdin.txt")) as fin,
            open(out_path, "w") as fout,
            open(err_path, "w") as ferr,
        ):
            if root:
                for path in (out_path, err_path):
                    os.chown(path, NOBODY, NOBODY)
            proc = subprocess.Popen(
                [*_launcher(), sys.executable, "-I", "-B", "-c", guard],
                cwd=scratch,
                env=env,
                stdin=fin,
                stdout=fout,
                stderr=ferr,
                close_fds=True,
                start_new_session=True,  # its own process group: the whole tree is killed
            )
            timed_out = False
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc)
        stdout, out_cut = _read(out_path, max_output_bytes)
        stderr, err_cut = _read(err_path, max_output_bytes)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    code_ = proc.returncode
    return SandboxResult(
        stdout=stdout,
        stderr=stderr,
        exit_code=code_,
        timed_out=timed_out,
        error=_reason(
            code_, timed_out, stderr, out_cut or err_cut, timeout_s, memory_mb, max_output_bytes
        ),
        duration_s=time.monotonic() - started,
    )


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's process group (forked grandchildren included), reap
    the child, and repeat until no process of the group is left."""
    for _ in range(100):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            break
        if proc.poll() is None:
            proc.wait()
        time.sleep(0.002)
    proc.wait()


def _read(path: str, limit: int) -> tuple[str, bool]:
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError:
        return "", False
    return data[:limit].decode("utf-8", errors="replace"), len(data) >= limit


def _reason(
    exit_code: int | None,
    timed_out: bool,
    stderr: str,
    output_cut: bool,
    timeout_s: float,
    memory_mb: int,
    max_output_bytes: int,
) -> str:
    if timed_out:
        return f"wall time limit ({timeout_s:g}s)"
    if exit_code == -signal.SIGXCPU:
        return "CPU time limit"
    if exit_code == -signal.SIGXFSZ or output_cut:
        return f"output limit ({max_output_bytes} bytes)"
    if "MemoryError" in stderr:
        return f"memory limit ({memory_mb} MB)"
    if exit_code is not None and exit_code < 0:
        return f"killed by signal {-exit_code}"
    if exit_code:
        last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
        return f"exit status {exit_code}" + (f": {last[:200]}" if last else "")
    return ""
