"""Work by pull: replicas take groups from a queue as they become free.

With `rollout.dispatch: pull` a step's groups are not split over the policy
replicas up front. Each replica is given `rollout.groups_per_call` groups when
it is free, and generated groups are scored on free environment procs (the
groups waiting shared over the free procs, so one call scores several when
scoring falls behind), so a fast replica does more and a slow one no longer
sets the step time.

- `rollout.overprovision: 0.25` keeps 25% more groups under way than a step
  trains; the step trains on the first `prompts_per_step` complete ones.
  Extra groups that complete with the rest wait a step and are trained one
  version later: with nothing straggling, a fixed overprovision adds a version
  of staleness to every group. `rollout.overprovision_stragglers` draws the
  extra groups only for the groups still under way when the last step had its
  groups.
- Groups that complete late are not cancelled or discarded: they stay in the
  queue, are trained first at the next step (oldest first) if their weights
  are within `max_staleness` versions, and are counted
  (`rollout/late_groups`); beyond that they are dropped as `stale`.
- `rollout/bias_ks_latency` and `rollout/bias_ks_length`: the two-sample
  Kolmogorov-Smirnov distance between the trained groups and all completed
  groups of the last `rollout.bias_window` groups, by latency and by length.
  Near 0: the trainer sees no bias toward fast or short episodes.
- Each group is generated with the weight version current when it was drawn,
  also while the trainer trains: the loop hands out the drawn groups before it
  sends a weight pull (`hand_out`). Over-provisioning with that overlap wants
  `max_staleness: 2` (a late group is trained two versions on).
- Groups in the queue are part of the run's state: a checkpoint waits for
  those under way and saves them with the rest, so a resumed run trains on
  exactly these samples (`save`, `load`).

The loop sends each call itself (`send`: `policy.slice(procs=i).generate`), so
the meshes stay visible in it.
"""

from __future__ import annotations

import bisect
import math
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from meshrl.config import ConfigError
from meshrl.envs.rollout import Waiter
from meshrl.model.vision import shard, unstack
from meshrl.procs.mesh import POLL_S, RemoteCallError

DISPATCH = ("split", "pull")


@dataclass
class RolloutConfig:
    """How a step's generation is handed to the policy replicas (meshrl/loop/dispatch.py)."""

    dispatch: str = "split"
    """split: each step's batch is cut into one equal part per replica, sent at
    once (the slowest replica sets the step time). pull: replicas take groups
    from a queue as they become free; late groups wait for the next step."""
    overprovision: float = 0.0
    """pull: groups under way beyond a step's `prompts_per_step`, as a fraction
    (0.25: 25% more); the step trains on the first complete ones."""
    overprovision_stragglers: bool = False
    """pull with `overprovision`: draw the extra groups only for the stragglers: at
    most as many as were still under way when the last step had its groups (all
    of `overprovision` before the first step). Extra groups that complete with
    the rest wait a whole step and are trained a version later (late groups go
    first), so where nothing straggles a fixed overprovision only adds a version
    of staleness to every trained group (2 instead of 1 when generation runs
    ahead); this keeps it where rows straggle (a long tail) and drops it where
    none do. false: always `overprovision`."""
    groups_per_call: int = 1
    """pull: groups a replica takes per generate call."""
    calls_per_replica: int = 1
    """pull: generate calls a replica may have under way: the next one waits in its
    mailbox while it runs one, so it never idles between calls (1: strictly pull)."""
    bias_window: int = 256
    """pull: completed groups the bias metrics compare over."""
    partial: bool = False
    """pull with `policy.continuous` and `max_staleness` >= 1: a weight pull does not
    wait for the rows under way; each replica takes the new weights between two
    decode steps and its rows go on under them (each token keeps the version that
    sampled it; a group is as old as its oldest token for `max_staleness`)."""

    def validate(self) -> None:
        if self.dispatch not in DISPATCH:
            raise ConfigError(
                f"config key 'rollout.dispatch': '{self.dispatch}' is not one of split, pull"
            )
        if self.overprovision < 0:
            raise ConfigError("config key 'rollout.overprovision': must be >= 0")
        for key, least in (("groups_per_call", 1), ("calls_per_replica", 1), ("bias_window", 2)):
            if getattr(self, key) < least:
                raise ConfigError(f"config key 'rollout.{key}': must be >= {least}")


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
    published: int = -1  # which publish that version was (`WeightSync.published`)
    latency_s: float = 0.0  # from taken to scored
    late: bool = False  # taken by a replica before a step that did not train it
    replica: int = -1  # the policy rank that generated it (-1: not yet, or restored)
    pixels: list | None = None  # its rows' images, [I, C, H, W] each (`meshrl.model.vision`)
    errors: int = 0  # errors raised by the calls that carried it (`faults.retry_errors`)


def token_lags(
    versions: torch.Tensor, published: int, published_at: dict[int, int]
) -> torch.Tensor:
    """[B, T] weight versions (-1 off the tokens) -> how many publishes behind
    `published` each token's version is (-1 off the tokens; a version no longer
    known counts as the newest)."""
    return versions.clone().apply_(
        lambda v: published - published_at.get(v, published) if v >= 0 else -1
    )


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
    """Calls under way on one role's procs: (rank, call number) -> its groups."""

    running: dict[tuple[int, int], list[Group]] = field(default_factory=dict)
    sent: int = 0
    # The role's respawns when each call was sent: a call that fails on a proc the
    # role already replaced (several calls under way on one proc) costs no recovery.
    epochs: dict[tuple[int, int], int] = field(default_factory=dict)

    def free(self, size: int, depth: int) -> list[int]:
        """Ranks with fewer than `depth` calls under way, once per call they can take
        (the least busy first)."""
        busy = [sum(r == rank for r, _ in self.running) for rank in range(size)]
        return [rank for level in range(depth) for rank in range(size) if busy[rank] <= level]

    def groups(self) -> int:
        return sum(len(groups) for groups in self.running.values())


class Dispatcher:
    """The queue of groups and the calls under way (see the module docstring).

    `collector` lays out prompts and keeps the ledger; `send(rank, ids,
    seeds, images)` starts a generation on policy replica `rank`; `score(rank,
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
        # Groups still under way when the last step had its groups (None: no step yet):
        # the extra groups `overprovision_stragglers` draws.
        self.stragglers: int | None = None
        self.pending: deque[Group] = deque()  # drawn, not taken by a replica yet
        self.generating, self.scoring = _Calls(), _Calls()
        self.to_score: deque[Group] = deque()
        self.complete: list[Group] = []  # scored, not trained yet
        self.generated: deque = deque(maxlen=cfg.bias_window)  # (latency, length)
        self.trained: deque = deque(maxlen=cfg.bias_window)
        # Groups trained, by the policy rank that generated them: how the work was shared
        # (kept out of the step metrics, which must not depend on timing).
        self.trained_by_replica: Counter[int] = Counter()
        self.hand_out_s = 0.0  # the loop's waits in `hand_out` since the last step
        self._taking = threading.Lock()
        self.waiter = Waiter(self.sup.timeout_s)  # a thread per call: no polling delay
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # --- the step ---------------------------------------------------------------------

    def step(self, need: int) -> tuple[Any, torch.Tensor, dict]:
        """The first `need` complete groups within the staleness bound (late ones
        first): their completions [need x group_size], rewards and metrics."""
        started = time.perf_counter()
        self.pause()
        self._drop_stale()
        self._top_up(need)
        last = time.monotonic()
        while len(self.complete) < need:
            if self._dispatch() + self._poll():
                last = time.monotonic()
            elif time.monotonic() - last > self.sup.timeout_s:
                raise self._timed_out(
                    f"no generation or scoring answered within {self.sup.timeout_s:g}s "
                    f"({self._under_way()} groups under way)"
                )
            self._drop_stale()
            self._top_up(need)
        self.stragglers = self._under_way()
        late = sorted((g for g in self.complete if g.late), key=lambda g: g.id)
        fresh = [g for g in self.complete if not g.late]
        if not self.cfg.overprovision:  # the same groups in the same order at any pool size
            fresh.sort(key=lambda g: g.id)
        taken = (late + fresh)[:need]
        self.complete = [g for g in self.complete if g not in taken]
        for group in self._taken_not_trained():  # they are trained first, later
            group.late = True
        self.trained.extend(self._shape(g) for g in taken)
        self.trained_by_replica.update(g.replica for g in taken)
        # Taken before the next step's groups go on: a group of theirs scored in the
        # background by then would count as completed and not trained (timing).
        bias = self.bias()
        if self.max_staleness:  # the next step's groups go on while this one trains
            self._top_up(need)
        # Counted before the background thread resumes: a group it is moving between
        # two queues is in neither for a moment (timing, in a metric that must not be).
        queued = len(self.complete) + self._under_way()
        if self.max_staleness:
            self._resume()
        pad = self.collector.tokenizer.pad_token_id
        completions = type(taken[0].completions).concat([g.completions for g in taken], pad)
        self.state.ledger.generated += need * self.k
        info = {
            # The replicas' figures of the groups trained (`record_batch=False`): which
            # calls ran during this step is timing.
            **{key: value for key, (value, _) in completions.policy_metrics().items()},
            "time/rollout_s": time.perf_counter() - started,
            "rollout/late_groups": sum(g.late for g in taken),
            "rollout/groups_queued": queued,
            "weights/staleness": max(self.sync.published - g.published for g in taken),
            "time/hand_out_s": self.hand_out_s,
            **bias,
        }
        if self.cfg.partial:
            info.update(self.version_metrics(completions))
        self.hand_out_s = 0.0
        return completions, torch.cat([g.rewards for g in taken]), info

    def version_metrics(self, completions: Any) -> dict[str, float]:
        """Partial rollouts: rows sampled by more than one version, and the trained
        tokens by how many publishes behind the trainer their version is."""
        versions, mask = completions.versions(), completions.completion_mask > 0
        lag = token_lags(versions, self.sync.published, self.sync.published_at)
        spans = [len(set(row[m].tolist())) for row, m in zip(versions, mask, strict=True)]
        lags = lag[mask]
        return {
            "rollout/partial_rows": sum(n > 1 for n in spans),
            "rollout/tokens_lag0": int((lags == 0).sum()),
            "rollout/tokens_lag1": int((lags == 1).sum()),
            "rollout/tokens_lag2plus": int((lags >= 2).sum()),
        }

    # --- while the trainer trains -------------------------------------------------------

    def _resume(self) -> None:
        """Hand groups to free replicas and take answers in a thread of its own
        until `pause`: the queue flows while the loop trains and syncs weights."""
        self._running = threading.Event()
        self._running.set()

        def drive() -> None:
            try:
                while self._running.is_set():
                    self._dispatch()
                    self._poll()
            except BaseException as error:  # noqa: BLE001 - raised in the loop's thread
                self._error = error

        self._thread = threading.Thread(target=drive, name="meshrl-dispatch", daemon=True)
        self._thread.start()

    def pause(self) -> None:
        """Stop the thread `_resume` started (the loop's thread drives again), and
        raise what failed in it."""
        if self._thread is not None:
            self._running.clear()
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def hand_out(self) -> None:
        """Before a weight pull, while the queue flows as the trainer trains
        (`max_staleness` >= 1): wait until every group drawn is generated. The pull
        then reaches each replica after those groups' calls, so each group is
        generated with the version current when it was drawn, whatever the timing:
        a run, and a run resumed from its checkpoint, are the same bit for bit. A
        group handed back by a lost proc is generated again before the pull, on a
        replica that holds that version (a replacement takes the version served,
        `WeightSync.serving`), so a run with faults trains on the same samples."""
        if self._thread is None or self.cfg.partial:  # (partial: rows take the new weights)
            return
        started = time.monotonic()
        while self._thread.is_alive():  # (an error in it is raised by `pause`)
            with self._taking:
                if not self.pending and not self.generating.groups():
                    break
            if time.monotonic() - started > self.sup.timeout_s:
                raise self._timed_out(
                    f"{len(self.pending)} groups not taken by a replica within "
                    f"{self.sup.timeout_s:g}s"
                )
            time.sleep(POLL_S / 5)
        self.hand_out_s += time.monotonic() - started

    @staticmethod
    def _timed_out(what: str) -> RemoteCallError:
        """The rollout's replicas timed out (a lost policy replica, to the Supervisor)."""
        return RemoteCallError(f"rollout: {what}", "policy", timed_out=True)

    def bias(self) -> dict[str, float]:
        """KS distances between trained and completed groups, by latency and length."""
        generated, trained = list(self.generated), list(self.trained)
        return {
            "rollout/bias_ks_latency": ks_distance(
                [g[0] for g in trained], [g[0] for g in generated]
            ),
            "rollout/bias_ks_length": ks_distance(
                [g[1] for g in trained], [g[1] for g in generated]
            ),
        }

    # --- the queue --------------------------------------------------------------------

    def _taken_not_trained(self) -> list[Group]:
        """Groups a replica took that no step has trained yet."""
        running = [
            g
            for calls in (self.generating, self.scoring)
            for groups in calls.running.values()
            for g in groups
        ]
        return [*self.complete, *self.to_score, *running]

    def _under_way(self) -> int:
        return (
            len(self.pending)
            + self.generating.groups()
            + len(self.to_score)
            + (self.scoring.groups())
        )

    def _top_up(self, need: int) -> None:
        """Draw groups until `need x (1 + overprovision)` are queued or complete
        (with `overprovision_stragglers`, `need` plus at most the last stragglers)."""
        extra = math.ceil(need * self.cfg.overprovision)
        if self.cfg.overprovision_stragglers and self.stragglers is not None:
            extra = min(extra, self.stragglers)
        want = need + extra
        missing = want - len(self.complete) - self._under_way()
        if missing <= 0:
            return
        prompts = self.collector.sample_prompts(missing)
        batch = self.collector.layout(prompts)  # its ids and seeds, in one replica's order
        ids = [i for shard, _, _ in batch.shards for i in shard]
        seeds = [s for _, shard, _ in batch.shards for s in shard]
        pixels = [row for shard in batch.shards for row in unstack(shard[2], len(shard[0]))]
        k = self.k
        for n, prompt in enumerate(prompts):
            rows = slice(n * k, (n + 1) * k)
            group = Group(self.next_id, prompt, ids[rows], seeds[rows], pixels=pixels[rows])
            self.pending.append(group)
            self.next_id += 1

    def _drop_stale(self) -> None:
        # In published versions, as the static split counts them: a trainer version
        # counts optimizer steps (PPO takes several per step).
        now = self.sync.published
        stale = [g for g in self.complete if now - g.published > self.max_staleness]
        if stale:
            self.complete = [g for g in self.complete if g not in stale]
            self.state.ledger.generated += len(stale) * self.k
            self.state.ledger.drop("stale", len(stale) * self.k)

    # --- calls ------------------------------------------------------------------------

    def _dispatch(self) -> int:
        """Give queued groups to free replicas and generated ones to free
        environment procs; how many calls were sent."""
        sent = 0
        for rank in self.generating.free(self.policy.size, self.cfg.calls_per_replica):
            with self._taking:  # taken and sent as one, for `hand_out`
                if not self.pending:
                    break
                groups = [
                    self.pending.popleft()
                    for _ in range(min(self.cfg.groups_per_call, len(self.pending)))
                ]
                now = time.monotonic()
                for group in groups:
                    group.sent, group.replica = now, rank
                ids = [row for g in groups for row in g.ids]
                seeds = [s for g in groups for s in g.seeds]
                pixels = [row for g in groups for row in g.pixels or [None] * len(g.ids)]
                self._start("policy", rank, groups, self.send(rank, ids, seeds, shard(pixels)))
            sent += 1
        free = self.scoring.free(self.environment.size, 1)
        for n, rank in enumerate(free):
            if not self.to_score:
                break
            # The groups waiting, shared over the free procs: one call scores several
            # when scoring falls behind (a call costs its slowest episode's latency).
            take = -(-len(self.to_score) // (len(free) - n))
            groups = [self.to_score.popleft() for _ in range(take)]
            prompts = [g.prompt for g in groups for _ in range(self.k)]
            texts = [text for g in groups for text in g.completions.completion_lists()]
            self._start("environment", rank, groups, self.score(rank, prompts, texts))
            sent += 1
        return sent

    def _start(self, role: str, rank: int, groups: list[Group], future: Any) -> None:
        calls = self.generating if role == "policy" else self.scoring
        calls.sent += 1
        calls.running[rank, calls.sent] = groups
        handle = self.policy if role == "policy" else self.environment
        calls.epochs[rank, calls.sent] = getattr(handle, "respawns", 0)
        endpoint = "generate" if role == "policy" else "score"
        self.waiter.add((role, rank, calls.sent), future, f"{role}.{endpoint}[{rank}]")

    def _poll(self, timeout_s: float = POLL_S) -> int:
        """Take the answers that came (waiting up to `timeout_s` for the first);
        how many."""
        came = 0
        while True:
            try:
                (role, rank, number), answer, error = self.waiter.done.get(
                    timeout=timeout_s if not came else 0
                )
            except queue.Empty:
                return came
            self.waiter.in_flight -= 1
            calls = self.generating if role == "policy" else self.scoring
            came += 1
            # A group leaves `running` and lands in the queue as one, for `hand_out`.
            with self._taking:
                groups = calls.running.pop((rank, number))
                epoch = calls.epochs.pop((rank, number), 0)
                if error is not None:
                    self._failed(role, rank, groups, error, epoch)
                elif role == "policy":
                    self._generated(groups, answer)
                else:
                    rewards, failures = answer
                    for n, group in enumerate(groups):  # each group's rows and failures
                        rows = range(n * self.k, (n + 1) * self.k)
                        mine = {i - rows.start: r for i, r in failures.items() if i in rows}
                        self._scored(group, (rewards[rows.start : rows.stop], mine))

    def _generated(self, groups: list[Group], completions: Any) -> None:
        for n, group in enumerate(groups):
            group.completions = completions.rows(slice(n * self.k, (n + 1) * self.k))
            group.version = completions.weight_version
            group.published = self.sync.published_at.get(group.version, self.sync.published)
            self.to_score.append(group)

    def _scored(self, group: Group, answer: tuple) -> None:
        rewards, failures = answer
        if failures:  # the group is dropped, counted, and a fresh prompt takes its place
            self.collector.count_failures(list(failures.values()), self.k, {}, 0)
            self.state.ledger.generated += self.k
            return
        group.rewards = torch.tensor(rewards, dtype=torch.float32)
        group.latency_s = time.monotonic() - group.sent
        self.generated.append(self._shape(group))
        self.complete.append(group)

    def _shape(self, group: Group) -> tuple[float, float]:
        return group.latency_s, group.completions.completion_mask.sum().item() / self.k

    def _failed(
        self, role: str, rank: int, groups: list[Group], error: RemoteCallError, epoch: int = 0
    ) -> None:
        """A call failed: its groups go back to the queue. A lost proc is replaced
        (once: a call sent before the role's last replacement finds it done) and
        an error raised in the actor retried per `faults.retry_errors`; either way
        a generation's groups are generated again with the same seeds, counted as
        redone (`policy_lost`, as the static split counts them)."""
        handle = self.policy if role == "policy" else self.environment
        if role == "policy":
            self.pending.extendleft(reversed(groups))
        else:
            self.to_score.extendleft(reversed(groups))
        if error.proc_lost and epoch < getattr(handle, "respawns", 0):
            if role == "policy":
                self.state.ledger.redo("policy_lost", len(groups) * self.k)
        elif error.stray:  # its procs answer: the groups are sent again, nothing lost
            self.sup.stray(self.policy if role == "policy" else self.environment, error)
        elif error.proc_lost:
            if role == "policy":
                self.state.ledger.redo("policy_lost", len(groups) * self.k)
            self.sup.recover(self.policy if role == "policy" else self.environment, error)
        else:  # each call is retried `faults.retry_errors` times, as a split call is
            self.sup.retry(error, max(g.errors for g in groups))
            for group in groups:
                group.errors += 1
            if role == "policy":
                self.state.ledger.redo("policy_lost", len(groups) * self.k)

    def _drain(self, role: str) -> None:
        """Until no call is under way on `role` (each collected or failed)."""
        calls = self.generating if role == "policy" else self.scoring
        deadline = time.monotonic() + self.sup.timeout_s
        while calls.running and time.monotonic() < deadline:
            self._poll()

    # --- checkpoints ------------------------------------------------------------------

    def settle(self) -> None:
        """Wait until nothing is under way: every taken group generated and scored."""
        self.pause()
        deadline = time.monotonic() + self.sup.timeout_s
        while self.generating.running or self.scoring.running or self.to_score:
            if time.monotonic() > deadline:
                raise RemoteCallError(
                    f"the rollout queue did not settle within {self.sup.timeout_s:g}s",
                    "policy",
                    timed_out=True,
                )
            self._dispatch_scoring()
            self._poll()

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
            "stragglers": self.stragglers,
            "pending": [(g.id, g.prompt, g.ids, g.seeds, g.pixels) for g in self.pending],
            "complete": [
                (g.id, g.prompt, g.ids, g.seeds, g.completions, g.rewards)
                + (behind - g.published, g.latency_s, g.late)
                for g in self.complete
            ],
        }

    def load(self, saved: dict | None) -> None:
        """The queue as `save` left it (None: empty), e.g. after a resume."""
        saved = saved or {"next_id": 0, "pending": [], "complete": []}
        self.next_id = saved["next_id"]
        self.stragglers = saved.get("stragglers")  # (absent from older checkpoints)
        self.pending = deque(
            Group(*entry[:4], pixels=entry[4] if len(entry) > 4 else None)
            for entry in saved["pending"]
        )
        self.complete = []
        for gid, prompt, ids, seeds, completions, rewards, behind, latency, late in saved[
            "complete"
        ]:
            group = Group(gid, prompt, ids, seeds, 0.0, completions, rewards)
            group.published, group.latency_s, group.late = (
                self.sync.published - behind,
                latency,
                late,
            )
            self.complete.append(group)

    def drop_all(self, reason: str) -> int:
        """Forget everything queued and under way (a rewind, the run's end):
        generated samples not trained count as dropped for `reason`."""
        self.pause()
        self._drain("policy")
        self._drain("environment")
        made = len(self.complete) + len(self.to_score)
        self.state.ledger.generated += made * self.k
        self.state.ledger.drop(reason, made * self.k)
        self.complete, self.pending = [], deque()
        self.to_score = deque()
        return made * self.k
