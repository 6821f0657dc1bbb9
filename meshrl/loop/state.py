"""The controller's own state between steps: `LoopState` and its sample `Ledger`.

Everything a loop must carry over a checkpoint lives here, in one object whose
`state_dict()` holds every field (a unit test fails when a field is added but
not saved): the step, the random generators, the sample ledger, the fault
counters, the batches generated ahead and an algorithm's own data position.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Any

import torch


@dataclass
class Ledger:
    """Every sample generated is trained on once or dropped with a reason, so
    `generated == trained + sum(dropped.values())` after every step.

    `dropped` holds the run's totals by reason; `this_step` what was dropped
    since the last `count_step()`, which a step logs (a drop counted between
    two steps, such as a rewind's, is logged by the step after it).

    Work lost with a proc is not a drop: the same samples (same prompts, same
    per-row seeds) are generated again, and the batch that trains is the one that
    would have trained. `redone` counts those repeats by reason (`policy_lost`);
    they are not in `generated`."""

    generated: int = 0
    trained: int = 0
    dropped: Counter = field(default_factory=Counter)
    this_step: Counter = field(default_factory=Counter)
    redone: Counter = field(default_factory=Counter)
    redone_this_step: Counter = field(default_factory=Counter)

    def drop(self, reason: str, count: int) -> None:
        self.dropped[reason] += count
        self.this_step[reason] += count

    def redo(self, reason: str, count: int) -> None:
        """`count` samples generated again, the same ones, after `reason`."""
        self.redone[reason] += count
        self.redone_this_step[reason] += count

    def count_step(
        self, trained: int, reasons: tuple[str, ...] = (), redo_reasons: tuple[str, ...] = ()
    ) -> dict[str, int]:
        """Count `trained` samples of this step; the step's drops and repeats by
        reason (every reason in `reasons` and `redo_reasons` logged, 0 if none) and
        the run's totals."""
        self.trained += trained
        step, self.this_step = self.this_step, Counter()
        again, self.redone_this_step = self.redone_this_step, Counter()
        metrics = {f"samples/dropped_{r}": step[r] for r in sorted({*reasons, *step})}
        redone = {f"samples/redone_{r}": again[r] for r in sorted({*redo_reasons, *again})}
        return {
            "samples/trained": trained,
            **metrics,
            **redone,
            "samples/dropped": sum(step.values()),
            "samples/generated_total": self.generated,
            "samples/trained_total": self.trained,
            "samples/dropped_total": sum(self.dropped.values()),
            "samples/redone_total": sum(self.redone.values()),
        }

    def state_dict(self) -> dict:
        return {
            "generated": self.generated,
            "trained": self.trained,
            "dropped": dict(self.dropped),
            "this_step": dict(self.this_step),
            "redone": dict(self.redone),
            "redone_this_step": dict(self.redone_this_step),
        }

    def load_state_dict(self, state: dict) -> None:
        self.generated, self.trained = state["generated"], state["trained"]
        self.dropped, self.this_step = Counter(state["dropped"]), Counter(state["this_step"])
        # (Checkpoints written before `redone` was kept have none.)
        self.redone = Counter(state.get("redone", {}))
        self.redone_this_step = Counter(state.get("redone_this_step", {}))


@dataclass
class LoopState:
    """What the controller carries from step to step (see the module docstring).

    `counters` are the run's running totals (errors retried, non-finite steps,
    skipped prompts, ...); `recoveries` one line per replaced mesh (its length is
    the recovery budget used); `ahead` the batches generated for later steps
    (`max_staleness`), saved collected; `data` an algorithm's own position in
    its data (e.g. DPO's queue of pairs)."""

    seed: int = 0
    step: int = 0
    rng: random.Random = field(default_factory=random.Random)
    torch_rng: torch.Generator = field(default_factory=torch.Generator)
    ledger: Ledger = field(default_factory=Ledger)
    counters: Counter = field(default_factory=Counter)
    recoveries: list[str] = field(default_factory=list)
    ahead: list = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rng.seed(self.seed)
        self.torch_rng.manual_seed(self.seed)

    def state_dict(self, save_batch: Any = None) -> dict[str, Any]:
        """Every field. `save_batch(batch)` gives what a batch of `ahead` saves
        (`Collector.save`, which collects it first)."""
        assert save_batch or not self.ahead, "batches generated ahead need save_batch"
        return {
            "seed": self.seed,
            "step": self.step,
            "rng": self.rng.getstate(),
            "torch_rng": self.torch_rng.get_state(),
            "ledger": self.ledger.state_dict(),
            "counters": dict(self.counters),
            "recoveries": list(self.recoveries),
            "ahead": [save_batch(b) for b in self.ahead],
            "data": dict(self.data),
        }

    def load_state_dict(
        self, state: dict[str, Any], restore_batch: Any = None, counts: bool = True
    ) -> None:
        """The state saved by `state_dict`. `restore_batch(saved)` rebuilds a batch
        of `ahead` (`Collector.restore`). `counts=False` (a rewind inside the run)
        keeps the ledger, counters and recoveries: they count what really happened,
        and the restored `ahead` batches count as generated again."""
        missing = {f.name for f in fields(self)} - set(state)
        assert not missing, f"checkpoint lacks {sorted(missing)}"
        self.seed, self.step = state["seed"], state["step"]
        self.rng.setstate(state["rng"])
        self.torch_rng.set_state(state["torch_rng"])
        if counts:
            self.ledger.load_state_dict(state["ledger"])
            self.counters = Counter(state["counters"])
            self.recoveries = list(state["recoveries"])
        self.ahead = [restore_batch(saved) for saved in state["ahead"]] if restore_batch else []
        if not counts:
            self.ledger.generated += sum(len(b) for b in self.ahead)
        self.data = dict(state["data"])

    def count(self, key: str, by: int = 1) -> None:
        self.counters[key] += by

    def next_items(self, total: int, count: int) -> list[int]:
        """The next `count` of shuffled passes over `range(total)` (an offline
        dataset's rows). The position is in `data`, so a resumed run goes on
        where it was."""
        queue = self.data.setdefault("queue", [])
        while len(queue) < count:
            more = list(range(total))
            self.rng.shuffle(more)
            queue += more
        taken, self.data["queue"] = queue[:count], queue[count:]
        return taken
