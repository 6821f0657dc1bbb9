"""The policy endpoint refuses what it cannot serve before it costs the run
anything (`meshrl.envs.endpoint`): oversized bodies, prompts too long to fit, malformed
requests, unknown models, temperatures that overflow, idle connections, clients
that hang up. None of these requests reaches a replica, so the server here has
none behind it."""

from __future__ import annotations

import http.client
import json
import socket
import time

import pytest

from meshrl.config import GenerationConfig
from meshrl.envs.endpoint import MAX_BODY_BYTES, PolicyServer, Router
from meshrl.envs.rollout import ChatFormat
from meshrl.model.tokenizer import build_char_tokenizer

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


class CountingTokenizer:
    """The char tokenizer, counting the characters it was asked to tokenize."""

    def __init__(self):
        self.inner, self.chars = build_char_tokenizer(), 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, text, **kwargs):
        self.chars += len(text) if isinstance(text, str) else sum(map(len, text))
        return self.inner(text, **kwargs)


@pytest.fixture(scope="module")
def served():
    router = Router(lambda: None, 1, GenerationConfig(max_new_tokens=4), timeout_s=5)
    tokenizer = CountingTokenizer()
    served = PolicyServer(router, ChatFormat(tokenizer), context=64, read_timeout_s=1.0)
    served.counting = tokenizer
    yield served
    served.close()


@pytest.fixture
def server(served):
    served.counting.chars = 0
    return served


def post(server, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request("POST", path, body=body, headers=headers or {})
        answer = conn.getresponse()
        return answer.status, json.loads(answer.read() or b"{}")
    finally:
        conn.close()


def chat(**fields) -> bytes:
    body = {"model": "meshrl-policy", "messages": [{"role": "user", "content": "12>"}], **fields}
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    "body, says",
    [
        (b"{not json", "Expecting property name"),
        (b"[1, 2]", "must be a JSON object"),
        (b"\xff\xfe{}", "Expecting value"),
        (json.dumps({"messages": "hi"}).encode(), "non-empty list"),
        (json.dumps({"messages": [1, 2]}).encode(), "messages[0] must be an object"),
        (json.dumps({"messages": [{"role": "user", "content": 3}]}).encode(), "content must be"),
        (chat(n="x"), "n must be 1"),
        (chat(max_tokens=True), "max_tokens must be a positive integer"),
        (chat(tools="x"), "'tools' must be a list"),
        (chat(model="gpt-4o"), "model 'gpt-4o' is not served here"),
        (chat(temperature=1e-39), "temperature must be a number in"),
        (chat(temperature="hot"), "temperature must be a number in"),
        (chat(top_p=float("nan")), "top_p must be a number"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_every_malformed_request_gets_400_with_its_reason(server, body, says):
    status, answer = post(server, "/v1/chat/completions", body)
    assert status == 400 and says in answer["error"]["message"]
    assert server.counting.chars == 0  # refused before any tokenizing


def test_a_body_over_the_limit_is_refused_unread(server):
    conn = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    with conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
            + f"Content-Length: {300 << 20}\r\n\r\n".encode()
            + b"{"
        )
        head = b""
        while chunk := conn.recv(65536):
            head += chunk
        head = head.decode()
    assert head.startswith("HTTP/1.0 413") and f"over {MAX_BODY_BYTES} bytes" in head


def test_a_prompt_longer_than_the_context_can_hold_is_refused_before_tokenizing(server):
    """5 MB of prompt: refused by its length in characters (the char tokenizer's
    tokens are one character at most), never tokenized."""
    body = json.dumps({"model": "meshrl-policy", "prompt": "7" * (5 << 20)}).encode()
    status, answer = post(server, "/v1/completions", body)
    assert (
        status == 400
        and "cannot fit the model's context of 64 tokens" in answer["error"]["message"]
    )
    assert server.counting.chars == 0


def test_idle_connections_are_cut_and_do_not_hold_the_server(server):
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(40)]
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("GET", "/v1/models")
        assert json.loads(conn.getresponse().read())["data"][0]["id"] == "meshrl-policy"
        conn.close()
        idle[0].settimeout(10)
        assert idle[0].recv(1) == b""  # the server closed it after its read timeout
    finally:
        for s in idle:
            s.close()


def test_a_client_that_hangs_up_costs_no_traceback(server, capfd):
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 10\r\n\r\n{")
        s.close()
    time.sleep(1.5)  # past the read timeout: every handler has given up
    status, _ = post(server, "/v1/chat/completions", chat(model="other"))
    assert status == 400  # the server still answers
    captured = capfd.readouterr()
    assert "Traceback" not in captured.err + captured.out
