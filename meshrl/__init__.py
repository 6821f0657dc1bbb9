"""meshrl: RL post-training of language models on Monarch process meshes.

What a controller script composes is importable from here,
`from meshrl import Run, Supervisor, WeightSync, ...`; each name is imported on
first use, so `import meshrl` (and every proc that imports one of its modules)
loads none of them. The modules, by concern:

- `meshrl.loop`: the pieces a loop composes (run, supervisor, checkpoints, loop
  state and ledger, weight sync, collector, dispatch, evaluation, step log);
- `meshrl.procs`: meshes, proc pools, jobs, faults;
- `meshrl.weights`: publishing and receiving weight versions, checksums;
- `meshrl.model`: models, generation, packing, LoRA, vision, routing, losses;
- `meshrl.observe`: metrics, telemetry, status, report, profiler, dashboard;
- `meshrl.config`: the config sections, YAML + `key=value` loading, generated files;
- `meshrl.envs`: tasks and their data, episodes, tools, the sandbox, the policy's
  endpoint;
- `meshrl.types`: what travels between the controller and the actors;
- `meshrl.commands`: the `meshrl` command.

Imports run one way, `loop` on top of the rest (docs/architecture.md, "Layers"),
and nothing in `meshrl/` imports `actors/` or `algorithms/`.
"""

from __future__ import annotations

import importlib
import sys

_EXPORTS = {
    # the loop's pieces
    "Run": "meshrl.loop.run",
    "Role": "meshrl.loop.run",
    "StopRequest": "meshrl.loop.run",
    "Supervisor": "meshrl.loop.supervisor",
    "RoleLost": "meshrl.loop.supervisor",
    "Checkpointer": "meshrl.loop.checkpoint",
    "LoopState": "meshrl.loop.state",
    "Ledger": "meshrl.loop.state",
    "WeightSync": "meshrl.loop.weight_sync",
    "Collector": "meshrl.loop.collector",
    "decode": "meshrl.loop.collector",
    "Dispatcher": "meshrl.loop.dispatch",
    "Evaluator": "meshrl.loop.evaluation",
    "StepLog": "meshrl.loop.steplog",
    "Steps": "meshrl.loop.steps",
    "rollout_metrics": "meshrl.loop.steplog",
    "supervised_steps": "meshrl.loop.supervised",
    "demonstrations": "meshrl.loop.supervised",
    # meshes
    "RoleMeshes": "meshrl.procs.mesh",
    # config, task, model, messages
    "load_config": "meshrl.config",
    "parse_cli": "meshrl.config",
    "ConfigError": "meshrl.config",
    "make_task": "meshrl.envs",
    "load_tokenizer": "meshrl.model.tokenizer",
    "context_length": "meshrl.model.tokenizer",
    "scale_of": "meshrl.model.losses",
    "TrainBatch": "meshrl.types",
    "Completions": "meshrl.types",
    "Prompt": "meshrl.types",
}
"""Exported name -> the module it is defined in."""

__all__ = sorted(_EXPORTS)


def lazy_exports(package: str, exports: dict[str, str]) -> tuple:
    """`__getattr__` and `__dir__` for `package` (PEP 562): each name of `exports`
    (name -> the module that defines it) is imported on first use, then kept."""
    namespace = vars(sys.modules[package])

    def __getattr__(name: str) -> object:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value = getattr(importlib.import_module(module), name)
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
