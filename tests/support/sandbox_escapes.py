"""Hostile programs against the sandbox, and the check that each was contained.

Standard library only: `tests/unit/test_sandbox.py` runs them as root, and copies
this file beside `meshrl/envs/sandbox.py` to run them again as the user nobody.
Every program tries each way out in turn and prints `ESCAPED <how>` for any
that worked; `contained` then looks at the world itself (the victim file, the
outside directory, the listener, the bystander process), not only at what the
program said.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

# Each program's body runs step by step: a step that raises is a step refused.
# First it switches off the audit hook of the sandbox before Landlock, whose
# lists were globals of `__main__` (so that each escape below tests what
# contains it beyond that hook).
_PRELUDE = """
import os, sys
import __main__ as g
g._BLOCKED = (); g._NO_IMPORT = set(); g._inside = lambda p: True; g._FORK_OK = True
def attempt(how, step):
    try:
        result = step()
    except BaseException as error:
        print("refused", how, type(error).__name__, str(error)[:80])
    else:
        print("ESCAPED", how, repr(result)[:200])
"""

ESCAPES = {
    # With the old hook's globals cleared (the prelude), its refusals went.
    "main_globals": """
attempt("write", lambda: open(VICTIM, "w").write("escaped"))
attempt("socket", lambda: __import__("socket").create_connection((HOST, PORT), 2))
attempt("subprocess", lambda: __import__("subprocess").run(["sh", "-c", f"echo x > {VICTIM}"]))
""",
    # The audit event carries no dir_fd: the check saw a relative name in scratch.
    "dir_fd": """
def opened():
    return os.open(OUTSIDE, os.O_PATH)
attempt("open", lambda: os.write(os.open("victim.txt", os.O_WRONLY | os.O_TRUNC,
                                        dir_fd=opened()), b"escaped"))
attempt("create", lambda: os.open("new.txt", os.O_WRONLY | os.O_CREAT, dir_fd=opened()))
attempt("mkdir", lambda: os.mkdir("newdir", dir_fd=opened()))
attempt("remove", lambda: os.remove("victim.txt", dir_fd=opened()))
attempt("rename", lambda: os.rename("victim.txt", "moved.txt", src_dir_fd=opened(),
                                    dst_dir_fd=opened()))
""",
    "links": """
attempt("symlink", lambda: (os.symlink(VICTIM, "s"), open("s", "w").write("escaped")))
attempt("hardlink", lambda: (os.link(VICTIM, "h"), open("h", "w").write("escaped")))
attempt("proc_fd", lambda: open(f"/proc/self/fd/{os.open(OUTSIDE, os.O_PATH)}/victim.txt",
                                "w").write("escaped"))
attempt("proc_root", lambda: open("/proc/self/root" + VICTIM, "w").write("escaped"))
attempt("proc_cwd", lambda: open(f"/proc/{os.getppid()}/cwd/escaped.txt", "w").write("x"))
""",
    "fork_exec": """
def forked():
    pid = os.fork()
    if pid == 0:
        try:
            os.execv("/bin/sh", ["sh", "-c", f"echo escaped > {VICTIM}"])
        finally:
            os._exit(3)
    return os.waitpid(pid, 0)[1] == 0 or None
attempt("fork+exec", lambda: forked() or 1 / 0)
attempt("posix_spawn", lambda: os.waitpid(os.posix_spawn(
    "/bin/sh", ["sh", "-c", f"echo escaped > {VICTIM}"], {}), 0)[1] == 0 or 1 / 0)
def fork_write():
    pid = os.fork()
    if pid == 0:
        try:
            open(VICTIM, "w").write("escaped")
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    return 1 / 0  # the victim file tells whether the child got out
attempt("fork+write", fork_write)
""",
    "ctypes_syscall": """
import struct
SYS = {"x86_64": {"socket": 41, "connect": 42, "openat": 257, "kill": 62},
       "aarch64": {"socket": 198, "connect": 203, "openat": 56, "kill": 129}}[os.uname().machine]
def libc():
    import ctypes
    lib = ctypes.CDLL(None, use_errno=True)
    return lib
def check(value):
    if value < 0:
        raise OSError(__import__("ctypes").get_errno(), "refused")
    return value
def connect():
    lib = libc()
    fd = check(lib.syscall(SYS["socket"], 2, 1, 0))
    address = struct.pack("!HH4s8x", 2, PORT, __import__("socket").inet_aton(HOST))
    address = address[:2][::-1] + address[2:]  # sin_family is host order
    return check(lib.syscall(SYS["connect"], fd, address, len(address)))
attempt("socket", connect)
attempt("openat", lambda: check(libc().syscall(SYS["openat"], -100, VICTIM.encode(),
                                               os.O_WRONLY | os.O_TRUNC)))
attempt("kill", lambda: check(libc().syscall(SYS["kill"], BYSTANDER, 9)))
""",
    "read_parent": """
attempt("secret", lambda: open(SECRET).read())
attempt("listdir", lambda: os.listdir(OUTSIDE))
attempt("parent_environ", lambda: open(f"/proc/{os.getppid()}/environ").read() or 1 / 0)
attempt("init_environ", lambda: open("/proc/1/environ").read() or 1 / 0)
attempt("bystander_environ", lambda: open(f"/proc/{BYSTANDER}/environ").read() or 1 / 0)
attempt("self_mem", lambda: open("/proc/self/mem", "rb").read(1))
attempt("env", lambda: os.environ["MESHRL_SANDBOX_SECRET"])
attempt("passwd", lambda: open("/etc/passwd").read())
""",
    "network": """
import socket
attempt("tcp", lambda: socket.create_connection((HOST, PORT), timeout=2))
attempt("udp", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(
    b"x", (HOST, PORT)))
attempt("unix", lambda: socket.socket(socket.AF_UNIX).connect(UNIX))
""",
    "signals": """
import signal
attempt("kill", lambda: os.kill(BYSTANDER, signal.SIGKILL))
attempt("killpg", lambda: os.killpg(os.getpgid(BYSTANDER), signal.SIGKILL))
""",
    # A file the program may read and its user owns (a task input, the venv):
    # metadata changed through a descriptor, which Landlock does not cover.
    "metadata_by_fd": """
attempt("fchmod", lambda: os.chmod(os.open(OWNED, os.O_RDONLY), 0o777))
attempt("fchown", lambda: os.chown(os.open(OWNED, os.O_RDONLY), 65534, 65534))
attempt("fsetxattr", lambda: os.setxattr(os.open(OWNED, os.O_RDONLY), "user.meshrl", b"x"))
""",
    # Another process of the same user, reached by its number.
    "processes": """
import resource
attempt("prlimit", lambda: resource.prlimit(BYSTANDER, resource.RLIMIT_NOFILE, (3, 3)))
attempt("setpriority", lambda: os.setpriority(os.PRIO_PROCESS, BYSTANDER, 19))
attempt("affinity", lambda: os.sched_setaffinity(BYSTANDER, {0}))
attempt("sched", lambda: os.sched_setscheduler(BYSTANDER, os.SCHED_IDLE, os.sched_param(0)))
""",
}


# The kernel's mechanisms alone (no audit hook), and without namespaces as well
# (an unprivileged user where user namespaces are off, as on Ubuntu 24.04).
MODES = {
    "everything": frozenset(),
    "kernel_only": frozenset({"audit_hook"}),
    "landlock_and_seccomp": frozenset({"audit_hook", "namespaces"}),
    # ... and a Landlock that cannot scope signals (kernels before 6.12).
    "landlock_v5_and_seccomp": frozenset({"audit_hook", "namespaces", "landlock_scopes"}),
}


@dataclass
class World:
    """What the programs try to reach: a world-writable directory outside the
    scratch (so that only the sandbox, not file permissions, stops a write), a
    secret file in it, a listener on a loopback address of its own and a bystander process."""

    outside: str
    victim: str
    secret: str
    secret_text: str
    listener: socket.socket
    datagrams: socket.socket
    unix: socket.socket
    bystander: subprocess.Popen
    owned: str
    """A file of the caller's that programs may read (`read_paths`)."""

    def state(self) -> tuple:
        """The owned file's metadata and the bystander's settings, as the host sees them."""
        info = os.stat(self.owned)
        pid = self.bystander.pid
        return (
            info.st_mode,
            info.st_uid,
            info.st_gid,
            os.listxattr(self.owned),
            Path(f"/proc/{pid}/limits").read_text(),  # prlimit needs CAP_SYS_RESOURCE
            os.getpriority(os.PRIO_PROCESS, pid),
            os.sched_getaffinity(pid),
            os.sched_getscheduler(pid),
        )

    @classmethod
    def make(cls) -> World:
        outside = tempfile.mkdtemp(prefix="meshrl-outside-")
        os.chmod(outside, 0o777)
        victim, secret = os.path.join(outside, "victim.txt"), os.path.join(outside, "secret.txt")
        secret_text = f"SECRET-{uuid.uuid4().hex}"
        for path, text in ((victim, "original"), (secret, secret_text)):
            with open(path, "w") as f:
                f.write(text)
            os.chmod(path, 0o666)
        # Not 127.0.0.1: other tests' processes dial ports there that were free a moment
        # ago (a rendezvous, a channel), and a stray connection would read as a breach.
        # The whole of 127/8 is this host's loopback; nothing else dials this address.
        host = "127." + ".".join(str(b) for b in uuid.uuid4().bytes[:3])
        host = host if host != "127.0.0.1" else "127.0.0.2"
        listener = socket.socket()
        listener.bind((host, 0))
        listener.listen()
        listener.setblocking(False)  # a connection made is queued before the program exits
        datagrams = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        datagrams.bind((host, listener.getsockname()[1]))
        datagrams.setblocking(False)
        unix = socket.socket(socket.AF_UNIX)
        unix.bind(f"\0meshrl-escape-{uuid.uuid4().hex}")
        unix.listen()
        unix.setblocking(False)
        # As root, the bystander runs as nobody: the uid the old sandbox ran programs as.
        drop = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        bystander = subprocess.Popen(
            [*(drop if os.geteuid() == 0 else []), "sleep", "120"], start_new_session=True
        )
        owned = os.path.join(tempfile.mkdtemp(prefix="meshrl-owned-"), "input.txt")
        with open(owned, "w") as f:
            f.write("a task input")
        os.chmod(owned, 0o644)
        os.chmod(os.path.dirname(owned), 0o755)
        world = cls(
            outside, victim, secret, secret_text, listener, datagrams, unix, bystander, owned
        )
        world.before = world.state()
        return world

    def program(self, name: str) -> str:
        constants = (
            f"VICTIM = {self.victim!r}\nOUTSIDE = {self.outside!r}\nSECRET = {self.secret!r}\n"
            f"HOST, PORT = {self.listener.getsockname()!r}\nBYSTANDER = {self.bystander.pid}\n"
            f"UNIX = {self.unix.getsockname()!r}\nOWNED = {self.owned!r}\n"
        )
        return constants + _PRELUDE + ESCAPES[name]

    def breaches(self, stdout: str) -> list[str]:
        """What got out, judged from the world (and the program's own report)."""
        found = [line for line in stdout.splitlines() if line.startswith("ESCAPED")]
        try:
            with open(self.victim) as f:
                if f.read() != "original":
                    found.append("the victim file changed")
        except FileNotFoundError:
            found.append("the victim file is gone")
        if sorted(os.listdir(self.outside)) != ["secret.txt", "victim.txt"]:
            found.append(f"the outside directory changed: {sorted(os.listdir(self.outside))}")
        if self.secret_text in stdout:
            found.append("the secret was read")
        if self.bystander.poll() is not None:
            found.append("the bystander process died")
        elif self.state() != self.before:
            found.append(
                f"the owned file or the bystander changed: {self.before} -> {self.state()}"
            )
        servers = (
            (self.listener, "a connection"),
            (self.datagrams, "a datagram"),
            (self.unix, "a unix connection"),
        )
        for server, what in servers:
            try:
                server.recv(1) if server is self.datagrams else server.accept()[0].close()
                found.append(f"{what} reached the listener")
            except BlockingIOError:
                pass
        return found

    def close(self) -> None:
        for server in (self.listener, self.datagrams, self.unix):
            server.close()
        with contextlib.suppress(ProcessLookupError):  # a breach killed it
            os.killpg(self.bystander.pid, signal.SIGKILL)
        self.bystander.wait()
        shutil.rmtree(self.outside)
        shutil.rmtree(os.path.dirname(self.owned))


_FIRST = """
import os, time
open("mine.txt", "w").write(SECRET)
deadline = time.monotonic() + 4
while not os.path.exists("done") and time.monotonic() < deadline:
    time.sleep(0.02)  # the host writes `done` here when the second run is over
print(sorted(os.listdir(".")), open("mine.txt").read() == SECRET)
"""

_SECOND = (
    _PRELUDE
    + """
import signal
attempt("read", lambda: open(os.path.join(OTHER, "mine.txt")).read())
attempt("listdir", lambda: os.listdir(OTHER))
attempt("write", lambda: open(os.path.join(OTHER, "evil.txt"), "w").write("x"))
attempt("remove", lambda: os.remove(os.path.join(OTHER, "mine.txt")))
attempt("chmod", lambda: os.chmod(OTHER, 0))
attempt("kill", lambda: os.kill(OTHER_PID, signal.SIGKILL))
"""
)


def _scratch_of(secret: str, timeout_s: float = 10.0) -> tuple[str, int]:
    """The scratch directory holding `secret` and the pid of the program running
    in it, as the host sees them (through /proc/PID/cwd: where the run has a
    mount namespace, its files lie in a tmpfs only it sees)."""
    deadline = time.monotonic() + timeout_s
    prefix = os.path.join(tempfile.gettempdir(), "meshrl-sandbox-")
    while time.monotonic() < deadline:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if not os.readlink(f"/proc/{pid}/cwd").startswith(prefix):
                    continue
                with open(f"/proc/{pid}/cwd/mine.txt") as f:
                    if f.read() == secret:
                        return os.readlink(f"/proc/{pid}/cwd"), int(pid)
            except OSError:
                continue
        time.sleep(0.05)
    raise TimeoutError("the first sandbox never wrote its file")


def cross_run(run_python, **kwargs) -> list[str]:
    """Two runs at once: the second tries to read, write, remove, chmod and kill
    what belongs to the first. Returns the breaches."""
    secret = f"SECRET-{uuid.uuid4().hex}"
    first: dict = {}
    thread = threading.Thread(
        target=lambda: first.update(result=run_python(f"SECRET = {secret!r}\n" + _FIRST, **kwargs))
    )
    thread.start()
    try:
        other, pid = _scratch_of(secret)
        second = run_python(f"OTHER = {other!r}\nOTHER_PID = {pid}\n" + _SECOND, **kwargs)
        with open(f"/proc/{pid}/cwd/done", "w"):
            pass
    finally:
        thread.join()
    found = [line for line in second.stdout.splitlines() if line.startswith("ESCAPED")]
    result = first["result"]
    if secret in second.stdout:
        found.append("the second run read the first's file")
    listing = "['done', 'main.py', 'mine.txt'] True"
    if result.stdout.strip() != listing:
        found.append(f"the first run's files changed or it died: {result.stdout!r} {result.error}")
    return found


def run_escapes(run_python, isolation) -> dict[str, list[str]]:
    """Every program of ESCAPES in a world of its own: what got out of each (a
    program that died before its attempts, other than by a `sandbox:` refusal,
    counts too: it tested nothing)."""
    found = {}
    for name in ESCAPES:
        world = World.make()
        try:
            result = run_python(world.program(name), isolation=isolation, read_paths=(world.owned,))
            found[name] = world.breaches(result.stdout)
            if "Traceback" in result.stderr and "sandbox: " not in result.stderr:
                found[name].append(f"the program failed: {result.stderr.strip()[-300:]}")
        finally:
            world.close()
    return found
