"""Run model-written Python where it cannot hurt the host: `run_python`.

Each call starts a fresh interpreter in its own process group and returns a
`SandboxResult`; hostile code gets a result (a reason in `error`), never a hang
or a crash of the caller. What contains it is what the kernel enforces
(`sandbox_child` applies it in the child before the program's first line):

- **Files (Landlock).** Reads only of an allow-list: the Python install, the
  system libraries, and the task's inputs (`read_paths`). Writes, creations,
  removals, renames and links only inside the run's own scratch directory
  (also its working directory, HOME and TMPDIR, removed afterwards). Nothing
  may be executed: no other program starts.
- **Output.** stdin, stdout and stderr are files no path leads to (memfd),
  opened by the parent before the run and read back through its own
  descriptors: nothing the program puts in its directory (a FIFO, a symlink)
  is ever opened by the parent.
- **Network.** A seccomp filter refuses every socket (any family) and
  io_uring; Landlock refuses TCP bind and connect; where the kernel allows,
  the run also has its own network namespace (no device but loopback).
- **Other processes.** A PID namespace where allowed (everything the program
  forks dies with the run); Landlock refuses signals and ptrace across the
  domain's edge; seccomp refuses ptrace, process_vm_*, mounts and namespaces.
  Without a PID namespace, seccomp refuses setsid and setpgid (the wall limit
  kills the process group, which nothing can leave), and where the program
  keeps the caller's uid, prlimit64, sched_setaffinity, sched_setscheduler,
  sched_setparam, sched_setattr, migrate_pages and move_pages unless aimed at
  pid 0 or the program's first process (its pid at the filter's making: a
  forked child cannot name itself by number), setpriority and ioprio_set
  except for one such process (not a group or the user); where Landlock cannot
  scope signals (ABI < 6) also kill (allowed: 0, its own pid, its own group),
  tkill, tgkill, rt_(tg)sigqueueinfo (its own pid only) and pidfd_send_signal.
- **Users.** As root, each run gets a uid of its own (no two concurrent runs
  share one, so file permissions separate them too). Otherwise the program
  keeps the caller's uid, and seccomp also refuses chmod, chown, utime and
  xattr changes, by path and by descriptor (fchmod, fchown, fsetxattr,
  fremovexattr, the *at forms), which Landlock does not cover.
- **Scratch.** With a mount namespace (the same launcher), the scratch is a
  tmpfs of `scratch_mb` and `scratch_files` inodes (the program meets ENOSPC).
  Without one, the parent measures it every `WATCH_S` (and once at the end)
  and stops the run past either bound ("scratch limit"); a program may then
  overshoot by what it writes in one interval (each file at most
  `max_output_bytes`, the file size limit).
- **Limits** (setrlimit): CPU time, address space (`memory_mb`), file size
  (`max_output_bytes`: output and files alike), open files, processes; the
  wall limit kills the process group (and with it the PID namespace).
- **Environment.** PATH, HOME, TMPDIR and LANG only; `python -I` ignores
  PYTHON* variables and the user's site directory.

`probe()` finds what this kernel and user allow; each result's `isolation`
names what was in force. Without the minimum (Landlock for files; a network
namespace or seccomp for the network) `run_python` refuses to run unless the
process opted into weak isolation (`configure(allow_weak=True)`, the config's
`sandbox.allow_weak`). An audit hook adds readable `sandbox: ...` errors; it
is a convenience, not the boundary. Kernel exploits are out of scope: run
untrusted code at scale in a VM as well.
"""

from __future__ import annotations

import functools
import itertools
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from meshrl.envs.sandbox_probe import (  # noqa: F401 - the sandbox's API, re-exported
    _UID_BASE,
    HOW_TO,
    NAMESPACES,
    Isolation,
    SandboxUnavailable,
    probe,
)

SETUP_FAILED = 111
SCRATCH_MB = 64  # what one program's scratch directory may hold
SCRATCH_FILES = 4096
WATCH_S = 0.05  # how often the scratch is measured where no tmpfs bounds it  # sandbox_child's exit status when a mechanism fails to apply
_uids = itertools.count()
_uids_lock = threading.Lock()
# Read-only everywhere the interpreter and its libraries may live.
SYSTEM_READ = (
    "/usr",
    "/lib",
    "/lib64",
    "/etc/ld.so.cache",
    "/etc/localtime",
    "/dev/null",
    "/dev/zero",
    "/dev/random",
    "/dev/urandom",
)


@dataclass
class SandboxConfig:
    """The `sandbox:` section: how programs run (code task, python tool)."""

    allow_weak: bool = False
    """Run programs even where the kernel lacks the minimum isolation (Landlock
    for files; a network namespace or seccomp for the network), with a warning
    each run. Off: such a machine refuses to start the task, naming what is
    missing."""
    memory_mb: int = 512
    """Address-space limit of one program."""
    max_procs: int = 8
    """Processes one program may run at once (itself included)."""

    def validate(self) -> None:
        from meshrl.config.files import ConfigError

        for key, ok, need in (
            ("memory_mb", self.memory_mb >= 64, ">= 64"),
            ("max_procs", self.max_procs >= 1, ">= 1"),
        ):
            if not ok:
                raise ConfigError(f"config key 'sandbox.{key}': must be {need}")

    def check_task(self, task_name: str) -> None:
        """A task that runs programs (`Env.sandboxed`) needs the minimum
        isolation here, or `allow_weak`: else one ConfigError line, before any
        process is spawned. The environment procs check again on their hosts."""
        from meshrl.config.files import ConfigError
        from meshrl.envs import env_class

        try:
            sandboxed = getattr(env_class(task_name), "sandboxed", False)
        except (ImportError, AttributeError, KeyError):
            return  # task.name's own check names the problem
        if sandboxed:
            try:
                require(self.allow_weak)
            except SandboxUnavailable as error:
                raise ConfigError(f"task '{task_name}': {error}") from None


_policy = SandboxConfig()
_warned = False


def configure(cfg: SandboxConfig, task_name: str = "") -> None:
    """Set this process's sandbox policy (the environment procs do, from the
    config); with the task's name, refuse now if it runs programs and this host
    cannot isolate them."""
    global _policy, _warned
    _policy, _warned = cfg, False
    if task_name:
        cfg.check_task(task_name)


def require(allow_weak: bool | None = None) -> Isolation:
    """This machine's isolation, or `SandboxUnavailable` (one line naming what is
    missing and how to enable it) when it lacks the minimum and weak isolation
    is not allowed. Allowed, it prints a warning."""
    isolation = probe()
    allow_weak = _policy.allow_weak if allow_weak is None else allow_weak
    if isolation.missing:
        what = "; ".join(f"{name}: needs {HOW_TO[name]}" for name in isolation.missing)
        if not allow_weak:
            raise SandboxUnavailable(
                f"sandbox: this machine cannot isolate programs ({what}); "
                "set sandbox.allow_weak=true to run them anyway"
            )
        global _warned
        if not _warned:  # once per run: `configure` (each run's start) resets it
            print(f"WARNING sandbox: weak isolation, programs run without {what}", file=sys.stderr)
            _warned = True
    return isolation


@functools.cache
def _child_source() -> str:
    return Path(__file__).with_name("sandbox_child.py").read_text()


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
    isolation: tuple[str, ...] = ()
    """The mechanisms in force for this run (`Isolation.in_force`)."""

    @property
    def ok(self) -> bool:
        return not self.error


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


def _child_spec(
    isolation: Isolation,
    uid: int | None,
    timeout_s: float,
    memory_mb: int,
    max_output_bytes: int,
    max_procs: int,
    scratch_mb: int,
    scratch_files: int,
) -> dict:
    """The settings `sandbox_child` applies before the program."""
    # A uid of its own counts only the program's processes; a shared one counts
    # every process of the user: allow this many more.
    nproc = max_procs if uid is not None else _user_procs(os.getuid()) + max_procs
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
    namespaces = bool(isolation.launcher)
    return {
        "uid": uid,
        "limits": limits,
        "seccomp": isolation.seccomp,
        "shared_uid": uid is None,
        "pidns": namespaces,
        "userns": namespaces and os.geteuid() != 0,
        # The tmpfs holds the program's files and its main.py (one inode more,
        # and the root directory's).
        "scratch": {"bytes": scratch_mb * 2**20, "inodes": scratch_files + 2}
        if namespaces
        else None,
        "landlock": isolation.landlock_abi,
        "read": [*isolation.python_paths, *SYSTEM_READ],
        "audit": isolation.audit_hook,
        "fork_ok": max_procs > 1,
    }


def _anonymous(name: str, data: bytes = b"") -> int:
    """A descriptor of a file no path leads to (the program's stdin, stdout,
    stderr): what the parent reads back is what was written to it, whatever the
    program does to its directory."""
    try:
        fd = os.memfd_create(f"meshrl-sandbox-{name}", os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        with tempfile.TemporaryFile() as f:
            fd = os.dup(f.fileno())
    if data:
        os.write(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
    return fd


def run_python(
    code: str,
    stdin: str = "",
    timeout_s: float = 5.0,
    memory_mb: int | None = None,
    max_output_bytes: int = 65536,
    max_procs: int | None = None,
    read_paths: tuple[str, ...] = (),
    isolation: Isolation | None = None,
    scratch_mb: int = SCRATCH_MB,
    scratch_files: int = SCRATCH_FILES,
) -> SandboxResult:
    """Run `code` with `stdin` in a fresh sandboxed interpreter (see the module
    docstring). `read_paths`: files or directories the program may read (the
    task's inputs). `max_procs` > 1 lets it fork. `scratch_mb`, `scratch_files`:
    what its scratch directory may hold. `isolation` defaults to `require()`:
    everything this machine allows."""
    isolation = isolation or require()
    memory_mb = memory_mb or _policy.memory_mb
    max_procs = max_procs or _policy.max_procs
    started = time.monotonic()
    scratch = tempfile.mkdtemp(prefix="meshrl-sandbox-")
    uid = None
    if isolation.run_uid:
        with _uids_lock:
            uid = _UID_BASE + (os.getpid() % 4096) * 4096 + next(_uids) % 4096
    fds: list[int] = []
    try:
        with open(os.path.join(scratch, "main.py"), "w") as f:
            f.write(code)
        if uid is not None:
            os.chown(os.path.join(scratch, "main.py"), uid, uid)
            os.chown(scratch, uid, uid)
        spec = _child_spec(
            isolation,
            uid,
            timeout_s,
            memory_mb,
            max_output_bytes,
            max_procs,
            scratch_mb,
            scratch_files,
        )
        spec["read"] += [os.path.realpath(path) for path in read_paths]
        env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8"}
        fds += [_anonymous("stdin", stdin.encode()), _anonymous("stdout"), _anonymous("stderr")]
        fin, fout, ferr = fds
        proc = subprocess.Popen(
            [
                *isolation.launcher,
                isolation.python,
                "-I",
                "-B",
                "-c",
                f"SPEC = {spec!r}\n{_child_source()}",
            ],
            cwd=scratch,
            env=env,
            stdin=fin,
            stdout=fout,
            stderr=ferr,
            close_fds=True,
            start_new_session=True,  # its own process group: the whole tree is killed
        )
        # Without the tmpfs (no mount namespace), the parent measures the scratch.
        watch = None if spec["scratch"] else _scratch_watch(scratch, scratch_mb, scratch_files)
        try:
            timed_out, over = _wait(proc, timeout_s, watch)
        finally:
            _kill_group(proc)
        if watch and not over:  # also what a program left that exited before a check
            over = watch()
        stdout, out_cut = _read(fout, max_output_bytes)
        stderr, err_cut = _read(ferr, max_output_bytes)
    finally:
        for fd in fds:
            os.close(fd)
        shutil.rmtree(scratch, ignore_errors=True)
    code_ = proc.returncode
    return SandboxResult(
        stdout=stdout,
        stderr=stderr,
        exit_code=code_,
        timed_out=timed_out,
        error=over
        or _reason(
            code_, timed_out, stderr, out_cut or err_cut, timeout_s, memory_mb, max_output_bytes
        ),
        duration_s=time.monotonic() - started,
        isolation=isolation.in_force,
    )


def _scratch_watch(scratch: str, scratch_mb: int, scratch_files: int):
    """A check of the scratch directory's bytes and entries, for where no tmpfs
    bounds them: the reason to stop the run, or ''. It stops counting past the
    limit, so a directory of a million files costs no more than one of the limit."""
    limit = scratch_mb * 2**20
    reason = f"scratch limit ({scratch_mb} MB, {scratch_files} files)"

    def check() -> str:
        count, used, folders = 0, 0, [scratch]
        while folders:
            try:
                entries = os.scandir(folders.pop())
            except OSError:
                return reason + ": a directory the sandbox cannot list"
            with entries:
                for entry in entries:
                    count += 1
                    try:
                        info = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    used += info.st_blocks * 512
                    if count > scratch_files + 1 or used > limit:  # main.py is one
                        return reason
                    if entry.is_dir(follow_symlinks=False):
                        folders.append(entry.path)
        return ""

    return check


def _wait(proc: subprocess.Popen, timeout_s: float, watch=None) -> tuple[bool, str]:
    """Wait for the child's exit: (True when `timeout_s` passed first, the
    reason `watch` gave to stop it early or ''). A pidfd wakes the moment it
    exits: `Popen.wait(timeout)` polls with sleeps that grow to 50 ms, which was
    most of a trivial program's latency. `watch` runs every `WATCH_S`."""
    deadline = time.monotonic() + timeout_s
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        fd = None
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return True, ""
            step = min(left, WATCH_S) if watch else left
            if fd is None:
                try:
                    proc.wait(timeout=step)
                    return False, ""
                except subprocess.TimeoutExpired:
                    pass
            else:
                poller = select.poll()
                poller.register(fd, select.POLLIN)
                if poller.poll(step * 1000):
                    proc.wait()
                    return False, ""
            if watch and (reason := watch()):
                return False, reason
    finally:
        if fd is not None:
            os.close(fd)


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


def _read(fd: int, limit: int) -> tuple[str, bool]:
    """What was written to the parent's own descriptor `fd` (never reopened by
    path: the program may have replaced anything in its directory)."""
    data = os.pread(fd, limit + 1, 0)
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
    if exit_code == SETUP_FAILED and "sandbox: could not apply" in stderr:
        return stderr.strip().splitlines()[-1]
    if exit_code is not None and exit_code < 0:
        return f"killed by signal {-exit_code}"
    if exit_code:
        last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
        return f"exit status {exit_code}" + (f": {last[:200]}" if last else "")
    return ""
