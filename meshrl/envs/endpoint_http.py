"""The HTTP side of the policy endpoint (`meshrl.envs.endpoint`): what a request must
look like before anything is tokenized or generated, and the handler that
reads it within its limits and answers."""

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


def text_chars(kind: str, body: dict) -> int:
    """Characters of text the request would tokenize (every message's, or the prompt)."""
    if kind == "completions":
        return len(body["prompt"])
    total = len(json.dumps(body.get("tools"))) if body.get("tools") else 0
    for message in body["messages"]:
        content = message.get("content") or ""
        if isinstance(content, list):
            total += sum(len(p.get("text", "")) for p in content)
        else:
            total += len(content)
    return total


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

        def _reply(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                self.close_connection = True  # the client left: its answer goes nowhere

        def _error(self, status: int, message: str, kind: str) -> None:
            self._reply(status, {"error": {"message": message, "type": kind, "code": status}})

        def do_GET(self) -> None:
            key, route_ = route(self.path)
            if route_ == "/models":
                model = {"id": server.model_name, "object": "model", "owned_by": "meshrl"}
                self._reply(200, {"object": "list", "data": [model]})
            else:
                self._error(404, f"no route GET {self.path}", "not_found")

        def do_POST(self) -> None:
            key, route_ = route(self.path)
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
