"""Checkpoints of a whole RL run, written atomically, the last K kept.

A checkpoint is a directory `<run dir>/checkpoints/step_<NNNNNNNN>/` holding one
file per stateful role (the trainer's model, optimizer and schedule, the
reference's frozen weights, the critic's model and optimizer) and the
controller's `controller.pt` (the next step, its random generators, the policy
replicas' sampling generators). It is assembled under a temporary name and
renamed into place only when every part is written, with a `COMPLETE` marker
last, so a crash while writing leaves the previous checkpoint as the newest
valid one.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass

from meshrl.config import ConfigError

COMPLETE = "COMPLETE"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the message is one line."""


_NAME = re.compile(r"^step_(\d{8})$")


@dataclass
class CheckpointConfig:
    every: int = 0
    """Steps between checkpoints; 0 writes none."""
    keep: int = 2
    """How many of the newest checkpoints to keep."""
    resume: str = ""
    """'' starts fresh; 'auto' continues from the newest complete checkpoint in
    the run directory (fresh if there is none); or a checkpoint directory."""

    def validate(self) -> None:
        if self.every < 0:
            raise ConfigError("config key 'checkpoint.every': must be >= 0")
        if self.keep < 1:
            raise ConfigError("config key 'checkpoint.keep': must be >= 1")
        if self.resume not in ("", "auto") and not os.path.isfile(
            os.path.join(self.resume, COMPLETE)
        ):
            raise ConfigError(
                f"config key 'checkpoint.resume': {self.resume} is not a complete checkpoint"
            )


def root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def begin(run_dir: str, step: int) -> str:
    """A fresh temporary directory to write the checkpoint after `step` steps into."""
    path = os.path.join(root(run_dir), f".partial_step_{step:08d}")
    shutil.rmtree(path, ignore_errors=True)  # a previous attempt that crashed
    os.makedirs(path)
    return path


def commit(partial: str, keep: int) -> str:
    """Mark `partial` complete, move it into place, drop all but the newest `keep`."""
    with open(os.path.join(partial, COMPLETE), "w") as f:
        f.write("ok\n")
        f.flush()
        os.fsync(f.fileno())
    final = os.path.join(os.path.dirname(partial), os.path.basename(partial)[len(".partial_") :])
    shutil.rmtree(final, ignore_errors=True)
    os.replace(partial, final)
    for old in complete(os.path.dirname(final))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def complete(checkpoints: str) -> list[str]:
    """Complete checkpoint directories under `checkpoints`, oldest first."""
    if not os.path.isdir(checkpoints):
        return []
    found = [
        os.path.join(checkpoints, name)
        for name in os.listdir(checkpoints)
        if _NAME.match(name) and os.path.isfile(os.path.join(checkpoints, name, COMPLETE))
    ]
    return sorted(found)


def latest(run_dir: str) -> str | None:
    """The newest complete checkpoint of a run, or None."""
    found = complete(root(run_dir))
    return found[-1] if found else None


def step_of(path: str) -> int:
    """Steps done when the checkpoint at `path` was written."""
    return int(_NAME.match(os.path.basename(path.rstrip("/"))).group(1))


def save_state(path: str, **parts) -> None:
    """torch.save of the state dicts of `parts` (modules, optimizers, schedulers)
    and plain values, written under a temporary name and renamed."""
    import torch

    state = {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in parts.items()}
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def load_state(path: str, device, **parts) -> dict:
    """Load what `save_state` wrote into `parts`; returns the plain values."""
    import torch

    state = torch.load(path, map_location=device, weights_only=False)
    for key, target in parts.items():
        target.load_state_dict(state[key])
    return {k: v for k, v in state.items() if k not in parts}
