"""A fork server for the procs of local runs: each proc starts with torch and
transformers already imported.

A Monarch proc is a fresh `python -m monarch._src.actor.bootstrap_main`; before
its first actor runs it spends about 7 s of CPU importing torch, transformers
and meshrl's modelling code. A run with six procs pays that six times, a
respawn after a lost proc pays it again, and a test suite pays it hundreds of
times. Here one server process imports them once; every local proc is then a
`fork()` of it, which takes a fraction of a second.

Monarch still spawns and supervises each proc's process as it always does,
through a `BootstrapCommand` (`command()`): that process is this file's small
client (stdlib only, `python -S`). It hands its environment, working directory
and open file descriptors to the server over a Unix socket, the server forks a
child that takes them over and runs Monarch's proc main, and the client stands
in for the child until it ends:

- signals sent to the client (Monarch's stop) are passed on to the child;
- the child's exit status becomes the client's (a child killed by SIGKILL ends
  its client by SIGKILL), so Monarch sees the proc end as it ended;
- a client killed outright drops its socket; the child sees that and ends
  itself, so no proc outlives the process Monarch knows.

What is forked holds no threads of Monarch's runtime (the server never imports
Monarch: its Rust runtime starts threads at import, and a fork keeps only the
forking thread) and has run no torch op, so CUDA and the OpenMP pools start in
the child, with the child's environment. The socket lives in a directory only
this user can enter (mode 0700) and the server refuses a peer of another uid.
The client, before it sends anything, checks the same from its side: the
socket's directory is this user's with mode 0700, and the process listening
runs as this user (`SO_PEERCRED`); a socket another user set up (named by
`MESHRL_FORK_SERVER`, say) gets neither the environment nor the descriptors.

This file runs as a script (`python zygote.py serve|connect ...`) and imports
nothing outside the standard library at its top, so the client starts in a
few milliseconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import struct
import sys

BOOTSTRAP_MAIN = "monarch._src.actor.bootstrap_main"
PRELOAD = (
    "torch",
    "meshrl.model.models",
    "meshrl.procs.proc_pool",
    # What building the embedded model imports on first use (transformers loads each
    # architecture lazily): ~0.1 s less in every proc that holds a model.
    "transformers.models.llama.modeling_llama",
)
"""What the server imports before it forks (never Monarch: see the module doc)."""
PROC_COMM = "meshrl@"
"""How the process name (`/proc/PID/comm`) of a forked proc starts: `meshrl@` and the
pid of its stand-in (`proc_pool.monarch_pids`). Forked by the server, the proc is not a
descendant of the process that started it; its name says through which stand-in it is."""
RUN_COMM = "meshrl-run"
"""The process name of a forked `python -m` (`python_m`): not a proc."""
STAND_IN_ENV = "MESHRL_PROC_STAND_IN"
"""Set in a fork: the pid of its stand-in (for a proc, the process Monarch spawned)."""
MAX_FDS = 250
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)


def _send(conn: socket.socket, message: dict, fds: list[int] = ()) -> None:
    data = json.dumps(message).encode() + b"\n"
    if fds:
        socket.send_fds(conn, [data], list(fds))
    else:
        conn.sendall(data)


def _recv_line(conn: socket.socket, buffer: bytearray) -> dict | None:
    """The next JSON line from `conn`, or None at its end."""
    while b"\n" not in buffer:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        buffer.extend(chunk)
    line, _, rest = bytes(buffer).partition(b"\n")
    buffer[:] = rest
    return json.loads(line)


# --- client -----------------------------------------------------------------


def _open_fds(skip: int) -> list[int]:
    fds = []
    for entry in os.listdir("/proc/self/fd"):
        fd = int(entry)
        if fd == skip:
            continue
        try:
            os.fstat(fd)  # the listing's own descriptor is gone by now
        except OSError:
            continue
        fds.append(fd)
    return sorted(fds)


class UntrustedServer(RuntimeError):
    """The socket named as a fork server is not this user's alone."""


def _refusal(path: str, why: str) -> str:
    named = os.environ.get(SHARED_ENV)
    where = f"{SHARED_ENV}={named}" if named else f"{SHARED_ENV} unset, this run's own"
    return (
        f"meshrl: refusing the fork server at {path} ({where}): {why}; nothing was sent "
        f"(unset {SHARED_ENV}, or set job.fork_server=false)"
    )


def _check_folder(path: str) -> None:
    """The socket's directory must be this user's with no group or other bits
    (as `ForkServer.start` makes it): no one else can have put a socket there."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        info = os.stat(folder)
    except OSError as error:
        raise UntrustedServer(_refusal(path, f"its directory {folder}: {error.strerror}")) from None
    if info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise UntrustedServer(
            _refusal(
                path,
                f"its directory {folder} is owned by uid {info.st_uid} with mode "
                f"{info.st_mode & 0o777:04o}, not this user's (uid {os.geteuid()}) with mode 0700",
            )
        )


def _check_peer(conn: socket.socket, path: str) -> None:
    """The process listening at the other end must run as this user (SO_PEERCRED)."""
    uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
    if uid != os.geteuid():
        raise UntrustedServer(
            _refusal(path, f"it is served by uid {uid}, not this user (uid {os.geteuid()})")
        )


def open_checked(path: str) -> socket.socket:
    """A connection to the fork server at `path`, made only if its directory is
    this user's alone and the process listening runs as this user; else
    `UntrustedServer`, with nothing sent."""
    _check_folder(path)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        _check_peer(conn, path)
    except BaseException:
        conn.close()
        raise
    return conn


def connect(path: str, argv: list[str], module: str = BOOTSTRAP_MAIN) -> None:
    """Stand in for a forked proc (or, with `module`, a forked `python -m module`):
    hand this process's environment and file descriptors to the server at `path`,
    then pass signals on and exit as the fork exits. Nothing is sent to a server
    that is not this user's alone (`open_checked`): one line says why, exit 1."""
    try:
        conn = open_checked(path)
    except UntrustedServer as refused:
        sys.stderr.write(f"{refused}\n")
        sys.stderr.flush()
        os._exit(1)
    fds = _open_fds(conn.fileno())[:MAX_FDS]
    request = {
        "module": module,
        "argv": argv,
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "pid": os.getpid(),
        # Ignored signals stay ignored in a fresh Python (a background shell's SIGINT).
        "ignored": [int(s) for s in FORWARDED if signal.getsignal(s) == signal.SIG_IGN],
        "fds": fds,
        "inheritable": [os.get_inheritable(fd) for fd in fds],
    }
    _send(conn, request, fds)
    # The child holds them now; a pipe whose other end waits for EOF must not
    # stay open here. (0-2 are kept for a message of our own.)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    buffer = bytearray()
    reply = _recv_line(conn, buffer)
    if reply is None or "pid" not in reply:
        sys.stderr.write(f"meshrl fork server at {path} refused the proc: {reply}\n")
        os._exit(1)
    child = reply["pid"]

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    reply = _recv_line(conn, buffer)  # (a forwarded signal does not interrupt it: PEP 475)
    if reply is None:  # the server went away: the child ends with no status
        os._exit(1)
    status = reply["status"]
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        if signum != signal.SIGKILL:  # (whose handler cannot be set)
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


# --- server -----------------------------------------------------------------


def _name_process(name: str) -> None:
    """Set this process's name (`/proc/PID/comm`, what `ps -o comm` shows)."""
    import ctypes

    PR_SET_NAME = 15
    ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def _child(
    conn: socket.socket,
    listener: socket.socket,
    others: list[socket.socket],
    request: dict,
    fds: list[int],
) -> None:
    """In the forked child: become the proc the client was started as."""
    import fcntl
    import resource

    listener.close()
    # The server's sockets to its other children: their numbers are closed below and
    # then reused (by Monarch's runtime, say); an object still holding one would
    # close that descriptor when the interpreter exits and collects it.
    for other in others:
        other.detach()
    # Where the child parks descriptors while it takes the client's numbers.
    HIGH_FD = max(
        resource.getrlimit(resource.RLIMIT_NOFILE)[0] - MAX_FDS - 8,
        1 + max(request["fds"], default=2),
    )
    for signum in FORWARDED:  # as a fresh Python started by the client would have them
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in request.get("ignored", ()):
        signal.signal(signum, signal.SIG_IGN)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    # Its own process group: a terminal's Ctrl-C reaches it once, through its
    # stand-in (which is in the terminal's group, as a proc would be).
    os.setpgid(0, 0)
    # Move what we hold out of the way, drop the server's own descriptors, then
    # take the client's at their numbers.
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, HIGH_FD) for fd in fds]
    watch_fd = fcntl.fcntl(conn.fileno(), fcntl.F_DUPFD_CLOEXEC, HIGH_FD)
    conn.close()
    os.closerange(0, HIGH_FD)
    for target, inheritable, fd in zip(request["fds"], request["inheritable"], high, strict=True):
        os.dup2(fd, target, inheritable=inheritable)
        os.close(fd)
    watch = socket.socket(fileno=watch_fd)
    module = request.get("module", BOOTSTRAP_MAIN)
    _name_process(f"{PROC_COMM}{request['pid']}" if module == BOOTSTRAP_MAIN else RUN_COMM)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ[STAND_IN_ENV] = str(request["pid"])
    sys.argv = list(request["argv"])
    sys.path[0] = request["cwd"]  # as `python -m` puts it
    # What a fresh interpreter takes from its environment at start.
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[1:1] = [p for p in extra if p not in sys.path]
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdout.reconfigure(line_buffering=unbuffered or os.isatty(1), write_through=unbuffered)
    if "numpy" in sys.modules:  # (seeded from the OS at import: once, in the server)
        sys.modules["numpy"].random.seed()
    # The client's end closes when it dies: then so does this proc.
    import threading

    def watch_client() -> None:
        try:
            while watch.recv(4096):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch_client, name="meshrl-zygote-watch", daemon=True).start()
    if module == BOOTSTRAP_MAIN and os.environ.get("MESHRL_CHANNEL_DIR"):
        # A server started before the run's socket hook was preloaded (one shared by
        # runs): Monarch's channels in this proc go private as its controller's do.
        from meshrl.procs import channels

        channels.hook_process()
    code = run_module(module)  # what `python -m monarch._src.actor.bootstrap_main` runs
    if module != BOOTSTRAP_MAIN:  # a forked `python -m`: the interpreter's own exit
        sys.exit(code)
    fast_exit(code)


def run_module(module: str) -> object:
    """Run `module` as `python -m module` does; the code it exits with."""
    import runpy

    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as done:
        return done.code
    return 0


def fast_exit(code: object) -> None:
    """End a proc whose work is done (Monarch's proc main has returned): run the
    exit hooks and flush every open file as the interpreter's exit would, then skip
    its teardown of the ~2,700 modules torch and transformers load, which takes about
    a second of CPU per proc and which a proc's stop waits for."""
    import _io
    import atexit
    import gc
    import itertools

    try:
        atexit._run_exitfuncs()
    finally:
        # A file some code left open (a hook's log) is flushed when the interpreter
        # collects it at exit; here it must be done by hand, or its last lines are lost.
        # Only what the fork made is walked (the server froze its own objects: `serve`),
        # through C-level iteration (map, set, compress), not a Python loop, and each
        # type is tested against the C base of every file (`_io._IOBase`), not
        # `io.IOBase`, whose ABC check walks its registry. Only the types are tested: no
        # attribute of an object is read.
        objects = gc.get_objects()
        files = {t for t in set(map(type, objects)) if issubclass(t, _io._IOBase)}
        found = itertools.compress(objects, map(files.__contains__, map(type, objects)))
        for obj in [*found, sys.stdout, sys.stderr]:
            with contextlib.suppress(Exception):
                if not obj.closed and obj.writable():
                    obj.flush()
        if code is None:
            code = 0
        elif not isinstance(code, int):
            sys.stderr.write(f"{code}\n")
            code = 1
        os._exit(code)


def _gone(conn: socket.socket) -> bool:
    """Whether the client at the other end of `conn` closed it (it sends nothing
    after its request: readable means its end is gone). Peeks: reads nothing."""
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def serve(path: str, preload: list[str]) -> None:
    """Import `preload`, then fork a proc for every client that connects to `path`."""
    import gc
    import importlib

    owner = os.getppid()
    # Ctrl-C in a terminal reaches the whole process group: the owner decides
    # what to do about it (it ends this server when it exits).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.path[0] = os.getcwd()  # not this file's folder, whose modules would shadow others
    for name in preload:
        importlib.import_module(name)
    if any(name.startswith("monarch._rust") for name in sys.modules):
        raise SystemExit(f"the fork server's preload {preload} imported Monarch's runtime")
    # What the imports made (~360k objects) goes to the collector's permanent generation:
    # a fork's collections, and its `fast_exit`, skip them instead of walking them all
    # (which also copied every page they lie on into the fork: copy-on-write).
    gc.collect()
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    # Tell the starter we are ready: it waits for this line.
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    children: dict[int, socket.socket] = {}
    ended: set[int] = set()  # children whose client went away, killed here
    while os.getppid() == owner:
        readable, _, _ = select.select([listener, *children.values()], [], [], 0.1)
        for pid, conn in list(children.items()):
            # A client that went away (Monarch ended the proc's stand-in): its child goes
            # too, here, even when it cannot watch for itself (a stopped proc, SIGSTOP:
            # only SIGKILL ends it, and it would hold its pipes open forever).
            if conn in readable and pid not in ended and _gone(conn):
                ended.add(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        while True:  # reap ended children and tell their clients how they ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            ended.discard(pid)
            if conn is not None:
                with contextlib.suppress(OSError):
                    _send(conn, {"status": status})
                conn.close()
        if listener not in readable:
            continue
        conn, _ = listener.accept()
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
        if uid != os.getuid():
            conn.close()
            continue
        fds: list[int] = []
        try:
            data, fds, _, _ = socket.recv_fds(conn, 1 << 20, MAX_FDS)
            while not data.endswith(b"\n"):
                more = conn.recv(1 << 20)
                if not more:
                    raise ConnectionError("the client went away")
                data += more
            request = json.loads(data)
        except (OSError, ValueError):  # (ConnectionError is an OSError)
            for fd in fds:  # what a broken request passed, not kept open here
                os.close(fd)
            conn.close()
            continue
        pid = os.fork()
        if pid == 0:
            try:
                _child(conn, listener, list(children.values()), request, fds)
            except SystemExit:
                raise
            except BaseException:  # noqa: BLE001 - the proc could not start: say why, end
                import traceback

                traceback.print_exc()
                os._exit(1)
        for fd in fds:
            os.close(fd)
        children[pid] = conn
        with contextlib.suppress(OSError):
            _send(conn, {"pid": pid})


# --- the controller's side ----------------------------------------------------


class ForkServer:
    """A fork server at `path`: one this process started (`start()`, ended by
    `close()` or with this process), or one it was handed (`SHARED_ENV`)."""

    def __init__(self, path: str, process: object = None, folder: str | None = None):
        self.path, self.process, self.folder = path, process, folder

    @classmethod
    def start(cls, preload: tuple[str, ...] = PRELOAD, timeout_s: float = 120.0) -> ForkServer:
        import atexit
        import subprocess
        import tempfile

        folder = tempfile.mkdtemp(prefix="meshrl-fork-")  # 0700: this user only
        path = os.path.join(folder, "socket")
        process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "serve", path, *preload],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
        )
        started = cls(path, process, folder)
        atexit.register(started.close)
        ready, _, _ = select.select([process.stdout], [], [], timeout_s)
        if (process.stdout.readline() if ready else b"") != b"ready\n":
            started.close()
            raise RuntimeError(
                f"the proc fork server did not start within {timeout_s:.0f} s "
                f"(exit code {process.poll()}); set job.fork_server=false to spawn "
                "every proc fresh"
            )
        return started

    def alive(self) -> bool:
        if self.process is None:
            return os.path.exists(self.path)
        return self.process.poll() is None

    def command(self) -> object:
        """The `BootstrapCommand` that makes Monarch's proc a fork of this server."""
        from monarch._rust_bindings.monarch_hyperactor.host_mesh import BootstrapCommand

        args = ["-S", os.path.abspath(__file__), "connect", self.path]
        return BootstrapCommand(sys.executable, None, args, {})

    def close(self) -> None:
        import shutil

        if self.process is None:  # not ours to stop
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except Exception:  # noqa: BLE001 - it must not outlive us
                self.process.kill()
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        shutil.rmtree(self.folder, ignore_errors=True)


SHARED_ENV = "MESHRL_FORK_SERVER"
"""A fork server's socket that this process and the processes it starts use
instead of starting their own (`share()`): a test suite's or a notebook
session's, whose command-line runs and kernels then fork their procs from it."""

_server: ForkServer | None = None


def server() -> ForkServer:
    """The fork server local procs come from: the one `SHARED_ENV` names, else
    this process's own, started on first use (and again if it died)."""
    global _server
    shared = os.environ.get(SHARED_ENV)
    if shared:
        if not os.path.exists(shared):
            raise RuntimeError(
                f"{SHARED_ENV}={shared}: no fork server listens there (unset it, or set "
                "job.fork_server=false)"
            )
        open_checked(shared).close()  # this user's alone, or `UntrustedServer` now
        return ForkServer(shared)
    if _server is None or not _server.alive():
        if _server is not None:
            _server.close()
        _server = ForkServer.start()
    return _server


def share() -> str:
    """Start this process's fork server if needed and hand it to every process
    started from here on (`SHARED_ENV`); returns its socket."""
    path = server().path
    os.environ[SHARED_ENV] = path
    return path


def python_m(module: str, *args: str) -> list[str]:
    """The command line of `python -m module args...`, run as a fork of the
    shared fork server (`share()`) where this process has one: it then skips the
    seconds of importing torch and transformers. Otherwise, a fresh Python.

    For a process that starts many short command-line runs (the test suite). The
    fork is its stand-in's in every way a caller sees (descriptors, environment,
    working directory, signals, exit status) but two: it leads a process group
    of its own, so a terminal's Ctrl-C reaches it through the stand-in only; and
    its str hashes are seeded as the server's were (PYTHONHASHSEED is read at an
    interpreter's start), as are every forked proc's."""
    shared = os.environ.get(SHARED_ENV)
    if shared and os.path.exists(shared):
        return [sys.executable, "-S", os.path.abspath(__file__), "run", shared, module, *args]
    return [sys.executable, "-m", module, *args]


if __name__ == "__main__":
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "serve":
        serve(path, sys.argv[3:])
    elif mode == "connect":
        connect(path, [sys.argv[0], "-m", BOOTSTRAP_MAIN])
    elif mode == "run":  # run SOCKET MODULE ARGS...: `python -m MODULE ARGS...`, forked
        connect(path, [sys.argv[0], *sys.argv[4:]], module=sys.argv[3])
    else:
        raise SystemExit(f"usage: {sys.argv[0]} serve|connect|run SOCKET ...")
