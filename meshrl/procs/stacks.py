"""Every thread's Python stack of a hung proc, taken from outside it: each proc
registers `faulthandler` at its start (`install_stack_dump`, from
`meshrl.procs.proc_pool.setup_proc`), and `dump_and_kill` takes the stacks (py-spy
where installed, else that handler) and kills it. A leaf module: the procs' setup
imports it, and `python -m meshrl.procs.health dump PID` runs it on a node."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time

STACK_SIGNAL = signal.SIGUSR2
"""The signal on which a proc writes every thread's stack (`install_stack_dump`);
SIGUSR1 is forwarded by the fork server (`meshrl.procs.zygote`) and used by
SLURM's batch scripts."""
STACK_FILE = "meshrl-stacks"
"""The name of the memory file a proc writes its stacks into (`memfd_create`):
nothing on any filesystem, readable through /proc/PID/fd by its user only."""

_stack_fd: int | None = None


def install_stack_dump() -> None:
    """In a proc, at its start: every thread's Python stack written on `STACK_SIGNAL`
    into an anonymous memory file (faulthandler's handler runs in C inside the
    signal handler, so it answers while a thread holds the GIL in a deadlock; a
    stopped proc answers once it is continued). No file is left behind."""
    global _stack_fd
    import faulthandler

    if _stack_fd is not None or not hasattr(os, "memfd_create"):
        return
    _stack_fd = os.memfd_create(STACK_FILE, 0)
    faulthandler.register(STACK_SIGNAL, file=_stack_fd, all_threads=True, chain=False)


def _stack_fd_of(pid: int) -> str | None:
    """/proc/PID/fd/N of `pid`'s stack file, or None."""
    base = f"/proc/{pid}/fd"
    with contextlib.suppress(OSError):
        for name in os.listdir(base):
            with contextlib.suppress(OSError):
                if os.readlink(f"{base}/{name}").startswith(f"/memfd:{STACK_FILE}"):
                    return f"{base}/{name}"
    return None


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def dump_and_kill(pid: int, wait_s: float = 3.0) -> str:
    """Every thread's Python stack of process `pid` (on this host), then SIGKILL.
    py-spy where installed (it reads a stopped process's memory), else the proc's
    own faulthandler: `STACK_SIGNAL`, then SIGCONT (a stopped proc takes the
    signal as it continues), and its memory file read back. The stacks, or a line
    saying why there are none."""
    stacks = ""
    spy = shutil.which("py-spy")
    if spy:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            done = subprocess.run(
                [spy, "dump", "--pid", str(pid), "--nonblocking"],
                capture_output=True,
                text=True,
                timeout=15,
            )
            stacks = done.stdout.strip() if done.returncode == 0 else ""
    if not stacks:
        path = _stack_fd_of(pid)
        if path is None:
            stacks = f"(no stack file in process {pid}: not a meshrl proc, or gone)"
        else:
            before = len(_read(path))
            try:
                os.kill(pid, STACK_SIGNAL)
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                return f"(process {pid} is gone)"
            deadline, text = time.monotonic() + wait_s, ""
            while time.monotonic() < deadline:
                time.sleep(0.1)
                now = _read(path)[before:]
                if now and now == text:  # written, and no longer growing
                    break
                text = now
            stacks = text.strip() or f"(process {pid} wrote no stacks within {wait_s:g}s)"
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return stacks
