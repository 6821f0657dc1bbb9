"""The `health:` section: checks that find bad hosts before they cost a step
(preflight), slow and hung procs while the run goes, and run-health alarms."""

from __future__ import annotations

from dataclasses import dataclass

from meshrl.config.files import check as _check


@dataclass
class HealthConfig:
    """Host and proc health (docs/reliability.md)."""

    preflight: bool = True
    """Check every host of every allocation (at the start, after a recovery, when a
    pool grows) before any role's actor is spawned on it."""
    preflight_s: float = 0.3
    """Seconds of matmuls each host's device check runs (longer than a CPU quota's
    100 ms period, so a throttled host shows; a `local` job, one host, runs 0.05)."""
    min_ratio: float = 0.5
    """A host whose preflight figures fall below this share of the allocation's
    median (or that fails a check) is quarantined and replaced."""
    slow_ratio: float = 2.0
    """A proc whose call times exceed this multiple of its role's median ..."""
    slow_steps: int = 3
    """... for this many steps in a row is reported slow."""
    evict_slow: bool = False
    """Replace a slow proc as a lost one (its host quarantined after
    `faults.quarantine_after` evictions)."""
    hang_s: float = 10.0
    """A proc that answers no heartbeat for this long is hung: its stacks go to
    faults.log, it is killed and replaced. 0: only the call deadline."""
    flat_steps: int = 0
    """Alarm when the reward has not moved for this many steps; 0: off."""
    flat_range: float = 0.01
    """... "not moved": the step's mean reward stayed within this range."""
    idle_share: float = 0.95
    """Alarm when the trainer, or generation, is idle more than this share of a step."""
    sync_ratio: float = 3.0
    """Alarm when a weight sync takes more than this multiple of its running median."""
    dropped_share: float = 0.0
    """Alarm when a step drops more than this share of the samples it generated."""
    mismatch_kl: float = 0.01
    """Alarm when the k3 KL between the sampler's and the trainer's log-probs exceeds this ..."""
    mismatch_share: float = 0.05
    """... or this share of tokens has a trainer/sampler ratio outside [0.9, 1.1]."""
    entropy_ratio: float = 0.1
    """Alarm when the sampler's entropy falls below this share of the run's first step's."""

    def validate(self, key: str = "health") -> None:
        _check(0 < self.preflight_s <= 10, f"{key}.preflight_s", "must be in (0, 10]")
        _check(0 < self.min_ratio <= 1, f"{key}.min_ratio", "must be in (0, 1]")
        _check(self.slow_ratio > 1, f"{key}.slow_ratio", "must be > 1")
        _check(self.slow_steps >= 1, f"{key}.slow_steps", "must be >= 1")
        _check(self.hang_s >= 0, f"{key}.hang_s", "must be >= 0 (0: off)")
        _check(self.flat_steps >= 0, f"{key}.flat_steps", "must be >= 0 (0: off)")
        _check(self.flat_range >= 0, f"{key}.flat_range", "must be >= 0")
        _check(0 < self.idle_share <= 1, f"{key}.idle_share", "must be in (0, 1]")
        _check(self.sync_ratio > 1, f"{key}.sync_ratio", "must be > 1")
        _check(0 <= self.dropped_share < 1, f"{key}.dropped_share", "must be in [0, 1)")
        _check(self.mismatch_kl > 0, f"{key}.mismatch_kl", "must be > 0")
        _check(0 < self.mismatch_share <= 1, f"{key}.mismatch_share", "must be in (0, 1]")
        _check(0 <= self.entropy_ratio < 1, f"{key}.entropy_ratio", "must be in [0, 1)")
