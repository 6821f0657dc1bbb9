"""Step timing and logging for a controller loop.

    with log.timer("train"):          # adds time/train_s to this step's record
        ...
    log.step({"step": step, **metrics})

`StepLog.step` writes one record: the loop's metrics, the step's timers, and
what every actor recorded since the last step (`meshrl.observe.telemetry.record`,
reduced over the meshes) and the step's health figures (`meshrl.loop.health`:
slow procs, alarms) to `metrics.jsonl` and the sinks (`RunLogger`), and each
proc's state to `status.json`.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch

from meshrl.loop.health import Health
from meshrl.loop.state import LoopState
from meshrl.observe.metrics import RunLogger
from meshrl.weights.publisher import rdma_backend


class StepLog:
    def __init__(
        self,
        run: Any,
        total_steps: int,
        first_step: int = 0,
        headline: str = "reward/mean",
    ):
        """A resumed run (`first_step` > 0) keeps the records of earlier steps and
        drops later ones."""
        self.run = run
        cfg = run.cfg.run
        run.report()  # actors' metrics from before the loop belong to no step
        self.logger = RunLogger(
            run.dir,
            total_steps,
            progress=cfg.progress,
            desc=run.name,
            headline=headline,
            first_step=first_step,
            sinks=tuple(cfg.sinks),
        )
        self.times: dict[str, float] = {}
        self.health = Health(run, self.logger)
        self.next_step = first_step  # the step after the last one logged
        self.step_started = time.time()

    @property
    def history(self) -> list[dict]:
        return self.logger.history

    def begin_step(self, step: int) -> None:
        """Open `step` (`meshrl.loop.steps.Steps` does, before the loop's body): its
        timers start over, so what a step that was not logged (undone by a rewind)
        timed is dropped; and the profiler starts if one is due (`Run.step_begins`)."""
        self.times = {}
        self.run.step_begins(step)
        self.step_started = time.time()

    @contextlib.contextmanager
    def timer(self, name: str) -> Iterator[None]:
        """Time the block into this step's `time/<name>_s` (summed if repeated)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            key = f"time/{name}_s"
            self.times[key] = self.times.get(key, 0.0) + time.perf_counter() - started

    def step(self, metrics: dict[str, Any]) -> None:
        """Record one step (see the module docstring); the timers start over."""
        recorded, procs = self.run.report()
        times, self.times = self.times, {}
        record = {**recorded, **times, **metrics}
        record.update(self.health.step(record, procs, time.time() - self.step_started))
        if self.run.status is not None:
            self.run.status.write(procs, step=metrics.get("step"))
        self.logger.log(record)
        step = metrics.get("step", self.next_step)
        self.next_step = step + 1
        self.run.step_ends(step, self.step_started, time.time(), record)

    def samples(
        self, step: int, prompts: list[str], texts: list[str], rewards, advantages, mask
    ) -> None:
        """Every `run.samples_every` steps: the step's prompts, completions, rewards
        and advantages (a per-token advantage as its mean) in samples.jsonl."""
        every = self.run.cfg.run.samples_every
        if not every or step % every:
            return
        if advantages.dim() == 2:
            advantages = (advantages * mask).sum(1) / mask.sum(1).clamp(min=1)
        rows = [
            {"prompt": p, "completion": c, "reward": float(r), "advantage": float(a)}
            for p, c, r, a in zip(prompts, texts, rewards, advantages, strict=True)
        ]
        self.logger.log_samples(step, rows, console=self.run.cfg.run.console_samples)

    def rewind(self, step: int) -> None:
        self.times = {}
        self.next_step = step
        self.logger.rewind(step)

    def close(self, plot: bool = True, weights: str = "") -> None:
        """The headline curve (`reward.png`, `eval.png`) and the summary line."""
        self.logger.close()
        if plot:
            self.logger.plot_reward(f"{self.logger.headline.split('/')[0]}.png")
            print(f"{self.run.name}: {self.logger.summary()}{weights}", flush=True)


def rollout_metrics(rewards: torch.Tensor, completions: Any, sync: Any) -> dict:
    """What every on-policy step logs about its rollouts and weights."""
    mask = completions.completion_mask
    return {
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
        "reward/max": rewards.max().item(),
        "tokens/generated": int(mask.sum().item()),
        "completion/mean_length": mask.sum(1).mean().item(),
        "weights/version": sync.version,
        "weights/shm_replicas": sync.paths.count("shm"),
        "weights/rdma_replicas": sync.paths.count("rdma"),
        "weights/trainer_egress_bytes": sync.egress_bytes,
        "weights/max_hop_depth": sync.depth,
        "weights/verified_replicas": sync.verified,
        "weights/bytes_moved": sync.bytes_moved,
        "weights/replica_bytes": sync.replica_bytes,
        "weights/generated_with": completions.weight_version,
    }


def weight_paths(paths: list[str]) -> str:
    """How the replicas took their weights, for the summary line."""
    if not paths:
        return ""
    shm, rdma = paths.count("shm"), paths.count("rdma")
    ways = [f"{shm} by shared memory"] * bool(shm) + [
        f"{rdma} over RDMA ({rdma_backend()})"
    ] * bool(rdma)
    return " | replicas' weights: " + ", ".join(ways)


def run_faults(state: LoopState) -> str:
    """What the summary line says of faults: the procs replaced and the samples
    dropped and redone, by reason (nothing when there were none)."""
    parts = []
    if state.recoveries:
        roles = Counter(entry.split(":")[0] for entry in state.recoveries)
        parts.append("recoveries: " + ", ".join(f"{n} {role}" for role, n in sorted(roles.items())))
    for word, counts in (("dropped", state.ledger.dropped), ("redone", state.ledger.redone)):
        counted = {reason: n for reason, n in sorted(counts.items()) if n}
        if counted:
            parts.append(
                f"samples {word}: {sum(counted.values())} ("
                + ", ".join(f"{n} {reason}" for reason, n in counted.items())
                + ")"
            )
    return "".join(f" | {part}" for part in parts)


def add_evaluation(
    record: dict, step: int, every: int, steps: int, before: dict | None, evaluate: Any
) -> None:
    """The held-out figures a step's `record` carries: those measured before the
    first update (`before`, as `<key>_before`) in step 0's, and `evaluate()`'s
    every `every` steps and after the last of `steps`."""
    if step == 0 and before:
        record.update({f"{key}_before": value for key, value in before.items()})
    if (step + 1) % every == 0 or step == steps - 1:
        record.update(evaluate())
