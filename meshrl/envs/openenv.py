"""OpenEnv environments: `task.name=openenv:MODULE:CLASS` or `openenv:http://HOST:PORT`.

`openenv:MODULE:CLASS` names an openenv `Environment` subclass (declared as
`Environment[MyAction, MyObservation, MyState]`). Each process that needs it
(the controller, to draw prompts; each environment proc, to play episodes)
starts openenv-core's own server for it on 127.0.0.1 (`openenv_server.py`) and
stops it at the end of the run. Such a server answers only the process that
started it: its URL carries a token drawn per server, which messages leave out
(`Server.address`). `openenv:http://HOST:PORT` plays against a
server that is already running; nothing is started.

How an OpenEnv environment maps onto meshrl's (`meshrl.envs.base`):

- A prompt is a reset: `POST /reset {"seed": S}` (the stateless route), its
  observation's text the prompt's text and `{"seed": S}` its data.
- An episode is a WebSocket session (`GenericEnvClient`): `reset(seed=S)`
  (the same initial state as the prompt), then one `step` per model turn. The
  model's text fills the action's single string field; an action with several
  fields is read from the text as a JSON object (text that is not one fails
  the episode).
- An observation's text is its single string field, else compact JSON of its
  fields (done, reward and metadata left out). It is appended to the episode
  as meshrl's own multi-turn environments' replies are: tokenized once, out
  of the loss.
- The reward is the return: the sum of the steps' rewards so far, so an
  episode cut at its last turn (`max_turns`, default 8) keeps what it earned.

A server holds up to `MAX_SESSIONS` episodes at once; a class that does not
set `SUPPORTS_CONCURRENT_SESSIONS = True` is served one episode per server
(openenv-core refuses more), so one server is started per episode open at
once: at most `task.env_workers` servers, and an episode beyond that fails.

Failures stay with their episode: a server that dies, hangs past
`task.step_timeout_s` or answers with an error fails the episodes it was
playing (the reason names the server), and the next episode starts a new
server. An unreachable `http://` server stops the run at the first prompt,
with one line naming the URL.
"""

from __future__ import annotations

import contextlib
import json
import random
import threading
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from meshrl.envs.base import Env, Episode, Step
from meshrl.envs.openenv_server import Server, Servers, environment_types, import_openenv
from meshrl.types import Prompt

INSTALL = "openenv-core is not installed: pip install 'meshrl[openenv]'"
MAX_SESSIONS = 1024
"""Episodes one server plays at once (its `max_concurrent_envs`), for a class that
supports concurrent sessions; more at once start another server."""
NOT_OBSERVED = ("done", "reward", "metadata")


def _target(name: str) -> str:
    """`openenv:X` -> X."""
    return name.partition(":")[2]


def _is_url(target: str) -> bool:
    return target.startswith(("http://", "https://"))


def load_environment(target: str) -> type:
    """The openenv `Environment` subclass named by MODULE:CLASS."""
    import importlib

    import_openenv()  # before the environment's module imports it
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


class OpenEnvTask(Env):
    """An OpenEnv environment, played through its server (see the module's docstring)."""

    max_turns = 8
    threaded = True  # every step is a round trip to the server

    def __init__(self, cfg: Any = None):
        super().__init__(cfg)
        self.target = _target(cfg.name)
        self.timeout_s = getattr(cfg, "step_timeout_s", 30.0)
        self.servers: Servers | None = None  # MODULE:CLASS: the servers this process started
        self._fields: tuple[str, str] | None = None  # (action field, observation field)
        self._lock = threading.Lock()

    @staticmethod
    def check_name(name: str) -> str:
        """'' when `name` can be played, else the problem (one line)."""
        target = _target(name)
        try:
            import_openenv()
            from openenv.core.env_server import Environment
        except ImportError:
            return INSTALL
        if _is_url(target):
            parts = urllib.parse.urlsplit(target)
            try:
                parts.port  # noqa: B018 - raises on a port that is not a number
            except ValueError as error:
                return f"'{target}': {error}"
            if not parts.hostname:
                return f"'{target}' names no host: expected openenv:http://HOST:PORT"
            return ""
        module, _, attr = target.partition(":")
        if not module or not attr:
            return f"'{name}': expected openenv:MODULE:CLASS or openenv:http://HOST:PORT"
        try:
            cls = load_environment(target)
        except ImportError as error:
            return f"cannot import '{module}': {error}"
        except AttributeError:
            return f"module '{module}' has no '{attr}'"
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            return f"'{target}' is not an openenv Environment subclass"
        if environment_types(cls) is None:
            return (
                f"cannot tell the Action and Observation classes of '{target}': declare it "
                "as Environment[MyAction, MyObservation, MyState]"
            )
        return ""

    # --- servers -------------------------------------------------------------------------

    def _servers(self) -> Servers:
        with self._lock:
            if self.servers is None:
                cls = load_environment(self.target)
                concurrent = getattr(cls, "SUPPORTS_CONCURRENT_SESSIONS", False)
                workers = getattr(self.cfg, "env_workers", 64)
                self.servers = Servers(self.target, MAX_SESSIONS if concurrent else 1, workers)
            return self.servers

    def open_session(self) -> tuple[str, Server | None]:
        """A server's URL for one more episode (with its token: not for messages,
        which show `Server.address`), and the `Server` whose slot it holds (None
        for an `http://` server)."""
        if _is_url(self.target):
            return self.target.rstrip("/"), None
        server = self._servers().acquire()
        return server.url, server

    def close_session(self, server: Server | None) -> None:
        if server is not None and self.servers is not None:
            self.servers.release(server)

    def close(self) -> None:
        """Stop the servers this process started (a later use starts new ones)."""
        with self._lock:
            servers, self.servers = self.servers, None
        if servers is not None:
            servers.close()

    # --- prompts, actions, observations --------------------------------------------------

    def generate(self, rng: random.Random) -> Prompt:
        seed = rng.randrange(2**31)
        url, server = self.open_session()
        try:
            shown = server.address if server is not None else url
            reset = _http(url, "/reset", {"seed": seed}, shown=shown)
            self._schema(url, shown)
        finally:
            self.close_session(server)
        text = self.observation_text(reset.get("observation") or {})
        return Prompt(text=text, answer="", data={"seed": seed})

    def _schema(self, url: str, shown: str | None = None) -> tuple[str, str]:
        """The action's single string field ('' when it has several fields) and the
        observation's ('' when it has none or several), from the server's /schema."""
        if self._fields is None:
            schema = _http(url, "/schema", shown=shown)

            def strings(model: dict, skip: tuple[str, ...]) -> tuple[list[str], list[str]]:
                fields = [f for f in model.get("properties", {}) if f not in skip]
                return fields, [f for f in fields if _is_string(model["properties"][f])]

            action_fields, action_strings = strings(schema["action"], ("metadata",))
            _, observation_strings = strings(schema["observation"], NOT_OBSERVED)
            single = action_strings[0] if action_fields == action_strings[:1] else ""
            self._fields = (single, observation_strings[0] if len(observation_strings) == 1 else "")
        return self._fields

    def action_payload(self, url: str, text: str, shown: str | None = None) -> dict:
        """The model's text as the action the server expects."""
        field = self._schema(url, shown)[0]
        if field:
            return {field: text}
        try:
            payload = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"the action has several fields and the text is not JSON: {error}"
            ) from None
        if not isinstance(payload, dict):
            raise ValueError("the action has several fields and the text is not a JSON object")
        return payload

    def observation_text(self, observation: dict) -> str:
        field = self._fields[1] if self._fields else ""
        if field:
            return str(observation.get(field, ""))
        shown = {k: v for k, v in observation.items() if k not in NOT_OBSERVED}
        return json.dumps(shown, separators=(",", ":"))

    # --- episodes ------------------------------------------------------------------------

    def episode(self, prompt: Prompt) -> Episode:
        return OpenEnvEpisode(self, (prompt.data or {}).get("seed"))

    def reward(self, prompt: Prompt, completion: str) -> float:
        """With `task.max_turns=1`: the reward of a one-step episode."""
        episode = self.episode(prompt)
        try:
            return episode.step(completion).reward
        finally:
            episode.close()

    def demonstration(self, prompt: Prompt) -> str:
        raise ValueError(
            f"openenv:{self.target} has no demonstrations to warm-start on: set warm_start.steps=0"
        )


class OpenEnvEpisode(Episode):
    """One WebSocket session on an OpenEnv server: opened at the first step."""

    def __init__(self, task: OpenEnvTask, seed: int | None):
        self.task, self.seed = task, seed
        self.client: Any = None
        self.server: Server | None = None
        self.url = ""
        self.total = 0.0
        self.closed = False

    def step(self, action: str) -> Step:
        if self.closed:
            raise RuntimeError("the episode's session is closed")
        if self.client is None:
            self._open()
        payload = self.task.action_payload(self.url, action, self._shown())
        result = self._call(lambda: self.client.step(payload))
        self.total += float(result.reward or 0.0)
        if result.done:
            self.close()
            return Step(reward=self.total, done=True)
        text = self.task.observation_text(result.observation or {})
        return Step(observation=text, reward=self.total, done=False)

    def _open(self) -> None:
        import_openenv()
        from openenv.core.generic_client import GenericEnvClient

        self.url, self.server = self.task.open_session()
        timeout = self.task.timeout_s
        self.client = GenericEnvClient(
            base_url=self.url, connect_timeout_s=min(10.0, timeout), message_timeout_s=timeout
        ).sync()
        self._call(self.client.connect, starting=True)
        self._call(lambda: self.client.reset(seed=self.seed), starting=True)

    def _call(self, call: Any, starting: bool = False) -> Any:
        """`call()`, or a one-line error naming the server (the session is dropped)."""
        try:
            return call()
        except Exception as error:  # noqa: BLE001 - every transport error becomes one line
            server = self.server
            self.close()
            timeout = self.task.timeout_s
            shown = server.address if server is not None else self.url
            raise RuntimeError(_describe(shown, server, error, timeout, starting)) from error

    def _shown(self) -> str:
        """The server's URL for messages (without its token)."""
        return self.server.address if self.server is not None else self.url

    def close(self) -> None:
        """Drop the session and then give its server slot back, in the background
        (a hung server must not block). Safe to call twice, from any thread."""
        if self.closed:
            return
        self.closed = True
        client, self.client = self.client, None
        server, self.server = self.server, None
        if client is None:
            self.task.close_session(server)
            return
        threading.Thread(
            target=_close_session, args=(self.task, client, server), daemon=True
        ).start()


def _close_session(task: OpenEnvTask, client: Any, server: Server | None) -> None:
    # The slot is free once the server has ended the session: after close() returns.
    with contextlib.suppress(Exception):  # the session is gone either way
        client.close()
    task.close_session(server)


def _describe(
    url: str, server: Server | None, error: Exception, timeout_s: float, starting: bool
) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if server is not None and server.token:  # openenv's client names the URL it called
        text = text.replace(server.token, "TOKEN")
    text = text[:200]
    where = f"openenv server {url}"
    code = server.exit_code(wait_s=0.5) if server is not None else None
    if code is not None:
        return f"{where} died{'' if starting else ' mid-episode'} (exit code {code}): {text}"
    if type(error).__module__.startswith("websockets"):
        if starting:  # what openenv-core does to a session beyond its max_concurrent_envs
            return f"{where} closed the session as it opened (is it full?): {text}"
        return f"{where} closed the connection mid-episode: {text}"
    if isinstance(error, TimeoutError):
        return f"{where} did not answer within task.step_timeout_s={timeout_s:g}s"
    if isinstance(error, ConnectionError):
        return f"{where} is unreachable: {text}"
    return f"{where}: {text}"


def _is_string(field: dict) -> bool:
    """A JSON schema field that holds text (`str`, or `str | None`)."""
    kinds = (
        [field.get("type")] if "type" in field else [a.get("type") for a in field.get("anyOf", [])]
    )
    return "string" in kinds and set(kinds) <= {"string", "null"}


def _http(
    url: str,
    path: str,
    body: dict | None = None,
    timeout_s: float = 30.0,
    shown: str | None = None,
) -> dict:
    """GET (or POST `body` to) `url + path`; its JSON answer, or one line naming the
    server (as `shown`: its URL without a token)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url + path, data=data, headers={"Content-Type": "application/json"}
    )
    local = urllib.parse.urlsplit(url).hostname in ("127.0.0.1", "localhost", "::1")
    shown = shown or url
    # As openenv's own client does: a proxy in the environment is not for this host.
    handlers = [urllib.request.ProxyHandler({})] if local else []
    opener = urllib.request.build_opener(*handlers)
    try:
        with opener.open(request, timeout=timeout_s) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as error:
        detail = error.read().decode(errors="replace").strip().splitlines()
        raise RuntimeError(
            f"openenv server {shown}{path} answered {error.code}: "
            f"{detail[0][:200] if detail else ''}"
        ) from None
    except json.JSONDecodeError:
        raise RuntimeError(
            f"openenv server {shown}{path} answered with something not JSON"
        ) from None
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise ConnectionError(f"openenv server {shown} is unreachable: {reason}") from None


__all__ = ["MAX_SESSIONS", "OpenEnvEpisode", "OpenEnvTask"]
