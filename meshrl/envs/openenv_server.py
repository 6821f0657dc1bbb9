"""Serve an OpenEnv `Environment` class with openenv-core's own server, and
start such servers (`Server`, `Servers`) for `meshrl.envs.openenv`.

    python -c "$RUN" meshrl/envs/openenv_server.py MODULE:CLASS --fd FD --sessions N --parent PID

`meshrl.envs.openenv` starts this for `task.name=openenv:MODULE:CLASS`, on a
socket it has bound on 127.0.0.1 and passes as file descriptor FD (so no other
process can take the port in between). The app is `create_app(CLASS, ACTION,
OBSERVATION, max_concurrent_envs=N)`, the Action and Observation classes read
from `CLASS`'s generic parameters (`environment_types`), served by uvicorn.

Only the process that started it can call it: `Server` draws a token per
server (`secrets`) and hands it over in the environment (`MESHRL_OPENENV_TOKEN`,
which other users cannot read, unlike the command line); every request's path
must start with `/<token>` (`guarded`), compared in constant time, else 403 and
nothing runs. The server's URL is `http://127.0.0.1:PORT/<token>`: openenv-core's
client sends no headers of its own, but keeps the base URL's path, so its
WebSocket session (`<url>/ws`) carries the token too. `Server.address` is the
URL without it, for messages.

The launcher runs as a file (`RUN` executes it with runpy), not as `-m
meshrl.envs.openenv_server`: the `meshrl` package would import torch first
(about a second per server start); and not as `python FILE`, which would put
meshrl/envs first on sys.path, where its math.py and code.py hide the standard
library's. So it imports nothing from meshrl at its top.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import typing
import urllib.request
from typing import Any

TOKEN_ENV = "MESHRL_OPENENV_TOKEN"
"""The variable in which `Server` hands its server the token its requests need."""

START_TIMEOUT_S = 60.0
"""How long a server may take to answer /health (it imports openenv-core: ~3 s)."""


RUN = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
"""`python -c RUN FILE ARGS...` runs FILE as the main script, sys.path untouched."""


def import_openenv() -> None:
    """Import openenv-core without gradio. Its `env_server` package imports gradio
    for an optional web UI (`ENABLE_WEB_INTERFACE`), which meshrl never serves, and
    falls back by itself when gradio is missing; gradio is ~6 s of the ~7 s a
    server or a proc spends importing openenv-core. gradio stays importable after
    (the web UI, when asked for, imports it then). Raises ImportError without
    openenv-core."""
    web = os.environ.get("ENABLE_WEB_INTERFACE", "").lower() in ("true", "1", "yes")
    if web or "openenv.core" in sys.modules or "gradio" in sys.modules:
        importlib.import_module("openenv.core.env_server")
        return
    sys.modules["gradio"] = None  # `import gradio` raises ModuleNotFoundError
    try:
        importlib.import_module("openenv.core.env_server")
    finally:
        if "gradio" in sys.modules and sys.modules["gradio"] is None:
            del sys.modules["gradio"]


def environment_types(cls: type) -> tuple[type, type] | None:
    """The Action and Observation classes of an openenv `Environment` subclass:
    from its generic parameters (`class E(Environment[A, O, S])`, here or in a
    base class), else from the annotations of its `step(self, action: A) -> O`;
    None when neither says."""
    from openenv.core.env_server import Action, Environment, Observation

    def fits(action: Any, observation: Any) -> bool:
        return (
            isinstance(action, type)
            and isinstance(observation, type)
            and issubclass(action, Action)
            and issubclass(observation, Observation)
        )

    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            origin = typing.get_origin(base)
            if isinstance(origin, type) and issubclass(origin, Environment):
                args = typing.get_args(base)
                if len(args) >= 2 and fits(args[0], args[1]):
                    return args[0], args[1]
    try:
        hints = typing.get_type_hints(cls.step)
    except Exception:  # noqa: BLE001 - unresolvable annotations: we cannot tell
        return None
    action, observation = hints.get("action"), hints.get("return")
    return (action, observation) if fits(action, observation) else None


def guarded(app: Any, token: str) -> Any:
    """The ASGI `app` behind `token`: an HTTP request or WebSocket whose path is
    not `/<token>/...` is refused (403; the WebSocket closed before it is
    accepted, which the client sees as a 403 handshake), the others reach `app`
    with the prefix taken off. Lifespan events pass as they are."""
    import hmac
    import json

    prefix = f"/{token}".encode()
    refusal = json.dumps({"detail": "this openenv server answers only the process that started it"})

    async def guard(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await app(scope, receive, send)
            return
        path = scope.get("raw_path") or scope["path"].encode()
        path = path.split(b"?")[0]
        head, rest = path[: len(prefix)], path[len(prefix) :]
        if not hmac.compare_digest(head, prefix) or not rest.startswith(b"/"):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            body = refusal.encode()
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(body)),
            ]
            await send({"type": "http.response.start", "status": 403, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        inner = scope["path"][len(prefix.decode()) :]
        await app(dict(scope, path=inner, raw_path=rest), receive, send)

    return guard


def _die_with_parent(parent: int) -> None:
    """SIGKILL this server when the thread that started it exits (its process
    ending included), so that a meshrl proc that dies leaves no server behind."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", help="MODULE:CLASS, an openenv Environment subclass")
    parser.add_argument("--fd", type=int, required=True, help="a bound listening socket")
    parser.add_argument("--sessions", type=int, default=1, help="max_concurrent_envs")
    parser.add_argument("--parent", type=int, default=0, help="die with this pid")
    args = parser.parse_args(argv)
    if args.parent and sys.platform == "linux":
        _die_with_parent(args.parent)
    import_openenv()  # before the environment's module imports it
    module, _, attr = args.target.partition(":")
    cls = getattr(importlib.import_module(module), attr)
    types = environment_types(cls)
    if types is None:
        sys.exit(f"{args.target}: cannot tell its Action and Observation classes")
    import uvicorn
    from openenv.core.env_server import create_app

    app = create_app(cls, *types, env_name=attr, max_concurrent_envs=args.sessions)
    token = os.environ.pop(TOKEN_ENV, "")  # the environment's code and children do not see it
    if token:
        app = guarded(app, token)
    sock = socket.socket(fileno=args.fd)
    config = uvicorn.Config(app, log_level="warning")
    uvicorn.Server(config).run(sockets=[sock])


class Server:
    """One server this process started on 127.0.0.1 (`main`, in a child
    process), for up to `sessions` episodes at once."""

    def __init__(self, target: str, sessions: int):
        self.target, self.sessions = target, sessions
        self.users = 0
        """Episodes holding a session on it (`Servers` counts them)."""
        self.url = ""
        """Where to call it: http://127.0.0.1:PORT/TOKEN (the token is its callers' key)."""
        self.address = ""
        """http://127.0.0.1:PORT, the URL without the token: for messages."""
        self.token = ""
        self.proc: subprocess.Popen | None = None
        self.error: Exception | None = None
        self.ready = threading.Event()
        """Set once `start` has succeeded or failed (then `error` says why)."""
        self.stopped = False
        self.log_path = ""

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start it and wait until it answers /health, or raise one line that ends
        with the last line of its log."""
        try:
            self._spawn()
            if self.stopped:  # stopped while it was starting
                raise RuntimeError(f"the openenv server for {self.target} was stopped")
            self._wait_healthy(timeout_s)
            # Its log served to explain a failed start. Unlinked now, it goes away
            # with the server even if nothing stops it but PR_SET_PDEATHSIG.
            self._remove_log()
        except Exception as error:
            self.error = error
            self.stop()
            raise
        finally:
            self.ready.set()

    def _spawn(self) -> None:
        # The port is bound here and the socket handed over: no other process
        # can take the port between choosing it and the server listening.
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.token = token = secrets.token_urlsafe(32)
        self.address = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.url = f"{self.address}/{token}"
        log, self.log_path = tempfile.mkstemp(prefix="meshrl-openenv-", suffix=".log")
        command = [
            sys.executable,
            "-c",
            RUN,
            os.path.abspath(__file__),
            self.target,
            "--fd",
            str(sock.fileno()),
            "--sessions",
            str(self.sessions),
            "--parent",
            str(os.getpid()),
        ]
        # What this process imports (the environment's module), the server imports.
        path = os.pathsep.join(entry or os.getcwd() for entry in sys.path)
        env = dict(os.environ, PYTHONPATH=path, **{TOKEN_ENV: token})
        spawned = threading.Event()

        def run() -> None:
            # The server dies with the thread that started it (`_die_with_parent`):
            # this one, which lives as long as the server does.
            try:
                self.proc = subprocess.Popen(
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    pass_fds=(sock.fileno(),),
                    env=env,
                )
            except OSError as error:
                self.error = error
            finally:
                spawned.set()
            if self.proc is not None:
                self.proc.wait()

        threading.Thread(target=run, name="openenv-server", daemon=True).start()
        spawned.wait()
        os.close(log)
        sock.close()
        if self.proc is None:
            raise RuntimeError(f"cannot start the openenv server for {self.target}: {self.error}")

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        while True:
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(
                    f"the openenv server for {self.target} exited with code {code} before "
                    f"answering: {self.log_tail()}"
                )
            with (
                contextlib.suppress(OSError),
                opener.open(self.url + "/health", timeout=1) as answer,
            ):
                if answer.status == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the openenv server for {self.target} did not answer /health within "
                    f"{timeout_s:g}s: {self.log_tail()}"
                )
            time.sleep(0.1)

    def log_tail(self) -> str:
        """The last line of the server's output (its error, when it failed)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - 4096))
                lines = f.read().decode(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return lines[-1].strip()[:300] if lines else "(no output)"

    def dead(self) -> bool:
        return self.error is not None or (self.proc is not None and self.proc.poll() is not None)

    def exit_code(self, wait_s: float = 0.0) -> int | None:
        """Its exit code once it has exited (waiting up to `wait_s`), else None."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        """SIGTERM, SIGKILL after 5 s. Safe to call twice."""
        self.stopped = True
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._remove_log()

    def _remove_log(self) -> None:
        if self.log_path:
            with contextlib.suppress(OSError):
                os.unlink(self.log_path)
            self.log_path = ""


class Servers:
    """The servers one process runs for one environment class: an episode takes
    a session on a live server with room, and a new server starts when none
    has (at first, when all are full, after one died), at most `most` of them."""

    def __init__(self, target: str, sessions: int, most: int):
        self.target, self.sessions, self.most = target, sessions, most
        self.live: list[Server] = []
        self.changed = threading.Condition()

    def acquire(self, wait_s: float = 5.0) -> Server:
        """A session on a server (started here if need be); `release` gives it back.
        With `most` servers full, wait up to `wait_s` for a session to end (they
        end in the background), then fail."""
        with self.changed:
            server, new = self._pick(time.monotonic() + wait_s)
        try:
            if new:
                server.start()
                _count_start()
            elif not server.ready.wait(START_TIMEOUT_S + 10) or server.error is not None:
                raise RuntimeError(str(server.error or "the openenv server did not start"))
        except Exception:
            self.release(server)
            raise
        return server

    def _pick(self, deadline: float) -> tuple[Server, bool]:
        while True:
            for server in [s for s in self.live if s.dead()]:
                server.stop()  # it has exited: this reaps it
                self.live.remove(server)
            server = next((s for s in self.live if s.users < s.sessions), None)
            new = server is None and len(self.live) < self.most
            if new:
                server = Server(self.target, self.sessions)
                self.live.append(server)
            if server is not None:
                server.users += 1
                return server, new
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"{len(self.live)} openenv servers for {self.target} are full "
                    f"({self.sessions} episode(s) each; one for a class that does not set "
                    f"SUPPORTS_CONCURRENT_SESSIONS) and task.env_workers={self.most} is "
                    "the most started"
                )
            self.changed.wait(max(0.0, deadline - time.monotonic()))

    def release(self, server: Server) -> None:
        with self.changed:
            server.users -= 1
            self.changed.notify_all()

    def close(self) -> None:
        """Stop every server."""
        with self.changed:
            servers, self.live = self.live, []
        for server in servers:
            server.stop()


def _count_start() -> None:
    from meshrl.observe.telemetry import record

    record("env/openenv_server_starts", 1, "sum")


if __name__ == "__main__":
    main()
