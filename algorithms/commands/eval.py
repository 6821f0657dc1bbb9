"""`meshrl eval MODEL --config FILE [key=value ...]`: the held-out evaluation of
any saved model, with no training.

MODEL is an HF directory, a run directory (its `final/`, else its newest
checkpoint) or a checkpoint (`meshrl.loop.export.model_source`). FILE is any
algorithm's config: its `task`, `generation`, `policy`, `placement` and `eval`
sections are read, the rest is left out. Every set of `eval.sets` is sampled
and scored as during training (`meshrl.loop.evaluation.Evaluator`) on a policy mesh
and an environment mesh; the figures are printed and written to
`<run.dir>/<run.name or eval-TIME>/eval.json`.

    meshrl eval runs/grpo-20261124-101500 --config algorithms/configs/grpo_default.yaml \\
        eval.sets.heldout.prompts=200 eval.sets.heldout.k=8
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any

from meshrl.config import (
    ConfigError,
    GenerationConfig,
    ModelConfig,
    PlacementConfig,
    PolicyConfig,
    RunConfig,
    TaskConfig,
    load_config,
)
from meshrl.envs import check_task, make_task
from meshrl.envs.sandbox import SandboxConfig
from meshrl.loop.checkpoint import CheckpointConfig
from meshrl.loop.evaluation import EvalConfig, Evaluator
from meshrl.loop.export import start_from
from meshrl.loop.state import LoopState
from meshrl.procs.faults import FaultsConfig
from meshrl.procs.job import JobConfig
from meshrl.procs.mesh import one_line

USAGE = "usage: meshrl eval MODEL_OR_RUN_DIR --config FILE [key=value ...]"


@dataclass
class EvaluateConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """`policy` and `environment` procs."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """The sets (`eval.sets`); `eval.every` is not used."""
    run: RunConfig = field(default_factory=RunConfig)
    job: JobConfig = field(default_factory=JobConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Not used: nothing is trained or resumed."""

    def validate(self) -> None:
        for section in (self.generation, self.policy, self.task, self.placement, self.eval):
            section.validate()
        check_task(self.task)  # (the model is checked when `start_from` resolves it)
        self.sandbox.check_task(self.task.name)
        if not self.eval.sets:
            raise ConfigError("config key 'eval.sets': no set to evaluate")


def evaluate(cfg: EvaluateConfig) -> dict[str, float]:
    """Spawn a policy and an environment mesh for `cfg.model`, evaluate every set
    once, stop the procs; the figures (also in the run directory's eval.json)."""
    from actors.environment import Environment
    from actors.policy import Policy
    from meshrl.loop.collector import Collector
    from meshrl.loop.run import Run
    from meshrl.loop.supervisor import Supervisor
    from meshrl.model.tokenizer import context_length, load_tokenizer, vision_format

    start_from(cfg.model, "model.path")
    tokenizer, context, state = load_tokenizer(cfg.model), context_length(cfg.model), LoopState()
    procs = {"policy": cfg.placement.policy, "environment": cfg.placement.environment}
    with Run(cfg, "eval", procs, cpu_only=("environment",)) as run:
        policy = run.spawn(
            "policy", Policy, cfg.model, cfg.run.seed, cfg.policy, context, run.shm_prefix
        )
        environment = run.spawn("environment", Environment, cfg.task, cfg.model, cfg.sandbox)
        sup = Supervisor(run, cfg.faults, state)
        sup.on_respawn("policy")  # its weights are the saved model's: loaded again
        sup.on_respawn("environment")
        task = make_task(cfg.task)
        collector = Collector(
            cfg,
            state,
            sup,
            None,
            tokenizer,
            task,
            context,
            policy,
            environment,
            vision=vision_format(cfg.model),
        )
        try:
            figures = Evaluator(cfg.eval, collector, cfg.run.seed).evaluate()
        finally:
            task.close()  # what it started (a server, agent threads)
        with open(f"{run.dir}/eval.json", "w") as f:
            json.dump({"model": cfg.model.path, **figures}, f, indent=1)
        print(f"{cfg.model.path}: eval.json in {run.dir}")
    return figures


def model_command(argv: list[str], usage: str, schema: type, command: Any) -> tuple[int, Any]:
    """`MODEL --config FILE [key=value ...]` -> (0, what `command(cfg)` returned), or
    (exit status, None) after one line on stderr (the usage, or the error)."""
    if len(argv) < 3 or argv[1] != "--config" or argv[0].startswith("-"):
        print(usage, file=sys.stderr)
        return 2, None
    try:
        cfg = load_config(schema, argv[2], argv[3:], known_only=True)
        cfg.model.path = argv[0]
        return 0, command(cfg)
    except Exception as error:  # noqa: BLE001 - a command's last word: one line
        print(f"error: {one_line(error)}", file=sys.stderr)
        return (2 if isinstance(error, ConfigError) else 1), None


def main(argv: list[str]) -> int:
    status, figures = model_command(argv, USAGE, EvaluateConfig, evaluate)
    for key, value in (figures or {}).items():
        print(f"{key:<32}{value:>10.4f}")
    return status
