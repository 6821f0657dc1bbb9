"""Continuous batching (`policy.continuous`): one running decode batch per replica.

`sample` (meshrl/model/generation.py) decodes a batch from its first token to
its longest row; rows that end leave, none join, so the batch thins out while
its longest rows decode. Here a replica keeps one decode batch that every call
feeds: rows leave when they end and waiting rows join at the next step, each
at its own position and its own token count (their prompts prefilled once per
distinct prompt, their keys and values left-padded into the running cache). A
row's tokens are what they would be in a batch of its own: its draws depend on
its seed and its own token count only (`row_uniforms`), its log-probs are
taken under the same processing as `sample`'s (`_next_tokens`).

Weights change between two decode steps (`paused`). With rows under way
(`rollout.partial`) each such row goes on under the new weights: it is
prefilled again, its prompt and the tokens it has sampled, under them, so a
token's log-prob is always the one of the weights that sampled it, over a
context computed by the same weights (a cache kept from older weights would
make each token's distribution a mix no policy has). Every token records the
version that sampled it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from meshrl.model.generation import _growing_cache, _next_tokens, _prefill, left_padded
from meshrl.model.packing import _cache_of, cache_arg


@dataclass
class Settings:
    """How a call's rows are sampled (`GenerationConfig`'s fields the sampler reads)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    min_new_tokens: int = 0


@dataclass
class _Request:
    """One call: its rows, how they are sampled, and where the result goes."""

    settings: Settings
    rows: list[_Row]
    done: Callable[[Any], None]  # the result dict, or an exception
    left: int = 0
    started: float = 0.0


@dataclass
class _Row:
    request: _Request
    prompt: list[int]
    seed: int
    length: int | None = None  # an exact length (`faults.completion_lengths`), or None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    entropy: float = 0.0

    @property
    def limit(self) -> int:
        return self.length if self.length is not None else self.request.settings.max_new_tokens


def _by_length(rows: list[_Row]) -> list[list[_Row]]:
    """`rows` in buckets of similar length, longest first: a row joins the current
    bucket while it is at least half as long as the bucket's longest, so a prefill
    computes at most twice its rows' tokens. Rows under way prefilled again after a
    weight change (long) and new prompts (short) are prefilled apart, not all
    left-padded to the longest."""
    buckets: list[list[_Row]] = []
    for row in sorted(rows, key=_length, reverse=True):
        if buckets and 2 * _length(row) >= _length(buckets[-1][0]):
            buckets[-1].append(row)
        else:
            buckets.append([row])
    return buckets


def _length(row: _Row) -> int:
    return len(row.prompt) + len(row.tokens)


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """`t` padded with zeros on the left of `dim` to `width`."""
    extra = width - t.size(dim)
    if extra == 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t.new_zeros(shape), t], dim)


class ContinuousEngine:
    """The running decode batch of one replica, decoded by a thread of its own.

    `submit` queues a call's rows; `done(result)` is called (from the decode
    thread) when the last of them ends. `max_rows` caps the decode batch (0: no
    cap). `version()` names the weights now served; `paused()` holds the decode
    thread between two steps (a weight pull), `refill()` then prefills the rows
    under way again under the new weights."""

    def __init__(
        self,
        model: torch.nn.Module,
        pad_id: int,
        stop_ids: list[int],
        max_rows: int,
        version: Callable[[], int],
        share_prefix: bool = True,
    ):
        if not _growing_cache(model):
            raise ValueError(
                "config key 'policy.continuous': this model has layers other than "
                "attention (its cache cannot take rows mid-decode); use policy.continuous=false"
            )
        self.model, self.pad_id, self.max_rows = model, pad_id, max_rows
        self.stop, self.stop_set = torch.tensor(stop_ids), set(stop_ids)
        self.version, self.share_prefix = version, share_prefix
        self.lock = threading.Lock()  # held for each decode step and by `paused`
        self.changed = threading.Condition()  # rows came, or the batch emptied
        self.asking = 0  # `paused` callers waiting: the decode thread lets them in
        self.waiting: deque[_Row] = deque()
        self.rows: list[_Row] = []  # the decode batch
        self.cache: Any = None
        self.mask = self.positions = self.logits = None
        self._refill = False
        self.closed = False
        self.thread: threading.Thread | None = None
        # Decode steps and the rows they carried since `occupancy()` was last read.
        self.steps, self.row_steps = 0, 0

    # --- the caller's side ------------------------------------------------------------

    def submit(
        self,
        prompts: list[list[int]],
        seeds: list[int],
        settings: Settings,
        done: Callable[[Any], None],
        lengths: list[int] | None = None,
    ) -> None:
        request = _Request(settings, [], done, len(prompts), time.perf_counter())
        request.rows = [
            _Row(request, list(p), s, None if lengths is None else lengths[i])
            for i, (p, s) in enumerate(zip(prompts, seeds, strict=True))
        ]
        with self.changed:
            if self.closed:
                raise RuntimeError("the continuous engine is closed")
            self.waiting.extend(request.rows)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="meshrl-decode", daemon=True)
                self.thread.start()
            self.changed.notify_all()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No decode step runs inside (they run before and after)."""
        with self.changed:
            self.asking += 1
        try:
            with self.lock:
                yield
        finally:
            with self.changed:
                self.asking -= 1
                self.changed.notify_all()

    def refill(self) -> int:
        """Inside `paused`, after the weights changed: the rows under way are
        prefilled again under the new ones before their next token. Returns them."""
        self._refill = bool(self.rows)
        return len(self.rows)

    def busy(self) -> int:
        """Rows under way or waiting."""
        with self.changed:
            return len(self.rows) + len(self.waiting)

    def wait_idle(self, timeout_s: float) -> None:
        """Until no row is under way or waiting."""
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while self.rows or self.waiting:
                if not self.changed.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(
                        f"policy: {len(self.rows) + len(self.waiting)} rows still decoding "
                        f"after {timeout_s:g}s"
                    )

    def occupancy(self) -> float | None:
        """The decode batch's mean rows per step over `max_rows` (over its largest
        batch without a cap) since the last call; None without steps."""
        steps, rows = self.steps, self.row_steps
        self.steps = self.row_steps = 0
        if not steps:
            return None
        return rows / steps / (self.max_rows or max(self._peak, 1))

    def close(self) -> None:
        with self.changed:
            self.closed = True
            self.changed.notify_all()
        if self.thread is not None:
            self.thread.join(timeout=10)

    # --- the decode thread ------------------------------------------------------------

    _peak = 0

    def _run(self) -> None:
        while True:
            with self.changed:
                while not self.closed and (self.asking or not (self.rows or self.waiting)):
                    self.changed.wait()
                if self.closed:
                    return
            with self.lock, torch.no_grad():
                try:
                    self._step()
                except BaseException as error:  # noqa: BLE001 - every caller gets it
                    self._fail(error)
            with self.changed:
                self.changed.notify_all()

    def _fail(self, error: BaseException) -> None:
        with self.changed:
            requests = {id(r.request): r.request for r in [*self.rows, *self.waiting]}
            self.rows, self.waiting = [], deque()
        self.cache = self.mask = self.positions = self.logits = None
        for request in requests.values():
            request.done(error)

    def _step(self) -> None:
        if self._refill:  # new weights: the rows under way are prefilled again first
            with self.changed:
                self.waiting.extendleft(reversed(self.rows))
            self.rows, self.cache = [], None
            self._refill = False
        self._admit()
        if not self.rows:
            return
        self.steps += 1
        self.row_steps += len(self.rows)
        self._peak = max(self._peak, len(self.rows))
        token, behaviour, entropy = self._sample()
        version = self.version()
        keep = []
        for i, (row, t, lp, h) in enumerate(
            zip(self.rows, token.tolist(), behaviour.tolist(), entropy.tolist(), strict=True)
        ):
            row.tokens.append(t)
            row.logprobs.append(lp)
            row.versions.append(version)
            row.entropy += h
            stopped = row.length is None and t in self.stop_set
            if stopped or len(row.tokens) >= row.limit:
                self._ended(row)
            else:
                keep.append(i)
        if len(keep) < len(self.rows):
            index = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
            self.rows = [self.rows[i] for i in keep]
            self.mask, self.positions = self.mask[index], self.positions[index]
            token = token[index.to(token.device)]
            if keep:
                self.cache.reorder_cache(index)
        if not self.rows:
            self.cache = self.mask = self.positions = self.logits = None
            return
        self.mask = torch.nn.functional.pad(self.mask, (0, 1), value=1)
        out = self.model(
            input_ids=token.unsqueeze(-1).to(self.mask.device),
            attention_mask=self.mask,
            position_ids=self.positions,
            use_cache=True,
            **cache_arg(self.model, self.cache),
        )
        self.logits, self.cache = out.logits[:, -1], _cache_of(out)
        self.positions = self.positions + 1

    def _sample(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's next token, its behaviour log-prob and the entropy of its
        distribution, drawn as `sample` draws them, rows grouped by their settings."""
        device = self.logits.device
        R = len(self.rows)
        steps = torch.tensor([len(r.tokens) for r in self.rows], dtype=torch.long)
        seeds = torch.tensor([r.seed for r in self.rows], dtype=torch.long, device=device)
        token = torch.empty(R, dtype=torch.long, device=device)
        behaviour = torch.empty(R, device=device)
        entropy = torch.empty(R, device=device)
        groups: dict[tuple, list[int]] = {}
        for i, row in enumerate(self.rows):
            s = row.request.settings
            banned = row.length is not None or len(row.tokens) < s.min_new_tokens
            groups.setdefault((s.temperature, s.top_p, banned), []).append(i)
        stop = self.stop.to(device)
        for (temperature, top_p, banned), members in groups.items():
            index = torch.tensor(members, dtype=torch.long, device=device)
            t, b, logp, probs = _next_tokens(
                self.logits[index],
                steps[index.cpu()],
                temperature,
                stop if banned else None,
                top_p,
                seeds[index],
            )
            token[index], behaviour[index] = t, b
            entropy[index] = -(probs * logp).nan_to_num().sum(-1)
        return token, behaviour, entropy

    def _admit(self) -> None:
        """Waiting rows join the batch, as many as it has room for: their prompts
        (and what they sampled before a refill) prefilled, each distinct one once,
        in buckets of similar length (`_by_length`), their keys and values
        left-padded to the running cache's length."""
        with self.changed:
            room = (self.max_rows or len(self.waiting)) - len(self.rows)
            # Joining copies the running cache: rows join a few at a time, not one by one.
            if self.rows and room < min(len(self.waiting), max(1, self.max_rows // 4)):
                return
            take = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
        for bucket in _by_length(take):
            self._join(bucket)

    def _join(self, take: list[_Row]) -> None:
        """Prefill `take` and add it to the running batch."""
        device = next(self.model.parameters()).device
        ids, mask = left_padded([r.prompt + r.tokens for r in take], self.pad_id)
        ids, mask = ids.to(device), mask.long().to(device)
        logits, cache, _, after = _prefill(self.model, ids, mask, self.share_prefix)
        if not self.rows:
            self.rows, self.cache, self.mask, self.positions, self.logits = (
                take,
                cache,
                mask,
                after,
                logits,
            )
            return
        # Columns no running row attends (their rows left) are cut first.
        cut = int(self.mask.argmax(1).min())
        length = max(self.mask.size(1) - cut, mask.size(1))
        for old, new in zip(self.cache.layers, cache.layers, strict=True):
            old.assign(
                torch.cat(
                    [_left_pad(old.keys[..., cut:, :], length, -2), _left_pad(new.keys, length, -2)]
                ),
                torch.cat(
                    [
                        _left_pad(old.values[..., cut:, :], length, -2),
                        _left_pad(new.values, length, -2),
                    ]
                ),
            )
        self.mask = torch.cat(
            [_left_pad(self.mask[:, cut:], length, 1), _left_pad(mask, length, 1)]
        )
        self.positions = torch.cat([self.positions, after])
        self.logits = torch.cat([self.logits, logits])
        self.rows += take

    def _ended(self, row: _Row) -> None:
        request = row.request
        request.left -= 1
        if request.left:
            return
        rows = request.rows
        T = max(len(r.tokens) for r in rows)

        def table(values: Callable[[_Row], list], fill: float, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(
                [values(r) + [fill] * (T - len(r.tokens)) for r in rows], dtype=dtype
            )

        request.done(
            {
                "tokens": table(lambda r: r.tokens, self.pad_id, torch.long),
                "logprobs": table(lambda r: r.logprobs, 0.0, torch.float32),
                "mask": table(lambda r: [1.0] * len(r.tokens), 0.0, torch.float32),
                "versions": table(lambda r: r.versions, -1, torch.long),
                "entropy": torch.tensor([r.entropy for r in rows]),
                "seconds": time.perf_counter() - request.started,
            }
        )
