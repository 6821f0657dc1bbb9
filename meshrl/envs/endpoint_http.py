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
from http.server import BaseHTTPRequestHandler
from typing import Any

MAX_BODY_BYTES = 8 << 20
"""The largest request body read (413 above it)."""
WORKERS = 128
"""Threads answering requests: as many agents as that may wait on generation at once."""
READ_TIMEOUT_S = 10.0
"""Seconds a connection has to send each read of its request."""


class RequestError(ValueError):
    """A request the endpoint refuses: HTTP 400 with this message."""


def number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_body(kind: str, body: dict) -> None:
    need = "messages" if kind == "chat" else "prompt"
    if need not in body:
        raise RequestError(f"the request has no '{need}'")
    if kind == "chat":
        messages = body["messages"]
        if not (isinstance(messages, list) and messages):
            raise RequestError("'messages' must be a non-empty list")
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
            raise RequestError("'tools' must be a list")
    if kind == "completions" and not isinstance(body["prompt"], str):
        raise RequestError("'prompt' must be one string")
    if body.get("stream"):
        raise RequestError("stream is not supported")
    if body.get("n", 1) != 1:
        raise RequestError("n must be 1 (send one request per sample)")
    if not isinstance(body.get("model", ""), str):
        raise RequestError("'model' must be a string")


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


def asked_tokens(body: dict, limit: int) -> int:
    asked = body.get("max_completion_tokens", body.get("max_tokens"))
    if asked is None:
        return limit
    if not (isinstance(asked, int) and not isinstance(asked, bool) and asked >= 1):
        raise RequestError("max_tokens must be a positive integer")
    return min(asked, limit)


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

        def _error(
            self, status: int, message: str, kind: str, code: Any = None, headers: Any = ()
        ) -> None:
            error = {"message": message, "type": kind, "param": None, "code": code or status}
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
                self._reply(200, server.answer(kind, body, key))
            except (
                RequestError,
                json.JSONDecodeError,
                TypeError,
                ValueError,
                UnicodeError,
            ) as error:
                self._error(400, str(error).splitlines()[0][:500], "invalid_request_error")
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
