"""The running run's `faults.log`: mesh failures, recoveries and scheduler events
in full (the console shows one line per recovery). A leaf module, so that the
layers below the meshes (`meshrl.procs.slurm`) write to it too."""

from __future__ import annotations

import contextlib
import os
import time

path: str | None = None
"""The running run's `faults.log` (`Run` sets it). Without one (or with
MESHRL_DEBUG set) failures are logged to the console."""


def debugging() -> bool:
    """--debug or MESHRL_DEBUG: every detail on the console."""
    return os.environ.get("MESHRL_DEBUG", "") not in ("", "0")


def log_fault(text: str) -> None:
    """Append `text`, timestamped, to the run's `faults.log` (if there is one)."""
    if path is None:
        return
    with contextlib.suppress(OSError), open(path, "a") as f:
        f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text.rstrip()}\n")
