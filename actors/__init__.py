"""One Monarch actor per role, importable from here (`from actors import Policy,
Trainer, Environment`); each class is imported on first use, so a proc that
imports one actor's module loads no other."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Policy": "actors.policy",
    "Trainer": "actors.trainer",
    "Environment": "actors.environment",
    "Reference": "actors.reference",
    "Critic": "actors.critic",
    "RewardModel": "actors.reward_model",
}
"""Exported name -> the module it is defined in."""

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'actors' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
