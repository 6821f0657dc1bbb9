"""The running run's `faults.log`: mesh failures, recoveries and scheduler events
in full (the console shows one line per recovery). A leaf module, so that the
layers below the meshes (`meshrl.procs.slurm`) write to it too."""

from __future__ import annotations

import contextlib
import os
import time

path: str | None = None
"""The running run's `faults.log` (`begin`). Process-wide, as Monarch's fault hook
is (`meshrl.procs.mesh.install_fault_hook`), whose reports come from no call of
the run's. Without one (or with
MESHRL_DEBUG set) failures are logged to the console."""

ended: str | None = None
"""The `faults.log` of the run that ended last in this process (`end`): Monarch
reports a killed proc about 10 s after it died (a stop that timed out, after 30 s),
so the report of a proc that the run had already replaced may come after the run
ended; it belongs to that run's log."""

ended_at = 0.0
"""When that run ended (`_clock`, `time.monotonic`)."""

_clock = time.monotonic

LATE_S = 60.0
"""How long after its run ended a report still goes to that run's log; a later one
(a mesh a notebook made by hand afterwards) goes to the console."""


def begin(log: str) -> None:
    """The run whose log is `log` runs now in this process: failures go there."""
    global path
    path = log


def end(log: str) -> None:
    """The run whose log is `log` ended now."""
    global path, ended, ended_at
    path, ended, ended_at = None, log, _clock()


def current() -> str | None:
    """Where a failure reported now is written: the running run's log, else the
    log of the run that ended last if it ended less than `LATE_S` ago, else
    nowhere (None: the console)."""
    if path is not None:
        return path
    return ended if ended is not None and _clock() - ended_at < LATE_S else None


def debugging() -> bool:
    """--debug or MESHRL_DEBUG: every detail on the console."""
    return os.environ.get("MESHRL_DEBUG", "") not in ("", "0")


def log_fault(text: str) -> None:
    """Append `text`, timestamped, to the run's `faults.log` (if there is one)."""
    target = current()
    if target is None:
        return
    with contextlib.suppress(OSError), open(target, "a") as f:
        f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text.rstrip()}\n")
