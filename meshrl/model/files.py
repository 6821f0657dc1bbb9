"""A model's state as files: written whole (`save_state`) and read back as tensors
and plain containers only (`read`, `load_state`), so a file cannot run code.

These are the parts of a checkpoint each stateful role writes and reads (the
trainer's, the reference's, the critic's; a policy replica's sampling
generator), beneath both the actors and the loop's checkpoints
(`meshrl.loop.checkpoint`), which commit them, prove their bytes and keep the
newest.
"""

from __future__ import annotations

import os
from typing import Any


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message is one line."""


def read(path: str, device: Any = "cpu") -> Any:
    """A file of a checkpoint, read as tensors and plain containers only
    (`weights_only=True`: nothing in it can run code); anything else is refused
    in one line naming the file."""
    import pickle

    import torch

    try:
        return torch.load(path, map_location=device, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as error:
        # torch's message wraps the reason (the global refused) in boilerplate.
        parts = [" ".join(p.split()) for p in str(error).split("\n\n") if p.strip()]
        boiler = ("Weights only load failed", "Check the documentation", "Please file an issue")
        reason = [p for p in parts if not p.startswith(boiler)] or parts or [type(error).__name__]
        raise CheckpointError(
            f"{path} is not a checkpoint file meshrl can read safely: {reason[0]}"
        ) from None


def save_state(path: str, **parts) -> None:
    """torch.save of the state dicts of `parts` (modules, optimizers, schedulers)
    and plain values, written under a temporary name and renamed."""
    import torch

    state = {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in parts.items()}
    torch.save(state, path + ".tmp")
    with open(path + ".tmp", "rb") as f:  # on the disk from the host that wrote it
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def load_state(path: str, **parts) -> dict:
    """Load what `save_state` wrote into `parts`; returns the plain values.

    Read onto the CPU: each part's `load_state_dict` puts a tensor where its target
    lives (a parameter's device; an optimizer's `step` counter stays on the CPU, as
    torch keeps it unless the optimizer is fused or capturable)."""
    state = read(path, "cpu")
    for key, target in parts.items():
        target.load_state_dict(state[key])
    return {k: v for k, v in state.items() if k not in parts}
