"""An OpenAI-compatible endpoint in front of the policy replicas.

`PolicyServer` answers `/v1/chat/completions`, `/v1/completions` and
`/v1/models` on 127.0.0.1, to callers that send the run's token
(`Authorization: Bearer TOKEN`: the OpenAI client's `api_key`), drawn per
server with `secrets` and compared in constant time; any other call gets 401
and costs nothing. Whoever starts the server prints the token (`access`) and
keeps it in status.json (`status_fields`). Every request must also name the
server by a loopback address in its `Host` header (421 otherwise), so that a
web page whose name rebinds to 127.0.0.1 cannot reach it from a browser.

Its `Router` batches the requests that arrive together and sends each batch to
a free replica (`policy.generate`), as the rollout does with episodes. Every
answer carries the sampled `token_ids` and the weight version (`meshrl` field)
beside the usual OpenAI fields, and with `logprobs: true` the sampling
log-probs.

Requests under `/episodes/<key>~<secret>/v1/...` belong to one episode. The
secret is drawn per episode (128 random bits) and checked on every call, so no
other local process can write into an episode it was not handed: a call with an
unknown key, a wrong secret or an ended episode gets 404 and is counted
(`PolicyServer.refused`). The server keeps that episode's conversation as one token sequence (a `Transcript`), as
`meshrl.envs.rollout` does for its own multi-turn episodes:

- The model's tokens are kept as sampled, with their log-probs and version.
- Each later request must repeat the conversation so far: the same messages,
  the assistant's as they were answered. Only the new messages (tool results,
  user turns) are tokenized, once, and masked out of the loss.
- So the recorded ids are the sampler's ids, even with a chat template that
  renders earlier turns otherwise (Qwen3's drops old `<think>` blocks): the
  model is never shown a re-rendering that it did not sample from.

A request that changes an earlier message is refused (HTTP 400): that
conversation is not one sequence.

The endpoint is bounded, so that no client can stall the run that serves it:
bodies over `MAX_BODY_BYTES` get 413; a prompt too long for the model's context
is refused by its length in characters before it is tokenized: every field of
every message counts (role, name, tool calls, content parts), and so does the
text the chat template renders from them, checked before that text is
tokenized (`_BoundedTokenizer`); requests are answered by a fixed pool of
threads, each connection with a read timeout
(`meshrl.observe.front.BoundedServer`); every malformed request, an unknown
model name and a temperature or top_p out of range get 400; a client that
hangs up costs no traceback. `meshrl.envs.agent` plays an agent task's episodes
through this server.
"""

from __future__ import annotations

import hmac
import json
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

from meshrl.config import MAX_TEMPERATURE, MIN_TEMPERATURE
from meshrl.envs.endpoint_http import (
    MAX_BODY_BYTES,  # noqa: F401 - the endpoint's limits, importable from here
    READ_TIMEOUT_S,
    WORKERS,
    RequestError,
    asked_tokens,
    check_body,
    handler,
    number,
    text_chars,
)
from meshrl.envs.rollout import ChatFormat, share
from meshrl.model.tokenizer import max_token_chars
from meshrl.observe.front import BoundedServer
from meshrl.procs.mesh import RemoteCallError, wait


@dataclass
class Sampled:
    tokens: list[int]
    logprobs: list[float]
    version: int


@dataclass
class _Request:
    ids: list[int]
    max_tokens: int
    sampling: tuple[float, float]  # temperature, top_p
    future: Future = field(default_factory=Future)


class Router:
    """Requests from many threads, sent in batches to the policy replicas: a free
    replica takes its share of what is waiting (same sampling settings), so
    concurrent agents fill a batch as a rollout's episodes do. `actors()` gives
    the current policy actor mesh; `on_lost(role, error)` is told of a lost
    proc (the caller replaces the mesh)."""

    def __init__(
        self,
        actors: Callable[[], Any],
        replicas: int,
        generation: Any,
        timeout_s: float,
        on_lost: Callable[[str, RemoteCallError], None] | None = None,
    ):
        self.actors, self.generation, self.timeout_s = actors, generation, timeout_s
        self.on_lost = on_lost
        self.free = list(range(replicas))
        self.waiting: list[_Request] = []
        self.cond = threading.Condition()
        self.lost_lock = threading.Lock()
        self.closed = False
        self.generate_s = 0.0
        """Seconds the replicas spent on this router's batches (summed over batches)."""
        threading.Thread(target=self._dispatch, name="router", daemon=True).start()

    def generate(
        self, ids: list[int], max_tokens: int, temperature: float, top_p: float
    ) -> Sampled:
        request = _Request(ids, max_tokens, (temperature, top_p))
        with self.cond:
            if self.closed:
                raise RuntimeError("the policy endpoint is closed")
            self.waiting.append(request)
            self.cond.notify_all()
        return request.future.result()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            for request in self.waiting:
                request.future.set_exception(RuntimeError("the policy endpoint is closed"))
            self.waiting = []
            self.cond.notify_all()

    def _dispatch(self) -> None:
        while True:
            with self.cond:
                while not self.closed and not (self.waiting and self.free):
                    self.cond.wait()
                if self.closed:
                    return
                rank = self.free.pop(0)
                sampling = self.waiting[0].sampling
                same = [r for r in self.waiting if r.sampling == sampling]
                batch, _ = share(same, len(self.free) + 1)
                self.waiting = [r for r in self.waiting if all(r is not b for b in batch)]
            threading.Thread(target=self._send, args=(rank, batch), daemon=True).start()

    def _send(self, rank: int, batch: list[_Request]) -> None:
        temperature, top_p = batch[0].sampling
        generation = replace(
            self.generation,
            max_new_tokens=max(r.max_tokens for r in batch),
            min_new_tokens=0,
            temperature=temperature,
            top_p=top_p,
        )
        try:
            future = (
                self.actors()
                .slice(procs=rank)
                .generate.call_one([r.ids for r in batch], generation)
            )
            sent = time.perf_counter()
            result = wait(future, "policy.generate", self.timeout_s)
            with self.cond:
                self.generate_s += time.perf_counter() - sent
            rows = zip(result.completion_lists(), result.logprobs.tolist(), strict=True)
            for request, (tokens, logprobs) in zip(batch, rows, strict=True):
                tokens = tokens[: request.max_tokens]  # the batch sampled to its longest
                request.future.set_result(
                    Sampled(tokens, logprobs[: len(tokens)], result.weight_version)
                )
        except RemoteCallError as error:
            if error.proc_lost and self.on_lost is not None:
                with self.lost_lock:
                    self.on_lost("policy", error)
            for request in batch:
                request.future.set_exception(error)
        except Exception as error:  # noqa: BLE001 - the requests fail, the router goes on
            for request in batch:
                if not request.future.done():
                    request.future.set_exception(error)
        finally:
            with self.cond:
                self.free.append(rank)
                self.cond.notify_all()


@dataclass
class Transcript:
    """One episode's calls as one token sequence (the rollout's `EpisodeState` shape)."""

    max_calls: int
    secret: str = ""
    prompt_ids: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    messages: list[tuple[str, str]] = field(default_factory=list)  # chat: (role, text)
    text: str = ""  # completions: the prompt and the answers so far
    kind: str = ""  # "chat" or "completions", fixed by the first call
    calls: int = 0
    truncated: bool = False
    """A call came after the turn limit: the episode ended there, as a rollout's
    does at `max_turns` (`episodes/truncated`)."""
    last_turn: list[int] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def context(self) -> list[int]:
        return self.prompt_ids + self.tokens

    def continuation(self, fmt: ChatFormat, kind: str, body: dict) -> list[int]:
        """The ids that a request adds to the episode (the whole prompt on the first call)."""
        if self.kind and kind != self.kind:
            raise RequestError(f"an episode's calls are all {self.kind} calls; this is {kind}")
        if kind == "completions":
            prompt = body["prompt"]
            if not self.calls:
                return fmt.tokenizer(prompt).input_ids
            if not prompt.startswith(self.text):
                raise RequestError(
                    "the prompt does not continue the episode (the last prompt and its "
                    "completion, unchanged)"
                )
            return fmt.tokenizer(prompt[len(self.text) :], add_special_tokens=False).input_ids
        messages, tools = body["messages"], body.get("tools")
        if not self.calls:
            return fmt.conversation(messages, tools)
        seen = [_message(m) for m in messages[: len(self.messages)]]
        if seen != self.messages:
            raise RequestError(
                "the messages do not continue the episode: earlier messages (the "
                "assistant's as answered) must be sent unchanged"
            )
        new = messages[len(self.messages) :]
        if not new or any(m.get("role") == "assistant" for m in new):
            raise RequestError("a continuing request adds tool or user messages after the answer")
        return fmt.after_turn(new, self.last_turn, tools)

    def add(self, kind: str, body: dict, added: list[int], sampled: Sampled, text: str) -> None:
        first = not self.calls
        if first:
            self.prompt_ids = list(added)
        else:
            self.tokens += added
            self.loss_mask += [0] * len(added)
            self.logprobs += [0.0] * len(added)
            self.versions += [-1] * len(added)
        self.tokens += sampled.tokens
        self.loss_mask += [1] * len(sampled.tokens)
        self.logprobs += sampled.logprobs
        self.versions += [sampled.version] * len(sampled.tokens)
        self.kind, self.calls, self.last_turn = kind, self.calls + 1, sampled.tokens
        if kind == "completions":
            self.text = body["prompt"] + text
        else:
            self.messages = [_message(m) for m in body["messages"]] + [("assistant", text)]


LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
"""The names a request's `Host` may give this server by (with its port)."""


def _bytes(text: str) -> bytes:
    """`text` for `hmac.compare_digest`, which takes only ASCII strings (a header
    or a path may hold any latin-1 character)."""
    return text.encode("utf-8", "surrogateescape")


def _too_long(chars: int, context: int, what: str = "the prompt") -> str:
    return f"{what} ({chars} characters) cannot fit the model's context of {context} tokens"


class _BoundedTokenizer:
    """A tokenizer that refuses (`RequestError`) to tokenize a text longer than
    `most` characters, which cannot fit the context: whatever a chat template
    renders from a request is checked before it is tokenized. Everything else
    is the wrapped tokenizer's."""

    def __init__(self, inner: Any, context: int, token_chars: int):
        self.inner, self.context, self.most = inner, context, context * token_chars

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, text: Any, *args: Any, **kwargs: Any) -> Any:
        chars = len(text) if isinstance(text, str) else sum(len(t) for t in text)
        if chars > self.most:
            raise RequestError(_too_long(chars, self.context, "the prompt as rendered"))
        return self.inner(text, *args, **kwargs)


def _message(message: dict) -> tuple[str, str]:
    content = message.get("content") or ""
    if isinstance(content, list):  # OpenAI content parts: their text
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(message.get("role", "")), str(content)


class PolicyServer:
    """The endpoint: an HTTP server on 127.0.0.1:`port` (0: a free port) in a
    thread of this process. `sampling`: "run" samples every request at the
    run's temperature and top_p (what the trainer scores), "request" honours
    the request's (`meshrl serve`, where nothing trains)."""

    def __init__(
        self,
        router: Router,
        fmt: ChatFormat,
        context: int,
        port: int = 0,
        model_name: str = "meshrl-policy",
        sampling: str = "run",
        record_path: str | None = None,
        read_timeout_s: float = READ_TIMEOUT_S,
        token: str | None = None,
    ):
        self.router, self.context = router, context
        self.model_name, self.sampling = model_name, sampling
        self.record_path = record_path
        """Each answer's record (a JSON line: prompt and completion ids, log-probs,
        weight version, episode key) is appended here, when set."""
        self.episodes: dict[str, Transcript] = {}
        self.lock = threading.Lock()
        self.requests = 0
        self.refused = 0
        """Calls under `/episodes/` refused: no open episode with that key and secret."""
        self.token_chars = max_token_chars(fmt.tokenizer)
        """At most this many characters make one token: a text longer than the
        context times this cannot fit, and is refused before it is tokenized."""
        self.format = ChatFormat(_BoundedTokenizer(fmt.tokenizer, context, self.token_chars))
        """`fmt` with a tokenizer that refuses any text too long to fit (the
        rendered chat template's included) before tokenizing it."""
        self.token = token or secrets.token_urlsafe(32)
        """What a stateless route's caller must send (`Authorization: Bearer`)."""
        self.unauthorized = 0
        """Calls to the stateless routes refused for want of the token."""
        try:
            self.httpd = BoundedServer(
                ("127.0.0.1", port), handler(self), workers=WORKERS, timeout_s=read_timeout_s
            )
        except OSError as error:
            from meshrl.config import ConfigError

            raise ConfigError(
                f"config key 'policy.serve_port': cannot listen on 127.0.0.1:{port} "
                f"({error.strerror})"
            ) from None
        self.port = self.httpd.server_address[1]
        self.hosts = {f"{host}:{self.port}" for host in LOOPBACK_NAMES}
        """The `Host` headers accepted: this server by a loopback name."""
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def access(self) -> str:
        """One line for the console: where the endpoint is and how to call it."""
        return (
            f"{self.base_url} (send 'Authorization: Bearer {self.token}': "
            f"OpenAI(base_url=..., api_key=TOKEN); also in status.json)"
        )

    def status_fields(self) -> dict[str, str]:
        """What status.json keeps of the endpoint (written readable by its owner only)."""
        return {"endpoint_url": self.base_url, "endpoint_token": self.token}

    def host_problem(self, host: str | None) -> str:
        """'' when a request's `Host` header names this server, else why not."""
        if host is not None and host.strip().lower() in self.hosts:
            return ""
        return (
            f"Host {host!r} is not this endpoint: it answers to 127.0.0.1:{self.port}, "
            f"localhost:{self.port} or [::1]:{self.port} only"
        )

    def token_problem(self, authorization: str | None) -> str:
        """'' when an `Authorization` header carries the run's token, else why not."""
        scheme, _, offered = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not offered.strip():
            problem = "no token"
        elif hmac.compare_digest(_bytes(offered.strip()), _bytes(self.token)):
            return ""
        else:
            problem = "a wrong token"
        with self.lock:
            self.unauthorized += 1
        return (
            f"{problem}: this endpoint needs the run's token, printed at start and kept "
            "in status.json: send 'Authorization: Bearer TOKEN' (the OpenAI client's api_key)"
        )

    def episode_url(self, key: str) -> str:
        """The base URL only the agent of episode `key` is handed (its secret in it)."""
        with self.lock:
            transcript = self.episodes.get(key)
        secret = transcript.secret if transcript is not None else ""
        return f"http://127.0.0.1:{self.port}/episodes/{key}~{secret}/v1"

    def open(self, key: str, max_calls: int) -> str:
        """Open episode `key` for `max_calls` calls; returns its URL."""
        with self.lock:
            self.episodes[key] = Transcript(max_calls, secrets.token_urlsafe(16))
        return self.episode_url(key)

    def episode(self, segment: str) -> Transcript:
        """The open episode a URL's `<key>~<secret>` names, or LookupError (counted)."""
        key, _, secret = segment.partition("~")
        with self.lock:
            transcript = self.episodes.get(key)
            # Compared in constant time: the answer's timing tells nothing of the secret.
            if transcript is None or not hmac.compare_digest(
                _bytes(transcript.secret), _bytes(secret)
            ):
                self.refused += 1
                raise LookupError("no open episode at this URL (it ended, or never was)")
        return transcript

    def close_episode(self, key: str) -> Transcript | None:
        with self.lock:
            return self.episodes.pop(key, None)

    def close(self) -> None:
        self.router.close()
        self.httpd.shutdown()
        self.httpd.server_close()

    # --- answering --------------------------------------------------------------------------

    def answer(self, kind: str, body: dict, key: str | None) -> dict:
        """One request's OpenAI-shaped answer; under an episode `key`, recorded."""
        # Without a key: stateless, a one-call episode that nothing trains on.
        transcript = self.episode(key) if key is not None else Transcript(max_calls=1)
        check_body(kind, body)
        if body.get("model", self.model_name) != self.model_name:
            raise RequestError(
                f"model {body.get('model')!r} is not served here: {self.model_name!r}"
            )
        chars = text_chars(kind, body)
        if chars > self.context * self.token_chars:
            raise RequestError(_too_long(chars, self.context))
        sampling = self._sampling(body)
        limit = asked_tokens(body, self.router.generation.max_new_tokens)
        with self.lock:
            self.requests += 1
        with transcript.lock:  # an episode's calls come one after another
            if transcript.calls >= transcript.max_calls:
                # Past the turn limit the episode has ended: the call is answered
                # with nothing sampled (finish_reason "length"), and the agent
                # goes on to its reward.
                transcript.truncated = True
                return self._reply(kind, body, transcript.context(), "", None, [], "length", -1)
            added = transcript.continuation(self.format, kind, body)
            context = transcript.context() + added if transcript.calls else added
            room = self.context - len(context)
            if room <= 0:
                raise RequestError(
                    f"the conversation ({len(context)} tokens) fills the model's "
                    f"context of {self.context}"
                )
            max_tokens = min(room, limit)
            sampled = self.router.generate(context, max_tokens, *sampling)
            tokenizer = self.format.tokenizer
            text = tokenizer.decode(sampled.tokens, skip_special_tokens=True)
            transcript.add(kind, body, added, sampled, text)
        if self.record_path is not None:
            self._record(key, context, sampled)
        finish = "length" if len(sampled.tokens) >= max_tokens else "stop"
        return self._reply(
            kind, body, context, text, sampled.tokens, sampled.logprobs, finish, sampled.version
        )

    def _reply(
        self,
        kind: str,
        body: dict,
        context: list[int],
        text: str,
        tokens: list[int] | None,
        logprobs_: list[float] | None,
        finish: str,
        version: int,
    ) -> dict:
        """The OpenAI-shaped answer of one call."""
        tokens = tokens or []
        tokenizer = self.format.tokenizer
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        choice["token_ids"] = tokens
        logprobs = None
        if body.get("logprobs"):
            pieces = [tokenizer.decode([t]) for t in tokens]
            if kind == "chat":
                logprobs = {
                    "content": [
                        {"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
                        for p, lp in zip(pieces, logprobs_ or [], strict=True)
                    ]
                }
            else:
                logprobs = {"tokens": pieces, "token_logprobs": logprobs_ or []}
        choice["logprobs"] = logprobs
        if kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            "id": f"meshrl-{self.requests}",
            "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(context),
                "completion_tokens": len(tokens),
                "total_tokens": len(context) + len(tokens),
            },
            "meshrl": {"weight_version": version, "prompt_token_ids": context},
        }

    def _record(self, key: str | None, context: list[int], sampled: Sampled) -> None:
        line = json.dumps(
            {
                "episode": key,
                "prompt_ids": context,
                "completion_ids": sampled.tokens,
                "logprobs": sampled.logprobs,
                "weight_version": sampled.version,
            }
        )
        with self.lock, open(self.record_path, "a") as f:
            f.write(line + "\n")

    def _sampling(self, body: dict) -> tuple[float, float]:
        generation = self.router.generation
        temperature = body.get("temperature", generation.temperature)
        top_p = body.get("top_p", generation.top_p)
        if temperature is None:
            temperature = generation.temperature
        if top_p is None:
            top_p = generation.top_p
        # Checked whichever settings sample: a request is malformed or it is not.
        if not number(temperature) or not MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE:
            raise RequestError(
                f"temperature must be a number in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]"
            )
        if not number(top_p) or not 1e-6 <= top_p <= 1:
            raise RequestError("top_p must be a number in [1e-6, 1]")
        if self.sampling == "run":
            return generation.temperature, generation.top_p
        return float(temperature), float(top_p)
