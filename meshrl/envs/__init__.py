"""Environments: task instances, their episodes and rewards (`meshrl.envs.base`).

Single-turn tasks score one completion (`reverse_digits`, `math`, `countdown`,
`code`, and `vision_count` with pictures); multi-turn environments answer each
model turn until the episode is done (`calculator`, `slow_tool`, and
`vision_zoom`, whose tool returns a picture). `task.name` is a name in `TASKS`
or the import path of your own class (`mypkg.envs:MyEnv`, a subclass of `Env`).

Beside the tasks: the files they read (`dataset`, `sft_data` for SFT), episodes
played over the policy and environment meshes (`rollout`), and the policy's
OpenAI-compatible endpoint that an agent drives (`serve`).
"""

from __future__ import annotations

from meshrl.envs.base import Env, Episode, Step
from meshrl.envs.code import Code
from meshrl.envs.digits import ReverseDigits, Task
from meshrl.envs.math import Countdown, MathAnswer
from meshrl.envs.tools import Calculator, SlowTool
from meshrl.envs.vision import VisionCount, VisionZoom

TASKS: dict[str, type[Env]] = {
    "reverse_digits": ReverseDigits,
    "math": MathAnswer,
    "countdown": Countdown,
    "code": Code,
    "calculator": Calculator,
    "slow_tool": SlowTool,
    "vision_count": VisionCount,
    "vision_zoom": VisionZoom,
}


ADAPTERS = {
    "openenv": ("meshrl.envs.openenv", "OpenEnvTask"),
    "verifiers": ("meshrl.envs.verifiers", "VerifiersTask"),
    "agent": ("meshrl.envs.agent", "AgentTask"),
}
"""`task.name` prefixes: `openenv:...`, `verifiers:...` and `agent:...` name
another library's environment or your agent function, through an adapter."""


def env_class(name: str) -> type[Env]:
    """A shipped environment by name, an adapter by its prefix (`ADAPTERS`), or
    your own by import path (`package.module:ClassName`)."""
    import importlib

    if ":" not in name:
        return TASKS[name]
    prefix = name.partition(":")[0]
    if prefix in ADAPTERS:
        module, attr = ADAPTERS[prefix]
        return getattr(importlib.import_module(module), attr)
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


def make_task(cfg) -> Env:
    """Build the environment named by a `TaskConfig`."""
    return env_class(cfg.name)(cfg)


__all__ = [
    "ADAPTERS",
    "TASKS",
    "Env",
    "Episode",
    "Step",
    "Task",
    "ReverseDigits",
    "env_class",
    "make_task",
]
