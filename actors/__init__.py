"""One Monarch actor per role, importable from here (`from actors import Policy,
Trainer, Environment`); each class is imported on first use, so a proc that
imports one actor's module loads no other."""

from __future__ import annotations

from meshrl import lazy_exports

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


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
