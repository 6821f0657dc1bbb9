"""Work by pull: replicas take groups from a queue as they become free.

With `rollout.dispatch: pull` a step's groups are not split over the policy
replicas up front. Each replica is given `rollout.groups_per_call` groups when
it is free, and each generated group is scored on a free environment proc, so
a fast replica does more and a slow one no longer sets the step time.

- `rollout.overprovision: 0.25` keeps 25% more groups under way than a step
  trains; the step trains on the first `prompts_per_step` complete ones.
- Groups that complete late are not cancelled or discarded: they stay in the
  queue, are trained first at the next step (oldest first) if their weights
  are within `max_staleness` versions, and are counted
  (`rollout/late_groups`); beyond that they are dropped as `stale`.
- `rollout/bias_ks_latency` and `rollout/bias_ks_length`: the two-sample
  Kolmogorov-Smirnov distance between the trained groups and all completed
  groups of the last `rollout.bias_window` groups, by latency and by length.
  Near 0: the trainer sees no bias toward fast or short episodes.
- Groups in the queue are part of the run's state: a checkpoint waits for
  those under way and saves them with the rest, so a resumed run trains on
  exactly these samples (`save`, `load`).

The loop sends each call itself (`send`: `policy.slice(procs=i).generate`), so
the meshes stay visible in it.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from meshrl.config import ConfigError
from meshrl.mesh import POLL_S, RemoteCallError, one_line

DISPATCH = ("split", "pull")


@dataclass
class RolloutConfig:
    """How a step's generation is handed to the policy replicas (meshrl/dispatch.py)."""

    dispatch: str = "split"
    """split: each step's batch is cut into one equal part per replica, sent at
    once (the slowest replica sets the step time). pull: replicas take groups
    from a queue as they become free; late groups wait for the next step."""
    overprovision: float = 0.0
    """pull: groups under way beyond a step's `prompts_per_step`, as a fraction
    (0.25: 25% more); the step trains on the first complete ones."""
    groups_per_call: int = 1
    """pull: groups a replica takes per generate call."""
    bias_window: int = 256
    """pull: completed groups the bias metrics compare over."""

    def validate(self) -> None:
        if self.dispatch not in DISPATCH:
            raise ConfigError(
                f"config key 'rollout.dispatch': '{self.dispatch}' is not one of split, pull"
            )
        if self.overprovision < 0:
            raise ConfigError("config key 'rollout.overprovision': must be >= 0")
        if self.groups_per_call < 1 or self.bias_window < 2:
            raise ConfigError(
                "config key 'rollout.groups_per_call': must be >= 1 (bias_window >= 2)"
            )


@dataclass
class Group:
    """One prompt's `group_size` samples, from the queue to the trainer."""

    id: int
    prompt: Any  # a `Prompt`
    ids: list[list[int]]  # its rows' prompt token ids
    seeds: list[int]  # its rows' sampling seeds
    sent: float = 0.0  # when a replica took it (time.monotonic)
    completions: Any = None
    rewards: torch.Tensor | None = None
    version: int = -1  # the weight version it was generated with
    latency_s: float = 0.0  # from taken to scored
    done_at_step: int = -1  # the step during which it completed


def ks_distance(a: list[float], b: list[float]) -> float:
    """Two-sample Kolmogorov-Smirnov statistic: the largest gap between the two
    empirical distribution functions (0: the same; 1: disjoint)."""
    if not a or not b:
        return 0.0
    a, b = sorted(a), sorted(b)
    points = sorted(set(a) | set(b))
    return max(
        abs(bisect.bisect_right(a, x) / len(a) - bisect.bisect_right(b, x) / len(b)) for x in points
    )


@dataclass
class _Calls:
    """Calls under way on one role's procs: rank -> (groups, future)."""

    running: dict[int, tuple[list[Group], Any]] = field(default_factory=dict)

    def idle(self, size: int) -> list[int]:
        return [rank for rank in range(size) if rank not in self.running]

    def groups(self) -> int:
        return sum(len(groups) for groups, _ in self.running.values())


class Dispatcher:
    """The queue of groups and the calls under way (see the module docstring).

    `collector` lays out prompts and keeps the ledger; `send(rank, ids,
    seeds)` starts a generation on policy replica `rank`; `score(rank,
    prompts, completions)` starts scoring on environment proc `rank`."""

    def __init__(
        self,
        cfg: RolloutConfig,
        collector: Any,
        policy: Any,
        environment: Any,
        send: Callable[[int, list, list], Any],
        score: Callable[[int, list, list], Any],
    ):
        self.cfg, self.collector = cfg, collector
        self.policy, self.environment, self.send, self.score = policy, environment, send, score
        self.state, self.sup, self.sync = collector.state, collector.sup, collector.sync
        self.k = collector.cfg.group_size
        self.max_staleness = collector.cfg.max_staleness
        self.next_id = 0
        self.pending: deque[Group] = deque()  # drawn, not taken by a replica yet
        self.generating, self.scoring = _Calls(), _Calls()
        self.to_score: deque[Group] = deque()
        self.complete: list[Group] = []  # scored, not trained yet
        self.generated: deque = deque(maxlen=cfg.bias_window)  # (latency, length)
        self.trained: deque = deque(maxlen=cfg.bias_window)
        self.errors = 0

    # --- the step ---------------------------------------------------------------------

    def step(self, need: int) -> tuple[Any, torch.Tensor, dict]:
        """The first `need` complete groups within the staleness bound (late ones
        first): their completions [need x group_size], rewards and metrics."""
        started, step = time.perf_counter(), self.state.step
        self._drop_stale()
        self._top_up(need)
        last = time.monotonic()
        while len(self.complete) < need:
            if self._dispatch() + self._poll(step):
                last = time.monotonic()
            elif time.monotonic() - last > self.sup.timeout_s:
                raise RemoteCallError(
                    f"rollout: no generation or scoring answered within {self.sup.timeout_s:g}s "
                    f"({self._under_way()} groups under way)", "policy",
                )  # fmt: skip
            else:
                time.sleep(POLL_S / 5)
            self._drop_stale()
            self._top_up(need)
        late = sorted((g for g in self.complete if g.done_at_step < step), key=lambda g: g.id)
        fresh = [g for g in self.complete if g.done_at_step == step]
        if not self.cfg.overprovision:  # the same groups in the same order at any pool size
            fresh.sort(key=lambda g: g.id)
        taken = (late + fresh)[:need]
        self.complete = [g for g in self.complete if g not in taken]
        if self.max_staleness:  # the next step's groups start while this one trains
            self._top_up(need)
            self._dispatch()
        self.trained.extend(self._shape(g) for g in taken)
        pad = self.collector.tokenizer.pad_token_id
        completions = type(taken[0].completions).concat([g.completions for g in taken], pad)
        self.state.ledger.generated += need * self.k
        info = {
            "time/rollout_s": time.perf_counter() - started,
            "rollout/late_groups": sum(g.done_at_step < step for g in taken),
            "rollout/groups_queued": len(self.complete) + self._under_way(),
            "weights/staleness": max(self.sync.published - g.version for g in taken),
            **self.bias(),
        }
        return completions, torch.cat([g.rewards for g in taken]), info

    def bias(self) -> dict[str, float]:
        """KS distances between trained and completed groups, by latency and length."""
        generated, trained = list(self.generated), list(self.trained)
        return {
            "rollout/bias_ks_latency": ks_distance([g[0] for g in trained], [g[0] for g in generated]),
            "rollout/bias_ks_length": ks_distance([g[1] for g in trained], [g[1] for g in generated]),
        }  # fmt: skip

    # --- the queue --------------------------------------------------------------------

    def _under_way(self) -> int:
        return (
            len(self.pending)
            + self.generating.groups()
            + len(self.to_score)
            + (self.scoring.groups())
        )

    def _top_up(self, need: int) -> None:
        """Draw groups until `need x (1 + overprovision)` are queued or complete."""
        want = math.ceil(need * (1 + self.cfg.overprovision))
        missing = want - len(self.complete) - self._under_way()
        if missing <= 0:
            return
        prompts = self.collector.sample_prompts(missing)
        batch = self.collector.layout(prompts)  # its ids and seeds, in one replica's order
        ids = [i for shard, _ in batch.shards for i in shard]
        seeds = [s for _, shard in batch.shards for s in shard]
        k = self.k
        for n, prompt in enumerate(prompts):
            rows = slice(n * k, (n + 1) * k)
            self.pending.append(Group(self.next_id, prompt, ids[rows], seeds[rows]))
            self.next_id += 1

    def _drop_stale(self) -> None:
        stale = [g for g in self.complete if self.sync.published - g.version > self.max_staleness]
        if stale:
            self.complete = [g for g in self.complete if g not in stale]
            self.state.ledger.generated += len(stale) * self.k
            self.state.ledger.drop("stale", len(stale) * self.k)

    # --- calls ------------------------------------------------------------------------

    def _dispatch(self) -> int:
        """Give queued groups to free replicas and generated ones to free
        environment procs; how many calls were sent."""
        sent = 0
        for rank in self.generating.idle(self.policy.size):
            if not self.pending:
                break
            groups = [
                self.pending.popleft()
                for _ in range(min(self.cfg.groups_per_call, len(self.pending)))
            ]
            now = time.monotonic()
            for group in groups:
                group.sent = now
            ids = [row for g in groups for row in g.ids]
            seeds = [s for g in groups for s in g.seeds]
            self.generating.running[rank] = (groups, self.send(rank, ids, seeds))
            sent += 1
        for rank in self.scoring.idle(self.environment.size):
            if not self.to_score:
                break
            group = self.to_score.popleft()
            future = self.score(rank, [group.prompt] * self.k, group.completions.completion_lists())
            self.scoring.running[rank] = ([group], future)
            sent += 1
        return sent

    def _poll(self, step: int) -> int:
        """Take the answers that came; how many."""
        came = 0
        for role, calls in (("policy", self.generating), ("environment", self.scoring)):
            for rank, (groups, future) in list(calls.running.items()):
                try:
                    answer = future.get(timeout=0.001)
                except TimeoutError:
                    continue
                except Exception as error:  # noqa: BLE001 - Monarch's, as `mesh.wait` reads them
                    del calls.running[rank]
                    self._failed(role, rank, groups, error)
                    came += 1
                    continue
                del calls.running[rank]
                came += 1
                if role == "policy":
                    self._generated(groups, answer)
                else:
                    self._scored(groups[0], answer, step)
        return came

    def _generated(self, groups: list[Group], completions: Any) -> None:
        for n, group in enumerate(groups):
            group.completions = completions.rows(slice(n * self.k, (n + 1) * self.k))
            group.version = completions.weight_version
            self.to_score.append(group)

    def _scored(self, group: Group, answer: tuple, step: int) -> None:
        rewards, failures = answer
        if failures:  # the group is dropped, counted, and a fresh prompt takes its place
            self.collector.count_failures(list(failures.values()), self.k, {}, 0)
            self.state.ledger.generated += self.k
            return
        group.rewards = torch.tensor(rewards, dtype=torch.float32)
        group.latency_s = time.monotonic() - group.sent
        group.done_at_step = step
        self.generated.append(self._shape(group))
        self.complete.append(group)

    def _shape(self, group: Group) -> tuple[float, float]:
        return group.latency_s, group.completions.completion_mask.sum().item() / self.k

    def _failed(self, role: str, rank: int, groups: list[Group], error: Exception) -> None:
        """A call failed: its groups go back to the queue. A lost proc is replaced
        (what its generation made is counted as `policy_lost`); an error raised
        in the actor is retried per `faults.retry_errors`."""
        lost = type(error).__name__ == "SupervisionError"
        failure = RemoteCallError(f"{role}.{'generate' if role == 'policy' else 'score'}[{rank}] "
                                  f"failed: {one_line(error)}", f"{role}[{rank}]", lost)  # fmt: skip
        if role == "policy":
            self.pending.extendleft(reversed(groups))
        else:
            self.to_score.extendleft(reversed(groups))
        if lost:
            if role == "policy":
                self.state.ledger.generated += len(groups) * self.k
                self.state.ledger.drop("policy_lost", len(groups) * self.k)
            self.sup.recover(self.policy if role == "policy" else self.environment, failure)
        else:
            self.sup.retry(failure, self.errors)
            self.errors += 1

    def _drain(self, role: str) -> None:
        """Until no call is under way on `role` (each collected or failed)."""
        calls = self.generating if role == "policy" else self.scoring
        deadline = time.monotonic() + self.sup.timeout_s
        while calls.running and time.monotonic() < deadline:
            if not self._poll(self.state.step):
                time.sleep(POLL_S / 5)

    # --- checkpoints ------------------------------------------------------------------

    def settle(self) -> None:
        """Wait until nothing is under way: every taken group generated and scored."""
        deadline = time.monotonic() + self.sup.timeout_s
        while self.generating.running or self.scoring.running or self.to_score:
            if time.monotonic() > deadline:
                raise RemoteCallError(
                    f"the rollout queue did not settle within {self.sup.timeout_s:g}s", "policy"
                )
            if not (self._dispatch_scoring() + self._poll(self.state.step)):
                time.sleep(POLL_S / 5)

    def _dispatch_scoring(self) -> int:
        pending, self.pending = self.pending, deque()  # nothing new is taken while settling
        try:
            return self._dispatch()
        finally:
            self.pending = pending

    def save(self) -> dict:
        """The queue, settled, for a checkpoint: groups drawn and complete."""
        self.settle()
        behind = self.sync.published
        return {
            "next_id": self.next_id,
            "pending": [(g.id, g.prompt, g.ids, g.seeds) for g in self.pending],
            "complete": [
                (
                    g.id,
                    g.prompt,
                    g.ids,
                    g.seeds,
                    g.completions,
                    g.rewards,
                    behind - g.version,
                    g.latency_s,
                )
                for g in self.complete
            ],  # fmt: skip
        }

    def load(self, saved: dict | None) -> None:
        """The queue as `save` left it (None: empty), e.g. after a resume."""
        saved = saved or {"next_id": 0, "pending": [], "complete": []}
        self.next_id = saved["next_id"]
        self.pending = deque(Group(*entry) for entry in saved["pending"])
        self.complete = []
        for gid, prompt, ids, seeds, completions, rewards, behind, latency in saved["complete"]:
            group = Group(gid, prompt, ids, seeds, 0.0, completions, rewards)
            group.version, group.latency_s = self.sync.published - behind, latency
            group.done_at_step = self.state.step - 1  # late: trained first
            self.complete.append(group)

    def drop_all(self, reason: str) -> int:
        """Forget everything queued and under way (a rewind, the run's end):
        generated samples not trained count as dropped for `reason`."""
        self._drain("policy")
        self._drain("environment")
        made = len(self.complete) + len(self.to_score)
        self.state.ledger.generated += made * self.k
        self.state.ledger.drop(reason, made * self.k)
        self.complete, self.pending = [], deque()
        self.to_score = deque()
        return made * self.k
