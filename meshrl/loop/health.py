"""Run health, step by step: slow procs found while the run goes, and alarms.

`StepLog.step` hands every step's record and each proc's report to
`Health.step`, which

- compares each proc's endpoint call times in the step with the other procs
  of its role (the median of theirs, endpoint by endpoint: the role's median
  with the proc itself left out, so that of two procs the slow one does not
  pull the median up to itself). A proc slower than `health.slow_ratio` for
  `health.slow_steps` steps in a row is reported (one console line,
  faults.log, status.json) and, with `health.evict_slow` and a role that
  replaces one proc alone (a pool: `Run.elastic`), killed, so that the loop
  replaces it as a lost one: its calls are made again with the same seeds,
  and the run ends where it would have ended without the slow proc. On SLURM
  each eviction counts as a loss on its node (`faults.quarantine_after`).
- adds the step's health figures and says in one console line when an alarm
  trips (`health.*` thresholds; docs/observability.md has the table).

Figures that follow from the run's math alone are `health/*` (a resumed run,
or one with faults, logs the same); those of wall-clock times or of faults
are `time/health/*` and `samples/*`, which the exact-resume and fault-free
comparisons leave out, as every wall-clock figure.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from meshrl.model.losses import OFF_BAND as BAND  # a ratio outside it: mismatched
from meshrl.procs.mesh import log_fault

MIN_CALL_S = 0.005
"""Calls shorter than this (the others' median) are timer noise: no proc is compared on them."""
SYNC_HISTORY = 50
"""Weight syncs the running median is taken over."""


def proc_calls(procs: list[dict]) -> dict[tuple[str, int], dict[str, tuple[int, float]]]:
    """(role, rank) -> `role/endpoint` -> (calls, seconds) of its step (`Watch.report`)."""
    return {
        (p["role"], p["rank"]): p["calls"]
        for p in procs
        if p.get("calls") and "role" in p and "rank" in p
    }


def slow_ratios(calls: dict[tuple[str, int], dict]) -> dict[tuple[str, int], float]:
    """(role, rank) -> how many times slower its calls were than its role's others
    (each endpoint's mean call against the median of the others' means, summed
    over the endpoints both called), for roles with two procs or more that called."""
    roles: dict[str, list[tuple[str, int]]] = {}
    for key in calls:
        roles.setdefault(key[0], []).append(key)
    ratios = {}
    for members in roles.values():
        if len(members) < 2:
            continue
        means = {
            m: {e: s / n for e, (n, s) in calls[m].items() if n} for m in members
        }  # per-call seconds by endpoint
        for me in members:
            mine = others = 0.0
            for endpoint, seconds in means[me].items():
                theirs = [means[m][endpoint] for m in members if m != me and endpoint in means[m]]
                if theirs:
                    mine += seconds
                    others += statistics.median(theirs)
            if others >= MIN_CALL_S:
                ratios[me] = mine / others
    return ratios


def busy_share(calls: dict[tuple[str, int], dict], endpoint: str, wall_s: float) -> float | None:
    """The mean share of the step that the procs calling `endpoint` spent in calls
    (every endpoint of theirs), or None when none did."""
    busy = [
        sum(s for _, s in ends.values())
        for ends in calls.values()
        if any(e.rsplit("/", 1)[-1] == endpoint for e in ends)
    ]
    if not busy or wall_s <= 0:
        return None
    return min(1.0, sum(busy) / len(busy) / wall_s)


def non_finite(record: dict) -> int:
    """How many of the record's figures are NaN or infinite."""
    return sum(
        1
        for v in record.values()
        if isinstance(v, float) and not math.isfinite(v)  # (ints are always finite)
    )


def flat_steps(history: list[dict], reward: float, tolerance: float) -> int:
    """Steps in a row, ending with this one (`reward`), whose `reward/mean`
    stayed within `tolerance` of each other."""
    low = high = reward
    count = 1
    for record in reversed(history):
        value = record.get("reward/mean")
        if value is None:
            break
        low, high = min(low, value), max(high, value)
        if high - low > tolerance:
            break
        count += 1
    return count


class Health:
    """The checks above, for one run (`StepLog` builds it). `logger.history`: the
    step records logged so far, a resumed run's earlier ones included, none undone
    by a rewind (the running figures start from them, so a resumed run logs what
    an uninterrupted one does)."""

    def __init__(self, run: Any, logger: Any):
        self.run, self.cfg, self.logger = run, run.cfg.health, logger
        self.slow_in_row: dict[tuple[str, int], int] = {}
        self.tripped: dict[str, str] = {}  # alarm -> its line, while it holds
        self.evicted: list[str] = []
        self.sync_s = [r["time/weight_sync_s"] for r in self.history if "time/weight_sync_s" in r]

    @property
    def history(self) -> list[dict]:
        return self.logger.history

    def step(self, record: dict, procs: list[dict], wall_s: float) -> dict:
        """The step's health figures (to add to `record`); alarms said, slow procs
        reported (and evicted), status.json's `health` kept."""
        step = record.get("step", len(self.history))
        figures = self.figures(record, procs, wall_s)
        alarms = self.alarms(record, figures)
        alarms.update(self.slow(proc_calls(procs), step))
        for name, line in alarms.items():
            if name not in self.tripped:  # one line as it trips, not one per step it holds
                print(f"health: step {step}: {line}", flush=True)
                if self.run.observe is not None:
                    self.run.observe.alarm(step, name, line)
        self.tripped = alarms
        if self.run.status is not None:
            self.run.status.extra["health"] = {
                "step": step,
                "alarms": alarms,
                "slow": [f"{r}[{n}]" for (r, n), k in self.slow_in_row.items() if k],
                "evicted": self.evicted,
            }
        return figures

    def figures(self, record: dict, procs: list[dict], wall_s: float) -> dict:
        cfg, calls, out = self.cfg, proc_calls(procs), {}
        out["health/nonfinite"] = non_finite(record)
        if "sampling/k3_kl" in record:  # the trainer recomputed the old log-probs
            out["health/mismatch_k3"] = record["sampling/k3_kl"]
            out["health/mismatch_out_of_band"] = record["sampling/ratio_off_band"]
        if "policy/entropy" in record:
            first = next((r["policy/entropy"] for r in self.history if "policy/entropy" in r), None)
            first = record["policy/entropy"] if first is None else first
            out["health/entropy_ratio"] = record["policy/entropy"] / first if first > 0 else 1.0
        if "reward/mean" in record:
            out["health/reward_flat_steps"] = flat_steps(
                self.history, record["reward/mean"], cfg.flat_range
            )
        if "samples/dropped" in record:
            made = record["samples/dropped"] + record.get("samples/trained", 0)
            out["samples/dropped_share"] = record["samples/dropped"] / made if made else 0.0
        for name, endpoint in (("trainer", "train_step"), ("generation", "generate")):
            busy = busy_share(calls, endpoint, wall_s)
            if busy is not None:
                out[f"time/health/{name}_idle_share"] = 1.0 - busy
        sync = record.get("time/weight_sync_s")
        if sync is not None:
            if len(self.sync_s) >= 3:
                median = statistics.median(self.sync_s[-SYNC_HISTORY:])
                out["time/health/weight_sync_ratio"] = sync / median if median > 0 else 1.0
            self.sync_s.append(sync)
        out["time/health/slow_procs"] = sum(r > cfg.slow_ratio for r in slow_ratios(calls).values())
        return out

    def alarms(self, record: dict, f: dict) -> dict[str, str]:
        """The alarms that hold at this step: name -> its line."""
        cfg, on = self.cfg, {}
        if f["health/nonfinite"]:
            bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
            on["nonfinite"] = f"NaN or Inf in {', '.join(sorted(bad)[:5])}"
        if f.get("health/mismatch_k3", 0) > cfg.mismatch_kl:
            on["mismatch_kl"] = (
                f"sampler/trainer k3 KL {f['health/mismatch_k3']:.3g} > "
                f"health.mismatch_kl={cfg.mismatch_kl:g}"
            )
        share = record.get("health/mismatch_out_of_band", 0)
        if share > cfg.mismatch_share:
            on["mismatch_share"] = (
                f"{share:.1%} of tokens have a trainer/sampler ratio outside "
                f"[{BAND[0]}, {BAND[1]}] > health.mismatch_share={cfg.mismatch_share:g}"
            )
        if f.get("health/entropy_ratio", 1.0) < cfg.entropy_ratio:
            on["entropy"] = (
                f"entropy collapse: {record['policy/entropy']:.3g} is "
                f"{f['health/entropy_ratio']:.1%} of the first step's "
                f"(< health.entropy_ratio={cfg.entropy_ratio:g})"
            )
        if cfg.flat_steps and f.get("health/reward_flat_steps", 0) >= cfg.flat_steps:
            on["reward_flat"] = (
                f"reward flat: reward/mean within {cfg.flat_range:g} for "
                f"{f['health/reward_flat_steps']} steps (health.flat_steps={cfg.flat_steps})"
            )
        if f.get("samples/dropped_share", 0) > cfg.dropped_share:
            on["dropped"] = (
                f"{record['samples/dropped']} samples dropped ({f['samples/dropped_share']:.0%} "
                f"of the step's; health.dropped_share={cfg.dropped_share:g})"
            )
        for name in ("trainer", "generation"):
            idle = f.get(f"time/health/{name}_idle_share", 0)
            if idle > cfg.idle_share:
                on[f"{name}_idle"] = (
                    f"{name} idle {idle:.0%} of the step (> health.idle_share={cfg.idle_share:g})"
                )
        if f.get("time/health/weight_sync_ratio", 0) > cfg.sync_ratio:
            on["weight_sync"] = (
                f"weight sync took {record['time/weight_sync_s']:.2f}s, "
                f"{f['time/health/weight_sync_ratio']:.1f}x its running median "
                f"(> health.sync_ratio={cfg.sync_ratio:g})"
            )
        return on

    def slow(self, calls: dict, step: int) -> dict[str, str]:
        """Count each proc's slow steps in a row; the alarms of those at
        `health.slow_steps` or more, each evicted (`health.evict_slow`) once."""
        cfg, on = self.cfg, {}
        ratios = slow_ratios(calls)
        for key in calls:  # a proc with no call this step keeps its count
            if key in ratios:
                self.slow_in_row[key] = (
                    self.slow_in_row.get(key, 0) + 1 if (ratios[key] > cfg.slow_ratio) else 0
                )
        for (role, rank), count in list(self.slow_in_row.items()):
            if count < cfg.slow_steps:
                continue
            name = f"{role}[{rank}]"
            line = (
                f"{name} slow: {ratios.get((role, rank), float('nan')):.1f}x the median of "
                f"its role's other procs for {count} steps in a row "
                f"(health.slow_ratio={cfg.slow_ratio:g}, health.slow_steps={cfg.slow_steps})"
            )
            if cfg.evict_slow and role in self.run.elastic:
                self.evict(role, rank, line)
                line += "; evicted, replaced as a lost proc"
                self.slow_in_row[(role, rank)] = 0  # its rank is a new proc's from now on
            elif cfg.evict_slow:
                line += f"; not evicted ({role} is not a pool: one proc is not replaced alone)"
            on[f"slow:{name}"] = line
        return on

    def evict(self, role: str, rank: int, why: str) -> None:
        """End the proc now, as a crash would: the loop's next call to it finds it
        lost and replaces it (`Supervisor.recover`), making its calls again."""
        name = f"{role}[{rank}]"
        log_fault(f"evicting {name}: {why}")
        self.evicted.append(name)
        self.run.roles[role].slice(procs=rank).exit_now.call_one()  # never answers
