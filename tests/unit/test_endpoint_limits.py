"""The policy endpoint refuses what it cannot serve before it costs the run
anything (`meshrl.envs.endpoint`): callers without the run's token, requests
that name another host, oversized bodies, prompts too long to fit (every field
of every message counted, and the rendered chat template), malformed requests,
unknown models, temperatures that overflow, idle connections, clients that hang
up. None of these requests reaches a replica: the server here has a stand-in
router that records what it would have generated, and answers the rest."""

from __future__ import annotations

import http.client
import json
import socket
import time

import pytest

from meshrl.config import GenerationConfig
from meshrl.envs.endpoint import MAX_BODY_BYTES, PolicyServer, Router, Sampled, _Request
from meshrl.envs.rollout import ChatFormat
from meshrl.model.tokenizer import build_char_tokenizer
from tests.support import other_user

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


SEVEN = build_char_tokenizer()("7", add_special_tokens=False).input_ids


class RecordingRouter(Router):
    """No replica: each prompt that would be generated is recorded, and answered "7"."""

    def __init__(self):
        super().__init__(lambda: None, 1, GenerationConfig(max_new_tokens=4), timeout_s=5)
        self.asked: list[list[int]] = []

    def submit(self, ids, max_tokens, sampling, n=1, progress=None):
        self.asked.append(list(ids))
        requests = [
            _Request(ids, max_tokens, sampling, progress=progress, index=i) for i in range(n)
        ]
        for request in requests:
            request.future.set_result(Sampled(SEVEN, [-0.5], version=0))
            if progress is not None:
                progress.put((request.index, None))
        return requests


def start(tokenizer=None) -> PolicyServer:
    tokenizer = tokenizer or CountingTokenizer()
    served = PolicyServer(RecordingRouter(), ChatFormat(tokenizer), context=64, read_timeout_s=1.0)
    served.counting = tokenizer
    return served


@pytest.fixture(scope="module")
def served():
    served = start()
    yield served
    served.close()


@pytest.fixture
def server(served):
    served.counting.chars = 0
    served.router.asked.clear()
    return served


def post(
    server, path: str, body: bytes, headers: dict | None = None, token: str | None = ""
) -> tuple[int, dict]:
    """POST with the server's token (`token=None`: without one)."""
    headers = dict(headers or {})
    if token is not None:
        headers["Authorization"] = f"Bearer {token or server.token}"
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request("POST", path, body=body, headers=headers)
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
        (chat(n="x"), "n must be an integer in [1, 16]"),
        (chat(n=17), "n must be an integer in [1, 16]"),
        (chat(stop=["a", "b", "c", "d", "e"]), "stop must be a non-empty string or a list"),
        (chat(stop=[""]), "stop must be a non-empty string or a list"),
        (chat(logprobs=True, top_logprobs=21), "top_logprobs must be an integer in [0, 20]"),
        (chat(top_logprobs=2), "top_logprobs needs logprobs: true"),
        (chat(seed=1.5), "seed must be an integer"),
        (chat(stream_options={"include_usage": True}), "only allowed with stream: true"),
        (chat(frequency_penalty=0.5), "frequency_penalty is not supported here"),
        (chat(logit_bias={"7": 100}), "logit_bias is not supported here"),
        (chat(response_format={"type": "json_object"}), "response_format is not supported"),
        (chat(top_k=5), "unrecognized request argument: top_k"),
        (chat(tools=[{"type": "function"}]), "tools[0] must be"),
        (chat(tool_choice="required"), "tool_choice 'required' needs tools"),
        (chat(max_tokens=True), "max_tokens must be a positive integer"),
        (chat(tools="x"), "'tools' must be a list"),
        (chat(model="gpt-4o"), "model 'gpt-4o' is not served here"),
        (chat(temperature=1e-39), "temperature must be 0 (greedy) or a number in"),
        (chat(temperature="hot"), "temperature must be 0 (greedy) or a number in"),
        (chat(top_p=float("nan")), "top_p must be a number"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_every_malformed_request_gets_400_with_its_reason(server, body, says):
    status, answer = post(server, "/v1/chat/completions", body)
    assert status == 400 and says in answer["error"]["message"]
    assert server.counting.chars == 0  # refused before any tokenizing
    assert not server.router.asked


def test_a_body_over_the_limit_is_refused_unread(server):
    conn = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    with conn:
        conn.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n".encode()
            + f"Authorization: Bearer {server.token}\r\n".encode()
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
        conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {server.token}"})
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


# --- who may call ---------------------------------------------------------------------------


def get(server, path: str, headers: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request("GET", path, headers=headers or {})
        answer = conn.getresponse()
        return answer.status, json.loads(answer.read() or b"{}")
    finally:
        conn.close()


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer ", "Bearer not-the-token", "Basic bWVzaHJsOng=", "not-the-token"],
    ids=["none", "empty", "wrong", "basic", "no-scheme"],
)
def test_the_stateless_routes_refuse_a_caller_without_the_token(server, authorization):
    """401, shaped like OpenAI's answer to a bad api_key, on every stateless
    route; nothing is tokenized or generated. With the token, the same request
    is answered."""
    headers = {} if authorization is None else {"Authorization": authorization}
    refused_before = server.unauthorized
    for path, body in [
        ("/v1/chat/completions", chat()),
        ("/v1/completions", json.dumps({"prompt": "12>"}).encode()),
    ]:
        status, answer = post(server, path, body, headers, token=None)
        assert status == 401, answer
        assert answer["error"]["type"] == "invalid_request_error"
        assert answer["error"]["code"] == "invalid_api_key"
        assert "Authorization: Bearer TOKEN" in answer["error"]["message"]
    status, answer = get(server, "/v1/models", headers)
    assert status == 401 and answer["error"]["code"] == "invalid_api_key"
    assert server.unauthorized == refused_before + 3
    assert server.counting.chars == 0 and not server.router.asked
    status, answer = post(server, "/v1/chat/completions", chat())  # with the token
    assert status == 200 and answer["choices"][0]["message"]["content"] == "7"
    assert len(server.router.asked) == 1


def test_the_openai_client_sends_the_token_as_its_api_key(server):
    from openai import AuthenticationError, OpenAI

    client = OpenAI(base_url=server.base_url, api_key=server.token, max_retries=0)
    assert [m.id for m in client.models.list()] == ["meshrl-policy"]
    out = client.chat.completions.create(
        model="meshrl-policy", messages=[{"role": "user", "content": "12>"}]
    )
    assert out.choices[0].message.content == "7"
    stranger = OpenAI(base_url=server.base_url, api_key="sk-guess", max_retries=0)
    with pytest.raises(AuthenticationError, match="a wrong token"):
        stranger.chat.completions.create(
            model="meshrl-policy", messages=[{"role": "user", "content": "12>"}]
        )
    assert len(server.router.asked) == 1


AS_ANOTHER_USER = """
import http.client, json, os, sys
port = int(sys.argv[1])
seen = {"uid": os.getuid()}
for path in ("/v1/chat/completions", "/v1/models"):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    body = json.dumps({"messages": [{"role": "user", "content": "hijacked"}]})
    conn.request("POST" if "chat" in path else "GET", path, body if "chat" in path else None)
    answer = conn.getresponse()
    seen[path] = [answer.status, json.loads(answer.read())["error"]["code"]]
print(json.dumps(seen))
"""


@pytest.mark.skipif(not other_user.available(), reason="needs root and setpriv")
def test_another_local_user_is_refused(server):
    """A process of another user (nobody, uid 65534) that knows the port: 401 on
    every stateless route, and nothing is generated from its prompt."""
    out = other_user.as_nobody(AS_ANOTHER_USER, str(server.port), timeout=30)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout)
    assert seen == {
        "uid": 65534,
        "/v1/chat/completions": [401, "invalid_api_key"],
        "/v1/models": [401, "invalid_api_key"],
    }
    assert not server.router.asked and server.counting.chars == 0


def test_an_episode_url_needs_no_token_only_its_secret(server):
    """An agent's episode URL is its own credential, as before: no token needed
    (whatever api_key its client sends); a wrong secret is 404, GET included."""
    url = server.open("limits.e1", 2)
    path = url.split(str(server.port), 1)[1]
    status, answer = post(server, f"{path}/chat/completions", chat(), token="unused-api-key")
    assert status == 200 and answer["choices"][0]["message"]["content"] == "7"
    status, answer = post(server, f"{path}/chat/completions", chat(), token=None)
    assert status == 400 and "do not continue the episode" in answer["error"]["message"]
    assert get(server, f"{path}/models")[0] == 200
    key = path.split("/")[2].partition("~")[0]
    assert get(server, f"/episodes/{key}~wrong/v1/models")[0] == 404
    request = f"GET /episodes/{key}~\u00e9/v1/models HTTP/1.0\r\nHost: 127.0.0.1:{server.port}"
    assert raw(server, request.encode("latin-1") + b"\r\n\r\n")[0] == 404  # not ASCII
    server.close_episode("limits.e1")
    assert len(server.router.asked) == 1


def raw(server, request: bytes) -> tuple[int, dict]:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
        conn.sendall(request)
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


@pytest.mark.parametrize(
    "host",
    ["evil.example", "evil.example:{port}", "127.0.0.1:1", "127.0.0.2:{port}", "", None],
    ids=["name", "name-and-port", "other-port", "other-address", "empty", "missing"],
)
def test_a_request_for_another_host_is_refused(server, host):
    """A page whose name rebinds to 127.0.0.1 sends its own name as Host: 421,
    token or not, and nothing is generated; an episode URL alike."""
    url = server.open("limits.host", 2)
    episode = url.split(str(server.port), 1)[1]
    for path in ("/v1/chat/completions", f"{episode}/chat/completions"):
        lines = [f"POST {path} HTTP/1.1"]
        if host is not None:
            lines.append(f"Host: {host.format(port=server.port)}")
        body = chat()
        lines += [f"Authorization: Bearer {server.token}", f"Content-Length: {len(body)}"]
        status, answer = raw(server, "\r\n".join(lines).encode() + b"\r\n\r\n" + body)
        assert status == 421 and "is not this endpoint" in answer["error"]["message"]
    server.close_episode("limits.host")
    assert not server.router.asked and server.counting.chars == 0


@pytest.mark.parametrize("name", ["127.0.0.1", "localhost", "LOCALHOST", "[::1]"])
def test_the_loopback_names_of_the_server_are_its_hosts(server, name):
    status, _ = post(server, "/v1/chat/completions", chat(), {"Host": f"{name}:{server.port}"})
    assert status == 200


# --- every field counts ---------------------------------------------------------------------

BIG = "x" * 100_000  # the context holds 64 tokens of at most 5 characters


@pytest.mark.parametrize(
    "message",
    [
        {"role": "user", "name": BIG, "content": "12>"},
        {"role": BIG, "content": "12>"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": BIG}}
            ],
        },
        {"role": "user", "content": [{"type": "text", "text": "12>", "note": BIG}]},
        {"role": "user", "content": "12>", BIG[:5000]: 1},
    ],
    ids=["name", "role", "tool_calls", "content-part-field", "unknown-key"],
)
def test_every_field_of_every_message_counts_toward_the_bound(server, message):
    """The fields the content check missed: refused by their length, before any
    tokenizing and without generating (until now they were tokenized, or sent
    to the chat template, whatever their size)."""
    body = json.dumps({"model": "meshrl-policy", "messages": [message]}).encode()
    status, answer = post(server, "/v1/chat/completions", body)
    assert status == 400, answer
    assert "cannot fit the model's context of 64 tokens" in answer["error"]["message"]
    assert server.counting.chars == 0 and not server.router.asked


@pytest.mark.parametrize(
    "message, says",
    [
        ({"role": "user", "name": 3, "content": "12>"}, "messages[0].name must be a string"),
        ({"role": "assistant", "tool_calls": "x"}, "tool_calls must be a list of objects"),
        ({"role": "assistant", "tool_calls": [1]}, "tool_calls must be a list of objects"),
    ],
)
def test_names_and_tool_calls_of_the_wrong_type_get_400(server, message, says):
    body = json.dumps({"messages": [message]}).encode()
    status, answer = post(server, "/v1/chat/completions", body)
    assert status == 400 and says in answer["error"]["message"]


def test_the_rendered_chat_template_counts_too():
    """A template may render a short message many times (here 20): the text it
    renders is refused by its length before it is tokenized; a short rendering
    is answered."""
    tokenizer = CountingTokenizer()
    tokenizer.inner.chat_template = (
        "{%- for m in messages -%}{%- for _ in range(20) -%}{{ m['content'] }}"
        "{%- endfor -%}{%- endfor -%}"
    )
    server = start(tokenizer)
    try:
        text = "0123456789012345678>"
        long_ = json.dumps({"messages": [{"role": "user", "content": text}]}).encode()
        status, answer = post(server, "/v1/chat/completions", long_)
        assert status == 400, answer
        assert answer["error"]["message"].startswith("the prompt as rendered (400 characters)")
        assert tokenizer.chars == 0 and not server.router.asked
        short = json.dumps({"messages": [{"role": "user", "content": "1"}]}).encode()
        status, answer = post(server, "/v1/chat/completions", short)
        assert status == 200 and [len(ids) for ids in server.router.asked] == [20]
    finally:
        server.close()
