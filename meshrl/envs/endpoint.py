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
a free replica (`policy.generate_top`), as the rollout does with episodes. Every
answer carries the sampled `token_ids`, the weight version and the sampling
settings used (`meshrl` field) beside the usual OpenAI fields. A request may
ask for greedy decoding (temperature 0), top_p, a seed, `n` samples, stop
strings, top log-probs and a stream, sent token by token as the replica samples
(`endpoint_http.read_request` checks them;
whatever the sampler cannot honour is refused in one line). With `tools`, the
model's tool-call text is parsed per model family (`meshrl.envs.tool_calls`)
into `tool_calls`; text that does not parse comes back as content, counted.
docs/environments.md has the table of what each field does.

Requests under `/episodes/<key>~<secret>/v1/...` belong to one episode. The
secret is drawn per episode (128 random bits) and checked on every call, so no
other local process can write into an episode it was not handed: a call with an
unknown key, a wrong secret or an ended episode gets 404 and is counted
(`PolicyServer.refused`). The server keeps that episode's conversation as one token sequence (a `Transcript`), as
`meshrl.envs.rollout` does for its own multi-turn episodes:

- The model's tokens are kept as sampled, with their log-probs and version
  (an answer cut at a stop string: up to the token that completed the match).
- Each later request must repeat the conversation so far: the same messages,
  the assistant's as they were answered (tool calls by name and arguments).
  Only the new messages (tool results, user turns) are tokenized, once, and
  masked out of the loss: a parsed tool call stays the tokens the model
  produced, never a rendering of the call.
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
model name or field and a temperature or top_p out of range get 400; a client that
hangs up costs no traceback. `meshrl.envs.agent` plays an agent task's episodes
through this server.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import math
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

from meshrl.envs.endpoint_http import (
    MAX_BODY_BYTES,  # noqa: F401 - the endpoint's limits, importable from here
    READ_TIMEOUT_S,
    WORKERS,
    Asked,
    RequestError,
    handler,
    read_request,
    text_chars,
)
from meshrl.envs.rollout import ChatFormat, share
from meshrl.envs.tool_calls import (
    PARSERS,
    ToolCall,
    ToolError,
    check_tools,
    chosen,
    forced_prefix,
    new_id,
    parse,
    parser_for_template,
    parser_name,
)
from meshrl.model.tokenizer import max_token_chars
from meshrl.observe.front import BoundedServer
from meshrl.procs.mesh import RemoteCallError, wait


@dataclass(frozen=True)
class Sampling:
    """How one request's samples are drawn."""

    temperature: float
    """0: greedy (each step's most likely token)."""
    top_p: float
    seed: int | None = None
    """The request's seed: its samples are a function of it (with the prompt, the
    settings and the weights), whatever the batch around them."""
    top_logprobs: int = 0
    stop: tuple[str, ...] = ()
    """The request's stop strings: the replica ends a sample at the token that
    completes one (decoding no further), and the answer is cut before it."""

    def batch_key(self) -> tuple:
        """Requests that one `policy.generate` call can sample together."""
        return (self.temperature, self.top_p, self.seed is not None, self.stop)


@dataclass
class Sampled:
    tokens: list[int]
    logprobs: list[float]
    version: int
    top: list[list[tuple[int, float]]] | None = None
    """Each token's most likely alternatives (id, log-prob), when asked for."""
    forced: int = 0
    """How many of the first tokens the endpoint put there to meet `tool_choice`
    (`forced_prefix`): not sampled, so log-prob 0 and masked in an episode's row."""

    def after(self, forced: list[int]) -> Sampled:
        """This sample after the tokens `forced` before it."""
        top = None if self.top is None else [[(t, 0.0)] for t in forced] + self.top
        logprobs = [0.0] * len(forced) + self.logprobs
        return Sampled(forced + self.tokens, logprobs, self.version, top, len(forced))

    def cut(self, kept: int) -> Sampled:
        """Its first `kept` tokens."""
        top = None if self.top is None else self.top[:kept]
        return Sampled(
            self.tokens[:kept], self.logprobs[:kept], self.version, top, min(self.forced, kept)
        )


def row_seed(seed: int, i: int) -> int:
    """Sample `i`'s seed of a request with `seed` and several samples (`n` <= 32)."""
    return ((seed << 5) + i) % 2**62


@dataclass
class _Request:
    ids: list[int]
    max_tokens: int
    sampling: Sampling
    seed: int | None = None
    future: Future = field(default_factory=Future)
    progress: queue.SimpleQueue | None = None
    """Where its tokens go as they are drawn (`Router.submit`)."""
    index: int = 0


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
        self.batches = self.rows = 0
        """Batches sent to the replicas, and the requests they held (rows per batch:
        how well concurrent agents fill a replica's batch)."""
        threading.Thread(target=self._dispatch, name="router", daemon=True).start()

    def generate(
        self, ids: list[int], max_tokens: int, sampling: Sampling, n: int = 1
    ) -> list[Sampled]:
        """`n` samples of the prompt `ids`, queued together so that they share a
        batch (and its prefill: `policy.share_prefix`) where a replica is free."""
        return [request.future.result() for request in self.submit(ids, max_tokens, sampling, n)]

    def submit(
        self,
        ids: list[int],
        max_tokens: int,
        sampling: Sampling,
        n: int = 1,
        progress: queue.SimpleQueue | None = None,
    ) -> list[_Request]:
        """`generate`'s requests, queued; each one's `future` gets its sample. With
        `progress`, each token drawn is put there as it comes, `(i, (token,
        logprob, top))` for sample `i`, and `(i, None)` once sample `i` is done
        (its future set)."""
        requests = [
            _Request(
                ids,
                max_tokens,
                sampling,
                None if sampling.seed is None else row_seed(sampling.seed, i),
                progress=progress,
                index=i,
            )
            for i in range(n)
        ]
        with self.cond:
            if self.closed:
                raise RuntimeError("the policy endpoint is closed")
            self.waiting += requests
            self.cond.notify_all()
        return requests

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
                key = self.waiting[0].sampling.batch_key()
                same = [r for r in self.waiting if r.sampling.batch_key() == key]
                batch, _ = share(same, len(self.free) + 1)
                self.waiting = [r for r in self.waiting if all(r is not b for b in batch)]
            threading.Thread(target=self._send, args=(rank, batch), daemon=True).start()

    def _send(self, rank: int, batch: list[_Request]) -> None:
        sampling = batch[0].sampling
        generation = replace(
            self.generation,
            max_new_tokens=max(r.max_tokens for r in batch),
            min_new_tokens=0,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
        )
        seeds = None if sampling.seed is None else [r.seed for r in batch]
        top = max(r.sampling.top_logprobs for r in batch)
        streamed = [r for r in batch if r.progress is not None]
        try:
            port = receiver = None
            if streamed:
                from monarch.actor import Channel

                port, receiver = Channel.open()
            future = (
                self.actors()
                .slice(procs=rank)
                .generate_top.call_one(
                    [r.ids for r in batch], generation, seeds, top, list(sampling.stop), port
                )
            )
            sent = time.perf_counter()
            if receiver is not None:
                self._relay(receiver, future, batch, sent)
            result, tops = wait(future, "policy.generate", self.timeout_s)
            with self.cond:
                self.generate_s += time.perf_counter() - sent
                self.batches, self.rows = self.batches + 1, self.rows + len(batch)
            rows = zip(result.completion_lists(), result.logprobs.tolist(), strict=True)
            for row, (request, (tokens, logprobs)) in enumerate(zip(batch, rows, strict=True)):
                tokens = tokens[: request.max_tokens]  # the batch sampled to its longest
                alternatives = None
                if request.sampling.top_logprobs:
                    k = request.sampling.top_logprobs
                    values, ids = (t[row, : len(tokens), :k].tolist() for t in tops)
                    alternatives = [
                        list(zip(i, v, strict=True)) for i, v in zip(ids, values, strict=True)
                    ]
                request.future.set_result(
                    Sampled(tokens, logprobs[: len(tokens)], result.weight_version, alternatives)
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
            for request in streamed:  # (after its future is set)
                request.progress.put((request.index, None))
            with self.cond:
                self.free.append(rank)
                self.cond.notify_all()

    def _relay(self, receiver: Any, call: Any, batch: list[_Request], sent: float) -> None:
        """Each step's tokens from the replica (`policy.generate_top`'s `progress`)
        to the requests that stream, each up to its own `max_tokens`, until the
        replica's end mark; or until the call failed or ran out of time (its error
        is the requests'), or returned without the mark coming (replies and port
        messages are not ordered with each other: it is waited for a little)."""
        counts = [0] * len(batch)
        pending, returned = receiver.recv(), None
        while True:
            try:
                steps = pending.get(timeout=0.2)
            except TimeoutError:
                now = time.perf_counter()
                if now - sent > self.timeout_s:
                    return
                try:
                    call.get(timeout=0)
                except TimeoutError:
                    continue  # still sampling
                except Exception:  # noqa: BLE001 - the call's error reaches its requests
                    return
                returned = returned or now
                if now - returned > 5.0:
                    return
                continue
            if steps is None:
                return
            pending = receiver.recv()
            for row, token, logprob, top in steps:
                request = batch[row]
                if request.progress is None or counts[row] >= request.max_tokens:
                    continue
                counts[row] += 1
                k = request.sampling.top_logprobs
                request.progress.put((request.index, (token, logprob, top[:k] if k else None)))


@dataclass
class Answer:
    """One sample as the client gets it (`PolicyServer._finish`)."""

    sampled: Sampled
    """The tokens kept (up to the stop string's), their log-probs and version."""
    text: str
    """The text: the message's content (chat) or the completion."""
    finish: str
    calls: list[ToolCall] = field(default_factory=list)
    reasoning: str | None = None
    tool_error: str = ""
    """Why the text's tool calls were not returned as `tool_calls` ('' if they were)."""

    def message(self) -> dict:
        message: dict[str, Any] = {"role": "assistant"}
        message["content"] = None if self.calls and not self.text else self.text
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in self.calls
            ]
        return message

    def answered(self, kind: str) -> dict:
        """What the client's next call in the episode repeats of this answer."""
        return self.message() if kind == "chat" else {"text": self.text}


@dataclass
class Reply:
    """A request's answer: `payload` as JSON, or with `stream` its `chunks()` as
    server-sent events."""

    payload: dict
    stream: bool
    chunks: Callable[[], Iterator[dict]] | None = None


@dataclass
class _Call:
    """One request to the endpoint, as it is answered (`PolicyServer.answer`)."""

    kind: str
    body: dict
    asked: Asked
    number: int
    sampling: Sampling
    said: dict
    """The answer's `meshrl.sampling`."""
    tools: tuple | None
    key: str | None
    transcript: Transcript | None
    context: list[int] = field(default_factory=list)
    """The prompt's tokens (an episode's whole sequence so far, and the new messages)."""
    added: list[int] = field(default_factory=list)
    """An episode's: the new messages' tokens."""
    max_tokens: int = 0
    forced: list[int] = field(default_factory=list)
    """The tokens the answers start with (`tool_choice`), not sampled."""


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
    messages: list[tuple] = field(default_factory=list)
    """Chat: each message as `_message` compares it (role, text, tool calls)."""
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
            return fmt.conversation([_for_template(m) for m in messages], tools)
        resent = _resent(messages, self.messages)
        if resent is None:
            raise RequestError(
                "the messages do not continue the episode: earlier messages (the "
                "assistant's as answered) must be sent unchanged"
            )
        new = messages[resent:]
        if not new or any(m.get("role") == "assistant" for m in new):
            raise RequestError("a continuing request adds tool or user messages after the answer")
        return fmt.after_turn(new, self.last_turn, tools)

    def add(
        self, kind: str, body: dict, added: list[int], sampled: Sampled, answered: dict
    ) -> None:
        """Record a call: `added` (the new messages' ids), the model's tokens as
        sampled, and `answered`, the message (chat) or text (completions) the
        client was given, which its next call must repeat."""
        first = not self.calls
        if first:
            self.prompt_ids = list(added)
        else:
            self.tokens += added
            self.loss_mask += [0] * len(added)
            self.logprobs += [0.0] * len(added)
            self.versions += [-1] * len(added)
        forced, drawn = sampled.forced, len(sampled.tokens) - sampled.forced
        self.tokens += sampled.tokens
        self.loss_mask += [0] * forced + [1] * drawn
        self.logprobs += sampled.logprobs
        self.versions += [-1] * forced + [sampled.version] * drawn
        self.kind, self.calls, self.last_turn = kind, self.calls + 1, sampled.tokens
        if kind == "completions":
            self.text = body["prompt"] + answered["text"]
        else:
            self.messages = [_message(m) for m in body["messages"]] + [_message(answered)]


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


def _for_template(message: dict) -> dict:
    """A message as chat templates take it: a tool call's arguments as an object
    (the `openai` client sends them as JSON text; templates write them with
    `tojson`, which would quote the text), where they parse."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    rendered = []
    for call in calls:
        function = call.get("function")
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            with contextlib.suppress(ValueError):
                arguments = json.loads(function["arguments"])
                if isinstance(arguments, dict):
                    call = {**call, "function": {**function, "arguments": arguments}}
        rendered.append(call)
    return {**message, "tool_calls": rendered}


def _resent(messages: list[dict], recorded: list[tuple]) -> int | None:
    """How many of `messages` resend the episode's conversation so far (`recorded`,
    as `_message` keeps it), or None when they do not.

    Each message is sent unchanged, except that an answer with tool calls may come
    back as text of the client's own: one or more assistant messages without
    `tool_calls` whose joined text holds the answer's content, each call's name
    and each of its arguments' values (smolagents sends `Calling tools: [...]`,
    the calls as Python writes them). The row keeps the model's tokens either way;
    an edited call (another name or value) is still refused."""
    at = 0
    for kept in recorded:
        if at < len(messages) and _message(messages[at]) == kept:
            at += 1
            continue
        role, content, calls = kept
        if role != "assistant" or not calls:
            return None
        texts = []
        while (
            at < len(messages)
            and messages[at].get("role") == "assistant"
            and not messages[at].get("tool_calls")
        ):
            texts.append(_message(messages[at])[1])
            at += 1
        text = "\n".join(texts)
        if not texts or content not in text or not all(_named(call, text) for call in calls):
            return None
    return at


def _named(call: tuple, text: str) -> bool:
    """Whether `text` names a call (name, arguments as `_message` keeps them) and
    every value of its arguments."""
    name, arguments = call
    if not isinstance(name, str) or name not in text:
        return False
    try:
        values = list(_leaves(json.loads(arguments)))
    except (TypeError, ValueError):
        return False
    return all(value in text for value in values)


def _leaves(value: Any) -> Iterator[str]:
    """A JSON value's scalars, as text (strings as they are)."""
    if isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, list):
        for item in value:
            yield from _leaves(item)
    elif isinstance(value, str):
        yield value
    elif value is not None:
        yield json.dumps(value)


def _message(message: dict) -> tuple[str, str, tuple]:
    """What must stay the same of a message that an episode's next call repeats:
    its role, its text and its tool calls (each by name and arguments, as JSON
    values: a framework may re-serialize the arguments, or draw its own ids)."""
    content = message.get("content") or ""
    if isinstance(content, list):  # OpenAI content parts: their text
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call.get("function"), dict) else {}
        arguments = function.get("arguments")
        with contextlib.suppress(TypeError, ValueError):  # else compared as it is
            arguments = json.dumps(json.loads(arguments), sort_keys=True)
        calls.append((function.get("name"), arguments))
    return str(message.get("role", "")), str(content), tuple(calls)


class _Listener(BoundedServer):
    """The endpoint's HTTP server, with a listen backlog for as many connections as
    it has threads: the standard library's 5 overflowed when 64 agents connected at
    once (the kernel dropped their handshakes; some clients gave up)."""

    request_queue_size = WORKERS


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
        tool_parser: str = "auto",
    ):
        self.router, self.context = router, context
        self.tool_parser = (
            parser_for_template(getattr(fmt.tokenizer, "chat_template", None))
            if tool_parser == "auto"
            else parser_name(tool_parser)
        )
        """How the model's tool calls are read (`meshrl.envs.tool_calls`): the
        parser named, or the one its chat template implies (None: none known,
        and a request with `tools` and a tool choice other than none is refused)."""
        self.tool_call_errors = 0
        """Answers whose tool-call text did not parse (returned as content)."""
        self.forced: dict[tuple[str, str], list[int]] = {}
        """(parser, tool_choice) -> the tokens an answer starts with to meet it."""
        self.tool_choice_unmet = 0
        """Answers without the tool call that `tool_choice` asked for (returned as
        they are: a format whose call opening is not forced, or a forced call the
        model did not finish)."""
        self._special_texts: list[str] | None = None
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
            self.httpd = _Listener(
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

    def answer(self, kind: str, body: dict, key: str | None) -> Reply:
        """One request's OpenAI-shaped answer; under an episode `key`, recorded.
        Everything a request can be refused for is checked before it is sampled
        (and before a stream's first chunk)."""
        transcript = self.episode(key) if key is not None else None
        asked = read_request(kind, body)
        if body.get("model", self.model_name) != self.model_name:
            raise RequestError(
                f"model {body.get('model')!r} is not served here: {self.model_name!r}"
            )
        chars = text_chars(kind, body)
        if chars > self.context * self.token_chars:
            raise RequestError(_too_long(chars, self.context))
        tools = self._tools(kind, body)
        sampling, said = self._sampling(asked)
        forced = self._forced(tools)
        if transcript is not None and asked.n != 1:
            raise RequestError("n must be 1 in an episode: its calls are one sequence of tokens")
        with self.lock:
            self.requests += 1
            number = self.requests
        call = _Call(kind, body, asked, number, sampling, said, tools, key, transcript)
        if transcript is None:  # stateless: nothing trains on it
            call.context = Transcript(max_calls=1).continuation(self.format, kind, body)
            return self._sample(call, forced)
        with transcript.lock:  # an episode's calls come one after another
            if transcript.calls >= transcript.max_calls:
                # Past the turn limit the episode has ended: the call is answered with
                # nothing sampled (finish_reason "length"), and the agent goes on to
                # its reward.
                transcript.truncated = True
                call.context = transcript.context()
                ended = Answer(Sampled([], [], -1), "", "length")
                return self._reply(call, [ended])
            call.added = transcript.continuation(self.format, kind, body)
            call.context = transcript.context() + call.added if transcript.calls else call.added
            # Recorded under this lock; a stream records its answer when it has it.
            return self._sample(call, forced)

    def _sample(self, call: _Call, forced: list[int]) -> Reply:
        """Send `call`'s samples to the router; its reply: the answers (when they
        come), or a stream that sends each token's text as it comes."""
        call.max_tokens = self._room(call.context, self._limit(call.asked))
        call.forced = forced if len(forced) < call.max_tokens else []
        if call.forced:
            call.said["forced"] = self.format.tokenizer.decode(call.forced)
            call.said["forced_tokens"] = len(call.forced)
        progress = queue.SimpleQueue() if call.asked.stream else None
        requests = self.router.submit(
            call.context + call.forced,
            call.max_tokens - len(call.forced),
            call.sampling,
            call.asked.n,
            progress,
        )
        if progress is not None:
            return Reply({}, True, lambda: self._stream(call, requests, progress))
        return self._reply(call, self._answers(call, requests))

    def _limit(self, asked: Asked) -> int:
        limit = self.router.generation.max_new_tokens
        return limit if asked.max_tokens is None else min(asked.max_tokens, limit)

    def _answers(self, call: _Call, requests: list[_Request]) -> list[Answer]:
        """The call's answers, once sampled: each as the client gets it, recorded
        in the episode (its lock held by the caller, or taken here for a stream)
        and in requests.jsonl."""
        samples = [r.future.result() for r in requests]
        if call.forced:
            samples = [s.after(call.forced) for s in samples]
        answers = [
            self._finish(call.kind, s, call.asked, call.max_tokens, call.tools) for s in samples
        ]
        transcript = call.transcript
        if transcript is not None:
            lock = transcript.lock if call.asked.stream else contextlib.nullcontext()
            with lock:
                message = answers[0].answered(call.kind)
                transcript.add(call.kind, call.body, call.added, answers[0].sampled, message)
        if self.record_path is not None:
            for answer in answers:
                self._record(call.key, call.context, answer.sampled)
        return answers

    def _forced(self, tools: tuple | None) -> list[int]:
        """The tokens an answer starts with to meet the request's `tool_choice`
        (`required`, a named function: `forced_prefix`), none for `auto` or
        where the model's template does not show how a call starts."""
        if tools is None:
            return []
        parser, choice = tools
        with self.lock:
            if (parser, choice) not in self.forced:
                tokenizer = self.format.tokenizer
                text = forced_prefix(tokenizer, parser, choice)
                ids = [] if text is None else tokenizer(text, add_special_tokens=False).input_ids
                self.forced[parser, choice] = ids
            return self.forced[parser, choice]

    def _room(self, context: list[int], limit: int) -> int:
        room = self.context - len(context)
        if room <= 0:
            raise RequestError(
                f"the conversation ({len(context)} tokens) fills the model's "
                f"context of {self.context}"
            )
        return min(room, limit)

    def _tools(self, kind: str, body: dict) -> tuple[str, str] | None:
        """(the parser, the tool choice) when the answer's tool calls are to be
        parsed; None when the request has no tools or `tool_choice: none`."""
        if kind != "chat":
            return None
        try:
            _, choice = check_tools(body.get("tools"), body.get("tool_choice"))
        except ToolError as error:
            raise RequestError(str(error)) from None
        if choice is None:
            return None
        if self.tool_parser is None:
            raise RequestError(
                "tools: no tool-call parser for this model (its chat template teaches no "
                f"format meshrl reads: {', '.join(PARSERS)}); name one in policy.tool_parser"
            )
        return self.tool_parser, choice

    def _sampling(self, asked: Asked) -> tuple[Sampling, dict]:
        """How the request's samples are drawn, and what the answer's `meshrl`
        field says of it: the settings used and, where the server's sampling is
        the run's ("run": the trainer scores those), which of the request's it
        overrode."""
        generation = self.router.generation
        stop = tuple(asked.stop or ())
        if self.sampling == "run":
            sampling = Sampling(
                generation.temperature, generation.top_p, None, asked.top_logprobs, stop
            )
            overridden = [
                name
                for name, value, used in (
                    ("temperature", asked.temperature, sampling.temperature),
                    ("top_p", asked.top_p, sampling.top_p),
                    ("seed", asked.seed, None),
                )
                if value is not None and value != used
            ]
        else:
            sampling = Sampling(
                generation.temperature if asked.temperature is None else asked.temperature,
                generation.top_p if asked.top_p is None else asked.top_p,
                asked.seed,
                asked.top_logprobs,
                stop,
            )
            overridden = []
        said = {"temperature": sampling.temperature, "top_p": sampling.top_p}
        said |= {"seed": sampling.seed, "overridden": overridden}
        return sampling, said

    def _finish(
        self, kind: str, sampled: Sampled, asked: Asked, max_tokens: int, tools: tuple | None
    ) -> Answer:
        """A sample as the client gets it: cut at the first stop string (its tokens
        with it: the row keeps what was sampled up to the stop), its tool calls
        parsed."""
        tokenizer = self.format.tokenizer
        finish = "length" if len(sampled.tokens) >= max_tokens else "stop"
        text = tokenizer.decode(sampled.tokens, skip_special_tokens=True)
        matched = ""
        if asked.stop:
            cut = stop_cut(
                sampled.tokens, asked.stop, lambda t: tokenizer.decode(t, skip_special_tokens=True)
            )
            if cut is not None:
                kept, text, matched = cut
                sampled = sampled.cut(kept)
                finish = "stop"
        answer = Answer(sampled, text, finish)
        if tools is None:
            return answer
        parser, choice = tools
        raw = tokenizer.decode(sampled.tokens, skip_special_tokens=False)
        if matched and matched in raw:
            raw = raw[: raw.index(matched)]
        parsed = parse(parser, self._trim(raw))
        problem = parsed.malformed or chosen(parsed, choice)
        with self.lock:
            self.tool_call_errors += bool(parsed.malformed)
            self.tool_choice_unmet += bool(problem and not parsed.malformed)
        if problem or not parsed.calls:
            answer.tool_error = problem  # the text comes back as it is, as content
            return answer
        calls = parsed.calls
        if not asked.parallel_tool_calls and len(calls) > 1:
            answer.tool_error = f"parallel_tool_calls is false: the first of {len(calls)} calls"
            calls = calls[:1]
        answer.calls = [ToolCall(c.name, c.arguments, c.id or new_id(parser)) for c in calls]
        answer.text = self._strip(parsed.content or "").strip()
        answer.reasoning = parsed.reasoning and self._strip(parsed.reasoning)
        answer.finish = "tool_calls"
        return answer

    def _specials(self) -> list[str]:
        """The tokenizer's special tokens' texts, longest first."""
        if self._special_texts is None:
            tokenizer = self.format.tokenizer
            texts = set(getattr(tokenizer, "all_special_tokens", []))
            for token in getattr(tokenizer, "added_tokens_decoder", {}).values():
                if getattr(token, "special", False):
                    texts.add(str(token))
            self._special_texts = sorted((t for t in texts if t), key=len, reverse=True)
        return self._special_texts

    def _trim(self, raw: str) -> str:
        """`raw` without the special tokens that end it (EOS, end of turn)."""
        trimmed = True
        while trimmed:
            raw, trimmed = raw.rstrip(), False
            for special in self._specials():
                if raw.endswith(special):
                    raw, trimmed = raw[: -len(special)], True
        return raw

    def _strip(self, text: str) -> str:
        for special in self._specials():
            text = text.replace(special, "")
        return text

    def _reply(self, call: _Call, answers: list[Answer]) -> Reply:
        """The OpenAI-shaped answer of one call (as one stream, when asked for)."""
        kind, asked = call.kind, call.asked
        choices = []
        for i, answer in enumerate(answers):
            choice: dict[str, Any] = {"index": i, "finish_reason": answer.finish}
            choice["token_ids"] = answer.sampled.tokens
            choice["logprobs"] = self._logprobs(kind, answer.sampled, asked, 0, None)
            if kind == "chat":
                choice["message"] = answer.message()
            else:
                choice["text"] = answer.text
            choices.append(choice)
        completion_tokens = sum(len(a.sampled.tokens) for a in answers)
        meshrl: dict[str, Any] = {
            "weight_version": min(a.sampled.version for a in answers),
            "prompt_token_ids": call.context,
            "sampling": call.said,
        }
        errors = [
            {"index": i, "error": a.tool_error} for i, a in enumerate(answers) if a.tool_error
        ]
        if errors:
            meshrl["tool_call_errors"] = errors
        payload = {
            "id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-meshrl-{call.number}",
            "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(call.context),
                "completion_tokens": completion_tokens,
                "total_tokens": len(call.context) + completion_tokens,
            },
            "meshrl": meshrl,
        }
        if not asked.stream:
            return Reply(payload, False)
        return Reply(payload, True, lambda: self._stream(call, [], None, answers))

    def _logprobs(
        self, kind: str, sampled: Sampled, asked: Asked, start: int, end: int | None
    ) -> dict | None:
        """The `logprobs` of the answer's tokens [start:end], as OpenAI shapes them
        per route; None when not asked for. A token outside top-p's nucleus has
        log-prob -inf, sent as -9999.0 (OpenAI's stand-in: JSON has no -inf)."""
        if not asked.logprobs:
            return None
        tokenizer = self.format.tokenizer
        k = asked.top_logprobs
        tokens, values = sampled.tokens[start:end], sampled.logprobs[start:end]
        alternatives = (sampled.top or [[]] * len(sampled.tokens))[start:end]

        def piece(token: int) -> str:
            return tokenizer.decode([token])

        def finite(value: float) -> float:
            return value if math.isfinite(value) else -9999.0

        if kind == "chat":
            content = []
            for token, value, top in zip(tokens, values, alternatives, strict=True):
                text = piece(token)
                entry = {"token": text, "logprob": finite(value), "bytes": list(text.encode())}
                entry["top_logprobs"] = [
                    {"token": (t := piece(i)), "logprob": finite(v), "bytes": list(t.encode())}
                    for i, v in top[:k]
                ]
                content.append(entry)
            return {"content": content}
        pieces = [piece(t) for t in tokens]
        offsets, at = [], 0
        for text in pieces:
            offsets.append(at)
            at += len(text)
        return {
            "tokens": pieces,
            "token_logprobs": [finite(v) for v in values],
            "top_logprobs": [{piece(i): finite(v) for i, v in top[:k]} for top in alternatives]
            if k
            else None,
            "text_offset": offsets,
        }

    def _stream(
        self,
        call: _Call,
        requests: list[_Request],
        progress: queue.SimpleQueue | None,
        answers: list[Answer] | None = None,
    ) -> Iterator[dict]:
        """The call's answers as OpenAI streams them, sent as they are sampled: per
        choice a chunk with the role (chat), then each token's text as the
        replica draws it (its ids and log-probs with it; text that may be the
        start of a stop string, or an unfinished character, waits for the next
        token), tool calls whole once parsed (a call's text is not sent as
        content), one chunk with the finish reason and the `meshrl` field; then,
        with `stream_options.include_usage`, one with no choices and the usage
        (every chunk before it has `usage: null`). The answers are recorded as
        when not streamed, also when the client leaves mid-stream. `answers`:
        already made (nothing left to sample)."""
        kind, asked = call.kind, call.asked
        chat = kind == "chat"
        base: dict[str, Any] = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-meshrl-{call.number}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
        }
        if asked.include_usage:
            base["usage"] = None

        def chunk(i: int, ids: list[int] | None = None, logprobs=None, **fields) -> dict:
            return {**base, "choices": [_chunk_choice(i, logprobs, ids, **fields)]}

        n = len(answers) if answers is not None else len(requests)
        # Each choice's tokens so far (a forced opening first), and how much of them
        # (tokens, text) the client has.
        drawn = [
            Sampled([], [], -1, [] if asked.top_logprobs else None).after(call.forced)
            for _ in range(n)
        ]
        sent = [(0, "")] * n
        try:
            if chat:
                for i in range(n):
                    yield chunk(i, delta={"role": "assistant", "content": ""})
            live = n if answers is None else 0
            while live:
                i, step = progress.get(timeout=self.router.timeout_s + 60)
                if step is None:
                    live -= 1
                    continue
                sampled = drawn[i]
                sampled.tokens.append(step[0])
                sampled.logprobs.append(step[1])
                if sampled.top is not None:
                    sampled.top.append(step[2] or [])
                if call.tools is not None:
                    continue  # sent whole, once parsed
                text = self._shown(sampled.tokens, asked.stop)
                got, shown = sent[i]
                if text is None or not text.startswith(shown) or text == shown:
                    continue
                logprobs = self._logprobs(kind, sampled, asked, got, None)
                piece = text[len(shown) :]
                content = {"delta": {"content": piece}} if chat else {"text": piece}
                yield chunk(i, sampled.tokens[got:], logprobs, **content)
                sent[i] = (len(sampled.tokens), text)
            if answers is None:
                answers = self._answers(call, requests)
            payload = self._reply(call, answers).payload
            for i, answer in enumerate(answers):
                got, shown = sent[i]
                tokens = answer.sampled.tokens
                rest = answer.text[len(shown) :] if answer.text.startswith(shown) else ""
                if got < len(tokens) or rest:
                    logprobs = self._logprobs(kind, answer.sampled, asked, got, None)
                    content = {"delta": {"content": rest}} if chat else {"text": rest}
                    yield chunk(i, tokens[got:], logprobs, **content)
                if answer.calls:
                    calls = answer.message()["tool_calls"]
                    tool_calls = [{"index": j, **c} for j, c in enumerate(calls)]
                    yield chunk(i, delta={"tool_calls": tool_calls})
                end = {"delta": {}} if chat else {"text": ""}
                yield {**chunk(i, finish_reason=answer.finish, **end), "meshrl": payload["meshrl"]}
            if asked.include_usage:
                yield {
                    **base,
                    "choices": [],
                    "usage": payload["usage"],
                    "meshrl": payload["meshrl"],
                }
        except Exception as error:  # noqa: BLE001 - the headers are sent: the failure
            # goes as the stream's last event, as OpenAI's streams send one.
            message = str(error).splitlines()[0][:500] if str(error) else type(error).__name__
            yield {"error": {"message": message, "type": "server_error", "code": 503}}
        finally:
            if answers is None and requests:  # the client left: the samples still count
                with contextlib.suppress(Exception):
                    self._answers(call, requests)

    def _shown(self, tokens: list[int], stops: list[str]) -> str | None:
        """The text of `tokens` a stream may send now: up to a stop string in it,
        less an end that may be the start of one; None while it ends inside a
        character."""
        text = self.format.tokenizer.decode(tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return None
        found = [text.find(stop) for stop in stops if stop in text]
        if found:
            return text[: min(found)]
        held = max(
            (k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])),
            default=0,
        )
        return text[: len(text) - held]

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


def _chunk_choice(
    index: int, logprobs: dict | None = None, token_ids: list[int] | None = None, **fields: Any
) -> dict:
    choice = {"index": index, **fields, "logprobs": logprobs}
    choice.setdefault("finish_reason", None)
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def stop_cut(
    tokens: list[int], stops: list[str], decode: Callable[[list[int]], str]
) -> tuple[int, str, str] | None:
    """Where the first of `stops` ends a sample: (the fewest tokens whose text
    holds it, the text before it, the stop string), or None when the text holds
    none. The token that completes the match is kept: it was sampled, and may
    carry text past the match (the client's text ends before the match)."""
    text = decode(tokens)
    found = [(text.find(stop), stop) for stop in stops if stop in text]
    if not found:
        return None
    at, stop = min(found)
    low, high = 1, len(tokens)  # the shortest prefix whose text holds the match
    while low < high:
        middle = (low + high) // 2
        if stop in decode(tokens[:middle]):
            high = middle
        else:
            low = middle + 1
    return low, text[:at], stop
