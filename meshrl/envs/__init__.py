"""Environments: prompt sources with verifiable rewards.

A task samples `Prompt`s, scores a completion text for a prompt with a reward
in [0, 1], and (for a supervised warm-start) writes a demonstration. Tasks are
looked up by `task.name` in `TASKS`.
"""

from __future__ import annotations

from meshrl.envs.digits import ReverseDigits, Task

TASKS: dict[str, type[Task]] = {"reverse_digits": ReverseDigits}


def make_task(cfg) -> Task:
    """Build the task named by a `TaskConfig`."""
    return TASKS[cfg.name](cfg)


__all__ = ["TASKS", "Task", "ReverseDigits", "make_task"]
