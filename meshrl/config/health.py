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

    def validate(self, key: str = "health") -> None:
        _check(0 < self.min_ratio <= 1, f"{key}.min_ratio", "must be in (0, 1]")
        _check(self.slow_ratio > 1, f"{key}.slow_ratio", "must be > 1")
        _check(self.slow_steps >= 1, f"{key}.slow_steps", "must be >= 1")
        _check(self.hang_s >= 0, f"{key}.hang_s", "must be >= 0 (0: off)")
        _check(self.flat_steps >= 0, f"{key}.flat_steps", "must be >= 0 (0: off)")
