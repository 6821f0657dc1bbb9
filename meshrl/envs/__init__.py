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

from meshrl.config import ConfigError, TaskConfig
from meshrl.config.files import check
from meshrl.envs.base import Env, Episode, Step
from meshrl.envs.code import Code
from meshrl.envs.dataset import DatasetError, task_rows
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


def check_task(cfg: TaskConfig) -> None:
    """`task.name` resolves to an environment (an adapter checks the rest of the
    name: the module, the server's URL) and `task.dataset`'s rows read with the
    task's fields: a `ConfigError` naming the key otherwise. Run when a run's
    config is loaded, before any proc is spawned (`TaskConfig.validate` checks
    the keys' values only)."""
    if ":" in cfg.name:
        try:
            cls = env_class(cfg.name)
        except (ImportError, AttributeError) as error:
            raise ConfigError(
                f"config key 'task.name': cannot import '{cfg.name}': {error}"
            ) from None
        problem = cls.check_name(cfg.name) if hasattr(cls, "check_name") else ""
        check(not problem, "task.name", problem)
    else:
        check(
            cfg.name in TASKS,
            "task.name",
            f"'{cfg.name}' is not one of {sorted(TASKS)} (or a module:Class path)",
        )
    cfg.check_dataset()
    if cfg.dataset:
        try:
            task_rows(cfg.dataset, cfg.prompt_field, cfg.answer_field)
        except DatasetError as error:
            raise ConfigError(f"config key 'task.dataset': {error}") from None


__all__ = [
    "ADAPTERS",
    "TASKS",
    "Env",
    "Episode",
    "Step",
    "Task",
    "ReverseDigits",
    "check_task",
    "env_class",
    "make_task",
]
