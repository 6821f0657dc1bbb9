"""The HTTP side of the policy endpoint (`meshrl.envs.endpoint`): what a request must
look like before anything is tokenized or generated, and the handler that
reads it within its limits and answers.

Before anything else the handler checks the `Host` header (421 unless it names
this server by a loopback address: a web page that rebinds its own name to
127.0.0.1 cannot reach it) and, on the stateless `/v1/*` routes, the run's
token (`Authorization: Bearer TOKEN`, 401 otherwise, shaped like OpenAI's).
An episode's URL carries its own secret instead."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

from meshrl.config import MAX_TEMPERATURE, MIN_TEMPERATURE

MAX_BODY_BYTES = 8 << 20
"""The largest request body read (413 above it)."""
WORKERS = 128
"""Threads answering requests: as many agents as that may wait on generation at once."""
READ_TIMEOUT_S = 10.0
"""Seconds a connection has to send each read of its request."""


class RequestError(ValueError):
    """A request the endpoint refuses: HTTP 400 with this message, and `param`
    the request field at fault (OpenAI's error `param`), when there is one."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_body(kind: str, body: dict) -> None:
    need = "messages" if kind == "chat" else "prompt"
    if need not in body:
        raise RequestError(f"the request has no '{need}'")
    if kind == "chat":
        messages = body["messages"]
        if not (isinstance(messages, list) and messages):
            raise RequestError("'messages' must be a non-empty list", "messages")
        for i, message in enumerate(messages):
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)):
                raise RequestError(f"messages[{i}] must be an object with a string 'role'")
            if not isinstance(message.get("name", ""), str):
                raise RequestError(f"messages[{i}].name must be a string")
            calls = message.get("tool_calls")
            if calls is not None and not (
                isinstance(calls, list) and all(isinstance(c, dict) for c in calls)
            ):
                raise RequestError(f"messages[{i}].tool_calls must be a list of objects")
            content = message.get("content")
            parts_ok = isinstance(content, list) and all(
                isinstance(p, dict) and isinstance(p.get("text", ""), str) for p in content
            )
            if not (content is None or isinstance(content, str) or parts_ok):
                raise RequestError(f"messages[{i}].content must be a string or text parts")
        if body.get("tools") is not None and not isinstance(body["tools"], list):
            raise RequestError("'tools' must be a list", "tools")
    if kind == "completions" and not isinstance(body["prompt"], str):
        raise RequestError("'prompt' must be one string", "prompt")
    if not isinstance(body.get("model", ""), str):
        raise RequestError("'model' must be a string", "model")


MAX_N = 16
"""Samples one request may ask for (`n`)."""
MAX_STOPS = 4
"""Stop strings one request may give (OpenAI's limit)."""
MAX_TOP_LOGPROBS = 20
"""Alternatives per token one request may ask for (OpenAI's limit)."""

HONOURED = {
    "chat": {
        "model", "messages", "temperature", "top_p", "seed", "max_tokens",
        "max_completion_tokens", "stop", "n", "logprobs", "top_logprobs", "stream",
        "stream_options", "tools", "tool_choice", "parallel_tool_calls",
    },
    "completions": {
        "model", "prompt", "temperature", "top_p", "seed", "max_tokens", "stop", "n",
        "logprobs", "stream", "stream_options",
    },
}  # fmt: skip
"""The request fields the endpoint acts on, per route."""
BOOKKEEPING = {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"}
"""Fields that label a request for OpenAI's own records and change no answer:
accepted, and without effect here."""
NEUTRAL: dict[str, tuple[Callable[[Any], bool], str]] = {
    "frequency_penalty": (lambda v: v in (None, 0), "0"),
    "presence_penalty": (lambda v: v in (None, 0), "0"),
    "logit_bias": (lambda v: not v, "empty"),
    "response_format": (lambda v: v in (None, {"type": "text"}), "{'type': 'text'}"),
    "modalities": (lambda v: v in (None, ["text"]), "['text']"),
    "echo": (lambda v: v in (None, False), "false"),
    "suffix": (lambda v: v in (None, ""), "empty"),
    "best_of": (lambda v: v in (None, 1), "1"),
}
"""Fields the sampler cannot honour (penalties, biases, constrained formats):
taken only at the value that asks for nothing, else refused."""


@dataclass
class Asked:
    """What a request asks of the sampler, checked (`read_request`)."""

    n: int = 1
    max_tokens: int | None = None
    """None: the server's limit."""
    temperature: float | None = None
    """None: the server's default; 0: greedy."""
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    include_usage: bool = False
    parallel_tool_calls: bool = True


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_request(kind: str, body: dict) -> Asked:
    """A request's sampling fields, checked: RequestError (one line, 400) on a
    malformed value, on a field the sampler cannot honour and on an unknown field
    (OpenAI refuses those too), so that nothing asked is silently dropped."""
    check_body(kind, body)
    for key, value in body.items():
        if key in HONOURED[kind] or key in BOOKKEEPING:
            continue
        if key in NEUTRAL:
            neutral, what = NEUTRAL[key]
            if not neutral(value):
                raise RequestError(f"{key} is not supported here: leave it out or send {what}", key)
            continue
        raise RequestError(f"unrecognized request argument: {key}", key)
    asked = Asked()
    n = body.get("n")
    if n is not None:
        if not (_integer(n) and 1 <= n <= MAX_N):
            raise RequestError(f"n must be an integer in [1, {MAX_N}]", "n")
        asked.n = n
    limit = body.get("max_completion_tokens")
    limit = body.get("max_tokens") if limit is None else limit
    if limit is not None:
        if not (_integer(limit) and limit >= 1):
            raise RequestError("max_tokens must be a positive integer", "max_tokens")
        asked.max_tokens = limit
    temperature = body.get("temperature")
    if temperature is not None:
        if not (
            number(temperature)
            and (temperature == 0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE)
        ):
            raise RequestError(
                f"temperature must be 0 (greedy) or a number in [{MIN_TEMPERATURE:g}, "
                f"{MAX_TEMPERATURE:g}]",
                "temperature",
            )
        asked.temperature = float(temperature)
    top_p = body.get("top_p")
    if top_p is not None:
        if not (number(top_p) and 1e-6 <= top_p <= 1):
            raise RequestError("top_p must be a number in [1e-6, 1]", "top_p")
        asked.top_p = float(top_p)
    seed = body.get("seed")
    if seed is not None:
        if not _integer(seed):
            raise RequestError("seed must be an integer", "seed")
        asked.seed = seed
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if stops is not None:
        if not (
            isinstance(stops, list)
            and len(stops) <= MAX_STOPS
            and all(isinstance(x, str) and x for x in stops)
        ):
            raise RequestError(
                f"stop must be a non-empty string or a list of up to {MAX_STOPS}", "stop"
            )
        asked.stop = stops
    logprobs = body.get("logprobs")
    if kind == "chat":
        if logprobs not in (None, True, False):
            raise RequestError("logprobs must be true or false", "logprobs")
        asked.logprobs = bool(logprobs)
        top = body.get("top_logprobs")
        if top is not None:
            if not (_integer(top) and 0 <= top <= MAX_TOP_LOGPROBS):
                raise RequestError(
                    f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs"
                )
            if top and not asked.logprobs:
                raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
            asked.top_logprobs = top
        parallel = body.get("parallel_tool_calls")
        if parallel not in (None, True, False):
            raise RequestError("parallel_tool_calls must be true or false", "parallel_tool_calls")
        asked.parallel_tool_calls = parallel is not False
    elif logprobs is not None and logprobs is not False:
        # The legacy route's logprobs is a count: the sampled token's and that many more.
        if not (logprobs is True or (_integer(logprobs) and 0 <= logprobs <= MAX_TOP_LOGPROBS)):
            raise RequestError(
                f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]", "logprobs"
            )
        asked.logprobs, asked.top_logprobs = True, 0 if logprobs is True else logprobs
    stream = body.get("stream")
    if stream not in (None, True, False):
        raise RequestError("stream must be true or false", "stream")
    asked.stream = bool(stream)
    options = body.get("stream_options")
    if options is not None:
        if not asked.stream:
            raise RequestError("stream_options is only allowed with stream: true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}:
            raise RequestError("stream_options may only hold include_usage", "stream_options")
        asked.include_usage = bool(options.get("include_usage"))
    return asked


def field_chars(value: Any) -> int:
    """Characters in a JSON value: every string, key and number in it, however
    deep (a message's role, name, tool calls and content parts alike)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(len(str(k)) + field_chars(v) for k, v in value.items())
    if isinstance(value, list):
        return sum(field_chars(v) for v in value)
    return 0 if value is None else len(str(value))


def text_chars(kind: str, body: dict) -> int:
    """Characters of text the request hands the chat template or the tokenizer:
    the prompt, or every field of every message and the tools."""
    if kind == "completions":
        return len(body["prompt"])
    return field_chars(body["messages"]) + field_chars(body.get("tools"))


def handler(server: Any) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # no line per request on stderr
            pass

        def _reply(self, status: int, payload: dict, headers: Any = ()) -> None:
            data = json.dumps(payload).encode()
            try:
                self.send_response(status)
                for name, value in headers:
                    self.send_header(name, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                self.close_connection = True  # the client left: its answer goes nowhere

        def _events(self, chunks: Iterable[dict]) -> None:
            """Server-sent events, as OpenAI streams: a `data:` line per chunk, then
            `data: [DONE]`; the body ends when the connection closes (HTTP/1.0)."""
            self.close_connection = True
            try:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.end_headers()
                for chunk in chunks:
                    self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                pass  # the client left mid-stream

        def _error(
            self,
            status: int,
            message: str,
            kind: str,
            code: Any = None,
            headers: Any = (),
            param: str | None = None,
        ) -> None:
            error = {"message": message, "type": kind, "param": param, "code": code or status}
            self._reply(status, {"error": error}, headers)

        def _admitted(self, key: str | None) -> bool:
            """The Host names this server, and a stateless route's caller has the
            token; else the refusal is sent (nothing of the body is read)."""
            problem = server.host_problem(self.headers.get("Host"))
            if problem:
                self.close_connection = True
                self._error(421, problem, "invalid_request_error", "misdirected_request")
                return False
            if key is None:
                problem = server.token_problem(self.headers.get("Authorization"))
                if problem:
                    self.close_connection = True
                    self._error(
                        401,
                        problem,
                        "invalid_request_error",
                        "invalid_api_key",
                        [("WWW-Authenticate", 'Bearer realm="meshrl"')],
                    )
                    return False
            return True

        def do_GET(self) -> None:
            key, route_ = route(self.path)
            if not self._admitted(key):
                return
            if route_ != "/models":
                self._error(404, f"no route GET {self.path}", "not_found")
                return
            try:
                if key is not None:
                    server.episode(key)  # an episode's models, for its agent alone
            except LookupError as error:
                self._error(404, str(error), "not_found")
                return
            model = {"id": server.model_name, "object": "model", "owned_by": "meshrl"}
            self._reply(200, {"object": "list", "data": [model]})

        def do_POST(self) -> None:
            key, route_ = route(self.path)
            if not self._admitted(key):
                return
            kind = {"/chat/completions": "chat", "/completions": "completions"}.get(route_)
            if kind is None:
                self._error(404, f"no route POST {self.path}", "not_found")
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                self._error(400, "Content-Length is not a number", "invalid_request_error")
                return
            if length > MAX_BODY_BYTES or length < 0:
                self.close_connection = True  # its body is not read
                self._error(
                    413, f"the body is over {MAX_BODY_BYTES} bytes", "invalid_request_error"
                )
                return
            try:
                data = self.rfile.read(length)
            except (OSError, TimeoutError):
                self.close_connection = True
                return  # too slow, or gone: nothing to answer
            try:
                body = json.loads(data or b"{}")
                if not isinstance(body, dict):
                    raise RequestError("the body must be a JSON object")
                reply = server.answer(kind, body, key)
                if reply.stream:
                    self._events(reply.chunks())
                else:
                    self._reply(200, reply.payload)
            except (
                RequestError,
                json.JSONDecodeError,
                TypeError,
                ValueError,
                UnicodeError,
            ) as error:
                message = str(error).splitlines()[0][:500]
                param = getattr(error, "param", None)
                self._error(400, message, "invalid_request_error", param=param)
            except LookupError as error:
                self._error(404, str(error), "not_found")
            except Exception as error:  # noqa: BLE001 - the client gets the reason, the server goes on
                message = str(error).splitlines()[0] if str(error) else type(error).__name__
                self._error(500, message, "server_error")

    return Handler


def route(path: str) -> tuple[str | None, str]:
    """`/episodes/<key>~<secret>/v1/<route>` or `/v1/<route>` -> (`<key>~<secret>`
    or None, `/<route>`)."""
    path = path.split("?")[0].rstrip("/")
    key = None
    if path.startswith("/episodes/"):
        key, _, path = path[len("/episodes/") :].partition("/")
        path = "/" + path
    return key, path[len("/v1") :] if path.startswith("/v1/") else ""
