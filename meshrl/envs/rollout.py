"""Multi-turn episodes over the policy and environment meshes, token in, token out.

`run_episodes` plays one episode per prompt: the model's turn (generated on a
policy replica), the environment's reply (stepped on an environment proc),
and so on, until the episode is done, reaches its turn limit or fills the
context. Each episode is kept as token ids:

- The model's tokens are appended as sampled, with their log-probs and the
  weight version that sampled them.
- The environment's replies are tokenized once and appended.
- Nothing already in an episode is tokenized again.

The result is one `Completions` row per episode. `completion_mask` is 1 on the
model's tokens only, so the loss skips the environment's.
`completion_attention` is 1 on every token.

Episodes do not move in lockstep. As soon as a replica is free it generates
for every episode that is ready, while other episodes wait on their tools on
the environment procs. Each proc runs many episode steps at once in threads.
This is what hides tool latency (`benchmarks/rollout_latency.py`).

An episode whose environment step raised, timed out or returned garbage is
marked failed with the reason. So is one whose proc was lost. The caller
drops its group and samples another.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from meshrl.model.vision import ImageError, VisionFormat, pile, shard, stack
from meshrl.procs.mesh import RemoteCallError, wait
from meshrl.types import Completions, Prompt


class ChatFormat:
    """Prompt and environment-reply tokens, through the tokenizer's chat template
    when it has one (the prompt as a user message, a reply as a tool message),
    else the plain text."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.chat = bool(getattr(tokenizer, "chat_template", None))

    def prompts(self, texts: list[str]) -> list[list[int]]:
        if not self.chat:
            return self.tokenizer(texts).input_ids  # one batch call
        rendered = [
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
            for text in texts
        ]
        return self.tokenizer(rendered, add_special_tokens=False).input_ids

    def conversation(self, messages: list[dict], tools: list | None = None) -> list[int]:
        """A conversation's tokens, up to the model's turn: with the chat template
        and its generation prompt, else the messages' texts one after another."""
        if not self.chat:
            return self.tokenizer("".join(str(m.get("content") or "") for m in messages)).input_ids
        rendered = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
        return self.tokenizer(rendered, add_special_tokens=False).input_ids

    def reply(self, text: str, turn: list[int] | None = None) -> list[int]:
        """An environment reply's tokens (a tool message), after the model's `turn`."""
        return self.after_turn([{"role": "tool", "content": text}], turn)

    def after_turn(
        self, messages: list[dict], turn: list[int] | None = None, tools: list | None = None
    ) -> list[int]:
        """The tokens of `messages` (tool results, user turns) that follow the
        model's `turn` (its tokens), up to the model's next turn.

        With a chat template they start with whatever the template puts after
        an assistant message that the model did not sample: the text after its
        end-of-turn token (ChatML's newline after `<|im_end|>`), or the whole
        closing when the turn was cut at max_new_tokens. So the episode's ids
        are the template's rendering of the same conversation, except that the
        model's own turns stay as sampled even where the template would render
        an earlier turn otherwise (drop a `<think>` block)."""
        if not self.chat:
            text = "".join(str(m.get("content") or "") for m in messages)
            return self.tokenizer(text, add_special_tokens=False).input_ids
        text = self.after_turn_text(messages, turn, tools)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def after_turn_text(
        self, messages: list[dict], turn: list[int] | None, tools: list | None = None, by=None
    ) -> str:
        """`after_turn`'s text, rendered by `by`'s chat template (a VLM's processor,
        for messages with images; default: the tokenizer's)."""
        by = by or self.tokenizer
        # Render with and without the new messages and keep the difference
        # (system prompts and the like that a template adds at the start cancel out).
        base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}]
        before = by.apply_chat_template(base, tools=tools, tokenize=False)
        after = by.apply_chat_template(
            [*base, *messages], tools=tools, add_generation_prompt=True, tokenize=False
        )
        if not after.startswith(before):
            raise ValueError("the chat template renders an episode's start differently per turn")
        closing = before[before.rindex(_MARK) + len(_MARK) :]  # after the assistant's text
        if turn:
            stop = self.tokenizer.decode(turn[-1:])
            if stop and closing.startswith(stop):  # the model ended its turn itself
                closing = closing[len(stop) :]
        return closing + after[len(before) :]


_MARK = "\u2063turn\u2063"
"""Stands for an assistant message's text while rendering the template around it."""


@dataclass
class EpisodeState:
    key: str
    prompt: Prompt
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)
    turns: int = 0
    reward: float = 0.0
    done: bool = False
    failed: str = ""
    truncated: bool = False
    info: Counter = field(default_factory=Counter)
    last_action: str = ""
    last_turn: list[int] = field(default_factory=list)
    final: bool = False
    images: list = field(default_factory=list)
    """[C, H, W] pixels of the episode's images, in the order of their tokens."""

    def context(self) -> list[int]:
        return self.prompt_ids + self.tokens


class Waiter:
    """Wait for whichever of many Monarch futures finishes first (a thread each)."""

    def __init__(self, timeout_s: float):
        self.done: queue.Queue = queue.Queue()
        self.timeout_s = timeout_s
        self.in_flight = 0

    def add(self, tag: Any, future: Any, what: str) -> None:
        def get() -> None:
            try:
                self.done.put((tag, wait(future, what, self.timeout_s), None))
            except RemoteCallError as error:
                self.done.put((tag, None, error))

        self.in_flight += 1
        threading.Thread(target=get, daemon=True).start()

    def next(self) -> tuple[Any, Any, RemoteCallError | None]:
        self.in_flight -= 1
        return self.done.get()


def run_episodes(
    prompts: list[Prompt],
    actors: Callable[[str], Any],
    num_policy: int,
    num_env: int,
    fmt: ChatFormat,
    generation: Any,
    max_turns: int,
    context: int,
    timeout_s: float,
    on_lost: Callable[[str, RemoteCallError], None] | None = None,
    key_prefix: str = "",
    vision: VisionFormat | None = None,
) -> tuple[list[EpisodeState], dict[str, float]]:
    """Play one episode per prompt; returns the episodes (in prompt order) and
    timing metrics. `actors(role)` gives the current actor mesh of `policy` and
    `environment`; `on_lost(role, error)` is told of a lost proc (the caller
    replaces its mesh, and later calls go to the new one). `vision`: a VLM's
    format, for images in prompts and replies (`meshrl.model.vision`)."""
    started = time.perf_counter()
    tokenizer = fmt.tokenizer
    ids, pixels = encode_prompts(fmt, vision, prompts)
    episodes = [
        EpisodeState(f"{key_prefix}{i}", p, x, images=[] if px is None else list(px))
        for i, (p, x, px) in enumerate(zip(prompts, ids, pixels, strict=True))
    ]
    ready = list(range(len(episodes)))  # waiting for the model
    acted: list[int] = []  # waiting for the environment
    free_policy, free_env = list(range(num_policy)), list(range(num_env))
    waiter = Waiter(timeout_s)
    generate_s = 0.0
    while ready or acted or waiter.in_flight:
        while ready and free_policy:
            rank = free_policy.pop(0)
            chunk, ready = share(ready, len(free_policy) + 1)
            contexts = [episodes[i].context() for i in chunk]
            images = _pixels([episodes[i] for i in chunk])  # (): none in these episodes
            future = (
                actors("policy").slice(procs=rank).generate.call_one(contexts, generation, *images)
            )
            waiter.add(("policy", rank, chunk, time.perf_counter()), future, "policy.generate")
        while acted and free_env:
            rank = free_env.pop(0)
            chunk, acted = share(acted, len(free_env) + 1)
            items = [
                (episodes[i].key, episodes[i].prompt, episodes[i].last_action, episodes[i].final)
                for i in chunk
            ]
            future = actors("environment").slice(procs=rank).step.call_one(items)
            waiter.add(("environment", rank, chunk, 0.0), future, "environment.step")
        (role, rank, chunk, sent), result, error = waiter.next()
        if role == "policy":
            generate_s += time.perf_counter() - sent
            free_policy.append(rank)
        else:
            free_env.append(rank)
        if error is not None:
            if on_lost is not None and error.proc_lost:
                on_lost(role, error)
            for i in chunk:
                _fail(episodes[i], f"{role} call failed: {error}")
            continue
        if role == "policy":
            for i, tokens, logprobs in zip(
                chunk, result.completion_lists(), result.logprobs.tolist(), strict=True
            ):
                episode = episodes[i]
                episode.tokens += tokens
                episode.loss_mask += [1] * len(tokens)
                episode.logprobs += logprobs[: len(tokens)]
                episode.versions += [result.weight_version] * len(tokens)
                episode.turns += 1
                episode.last_action = tokenizer.decode(tokens, skip_special_tokens=True)
                episode.last_turn = tokens
                room = context - len(episode.context()) - generation.max_new_tokens
                episode.final = episode.turns >= max_turns or room <= 0
                acted.append(i)
        else:
            room = context - generation.max_new_tokens  # for the episode and a reply
            for i, (_, step, failure) in zip(chunk, result, strict=True):
                if _take_reply(episodes[i], step, failure, fmt, vision, room):
                    ready.append(i)
    return episodes, {
        "time/episodes_s": time.perf_counter() - started,
        "time/episode_generate_s": generate_s,
    }


def _take_reply(
    episode: EpisodeState, step: Any, failure: str, fmt: ChatFormat, vision: Any, room: int
) -> bool:
    """Append the environment's answer to the model's turn to `episode`; whether
    the model takes another turn (no: it failed, ended, or the reply would leave
    fewer than `room` tokens for the episode)."""
    if failure:
        _fail(episode, failure)
        return False
    episode.info.update(step.info)
    if step.done or episode.final:
        episode.reward, episode.done = step.reward, True
        return False
    try:
        reply, shown = _reply(fmt, vision, step, episode)
    except ImageError as error:  # a corrupt or oversized picture: this episode fails
        _fail(episode, str(error))
        return False
    if len(episode.context()) + len(reply) > room:
        # The reply would not leave room for another turn: the episode ends here.
        episode.reward, episode.done, episode.truncated = step.reward, True, True
        return False
    episode.replies.append(step.observation)
    episode.images += shown
    episode.tokens += reply
    episode.loss_mask += [0] * len(reply)
    episode.logprobs += [0.0] * len(reply)
    episode.versions += [-1] * len(reply)
    return True


def encode_prompts(
    fmt: ChatFormat, vision: VisionFormat | None, prompts: list[Prompt], what: str = "the task"
) -> tuple[list[list[int]], list]:
    """The prompts' token ids and each one's pixels (None without images), through
    `vision` (a VLM's processor: placeholders expanded here, once) when they
    have images, else through `fmt`; one line when images meet a text model."""
    if not any(p.images for p in prompts):
        return fmt.prompts([p.text for p in prompts]), [None] * len(prompts)
    if vision is None:
        raise ImageError(
            f"{what} gives images and the model takes none: set config key "
            "'model.arch' to llava or 'model.path' to a vision-language model"
        )
    return vision.prompts(prompts)


def _pixels(episodes: list[EpisodeState]) -> tuple:
    """`Policy.generate`'s trailing (seeds, images) for `episodes`: () without images."""
    images = shard([pile(e.images) if e.images else None for e in episodes])
    return () if images is None else (None, images)


def _reply(fmt: ChatFormat, vision: VisionFormat | None, step: Any, episode: EpisodeState):
    """An environment reply's ids and pixels (placeholders expanded here, once)."""
    if not step.images:
        return fmt.reply(step.observation, episode.last_turn), []
    where = f"the environment's reply in episode {episode.key}"
    if vision is None:
        raise ImageError(f"{where} has images and the model takes none")
    if not vision.chat:
        return vision.reply(step.observation, step.images, where)
    # A tool message with the pictures, as the processor's chat template renders it.
    content = [{"type": "image"}] * len(step.images) + [{"type": "text", "text": step.observation}]
    message = {"role": "tool", "content": content}
    text = fmt.after_turn_text([message], episode.last_turn, by=vision.processor)
    return vision.reply(text, step.images, where, placed=True)


def share(items: list, workers: int) -> tuple[list, list]:
    """The first 1/workers of `items` (at least one), and the rest."""
    size = max(1, -(-len(items) // workers))
    return items[:size], items[size:]


def _fail(episode: EpisodeState, reason: str) -> None:
    # Logged once, with the other failures of the batch, where they are counted.
    episode.failed, episode.done = reason.splitlines()[0][:300], True


def to_completions(episodes: list[EpisodeState], pad_id: int) -> tuple[Completions, torch.Tensor]:
    """Episodes -> one Completions row each (prompt left-padded, episode right-
    padded) and their rewards."""
    n = len(episodes)
    P = max(len(e.prompt_ids) for e in episodes)
    T = max(1, max(len(e.tokens) for e in episodes))
    prompt_ids = torch.full((n, P), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros(n, P)
    ids = torch.full((n, T), pad_id, dtype=torch.long)
    loss_mask, attention, logprobs = torch.zeros(n, T), torch.zeros(n, T), torch.zeros(n, T)
    versions = torch.full((n, T), -1, dtype=torch.long)
    for row, e in enumerate(episodes):
        prompt_ids[row, P - len(e.prompt_ids) :] = torch.tensor(e.prompt_ids)
        prompt_mask[row, P - len(e.prompt_ids) :] = 1
        length = len(e.tokens)
        if length:
            ids[row, :length] = torch.tensor(e.tokens)
            loss_mask[row, :length] = torch.tensor(e.loss_mask, dtype=torch.float)
            attention[row, :length] = 1
            logprobs[row, :length] = torch.tensor(e.logprobs)
            versions[row, :length] = torch.tensor(e.versions)
    model_versions = versions[versions >= 0]
    images, counts = stack([pile(e.images) if e.images else None for e in episodes])
    completions = Completions(
        images=images,
        image_counts=counts,
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=ids,
        completion_mask=loss_mask,
        logprobs=logprobs,
        weight_version=int(model_versions.min()) if len(model_versions) else 0,
        completion_attention=attention,
        token_versions=versions,
    )
    return completions, torch.tensor([e.reward for e in episodes])
