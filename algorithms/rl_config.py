"""The algorithms' shared configs: `RLConfig` for the on-policy ones (GRPO and
its variants, PPO), `OfflineConfig` for those that train on a fixed dataset (DPO,
SFT). Each algorithm's config adds its own keys to one (`GRPOConfig`, ...)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from meshrl.config import (
    ConfigError,
    GenerationConfig,
    HealthConfig,
    ModelConfig,
    OptimConfig,
    PlacementConfig,
    PolicyConfig,
    RewardModelConfig,
    RunConfig,
    TaskConfig,
    TrainerConfig,
    WarmStartConfig,
    check_placement,
    validate_sections,
)
from meshrl.envs import check_task, make_task
from meshrl.envs.sandbox import SandboxConfig
from meshrl.loop import elastic
from meshrl.loop.checkpoint import CheckpointConfig
from meshrl.loop.dispatch import RolloutConfig
from meshrl.loop.elastic import PoolConfig
from meshrl.loop.evaluation import EvalConfig
from meshrl.loop.weight_sync import WeightsConfig
from meshrl.model.engines import vllm_missing
from meshrl.model.models import check_layout
from meshrl.model.routing import check_routing
from meshrl.model.tokenizer import check_tokenizer_fits
from meshrl.procs.faults import FaultsConfig
from meshrl.procs.job import JobConfig


def check_inputs(
    model: ModelConfig, placement: PlacementConfig, task: TaskConfig | None, trainer: Any = None
) -> None:
    """What a run's config names, checked by the layers that know it, when the
    config loads (an algorithm config's `validate`, so the CLI and `load_config`
    in Python both refuse it before any proc is spawned): a saved model's
    tokenizer against its vocabulary (`meshrl.model`), the tensor parallelism
    of `placement` against the model's layers (`meshrl.model`, `meshrl.procs`),
    the environment `task.name` resolves to and the rows of `task.dataset`
    (`meshrl.envs`). The sections' own `validate` checks their keys' values."""
    check_tokenizer_fits(model)
    check_layout(model, placement, trainer)
    if task is not None:
        check_task(task)


def check_sections(cfg: Any, task: Any = None) -> None:
    """What every algorithm's `validate` checks first: each section its own keys,
    the placement against the model, and the model's inputs (and the task's)."""
    validate_sections(cfg)
    check_placement(cfg.model, cfg.placement)
    check_inputs(cfg.model, cfg.placement, task, cfg.trainer)
    cfg.trainer.check_precision(cfg.model)


POOLS = ("policy", "environment")
"""The roles whose pools an on-policy run grows and shrinks (`GRPO.elastic`): their
procs hold no state of their own that the run needs (a replica's weights are the
trainer's)."""
FIXED_ROLES = {
    "trainer": "its state lives in its procs",
    "critic": "its state lives in its procs",
    "reference": "it is not pooled",
    "reward_model": "it is not pooled",
    "eval": "it is not pooled",
}
"""The on-policy roles that cannot scale, and why (the run says the same of its own:
`Run.fixed_roles`)."""


@dataclass
class RLConfig:
    """Keys shared by the on-policy algorithms (GRPO and its variants, PPO)."""

    steps: int = 200
    """RL steps: one batch of rollouts each."""
    prompts_per_step: int = 16
    """Distinct prompts per step."""
    group_size: int = 8
    """Completions sampled per prompt."""
    epochs: int = 1
    """Passes over each batch of rollouts."""
    minibatches: int = 1
    """Optimizer steps per pass: the batch is cut into this many shuffled parts."""
    kl_coef: float = 0.0
    """Weight of the KL to the reference model; 0 spawns no reference."""
    kl_kind: str = "k3"
    """KL estimator: k1, k2 or k3 (meshrl.model.losses.kl_estimate)."""
    max_staleness: int = 0
    """Weight versions generation may run ahead of training: the batches of steps
    s+1..s+k are generated while step s trains. 0 is the synchronous on-policy loop."""
    model: ModelConfig = field(default_factory=ModelConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    run: RunConfig = field(default_factory=RunConfig)
    job: JobConfig = field(default_factory=JobConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    pool: PoolConfig = field(default_factory=PoolConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)

    min_group_size = 1

    def validate(self) -> None:
        check_sections(self, self.task)
        for role, size, _ in self.pool.entries():  # before any proc, with the roles' reasons
            problem = elastic.check(role, size, {r: (None, "") for r in POOLS}, FIXED_ROLES)
            if problem:
                raise ConfigError(f"config key 'pool.schedule': {problem}")
        if self.rollout.dispatch == "pull" and (
            make_task(self.task).multi_turn or self.reward_model.path
        ):
            raise ConfigError(
                "config key 'rollout.dispatch': pull is for single-turn tasks scored by "
                "the environment (not yet multi-turn episodes or a reward model)"
            )
        if self.policy.continuous and self.rollout.dispatch != "pull":
            raise ConfigError(
                "config key 'policy.continuous': continuous batching takes the pull queue's "
                "calls (set rollout.dispatch=pull)"
            )
        if self.rollout.partial and not (self.policy.continuous and self.max_staleness):
            raise ConfigError(
                "config key 'rollout.partial': rows that go on under new weights need "
                "policy.continuous=true and max_staleness >= 1"
            )
        self.sandbox.check_task(self.task.name)
        check_routing(self.model, self.policy, self.trainer, make_task(self.task).multi_turn)
        recompute = self.recompute_old_logprobs
        if not recompute and self.trainer.correction != "none":
            raise ConfigError(
                "config key 'trainer.recompute_old_logprobs': false, but trainer.correction "
                f"'{self.trainer.correction}' needs the trainer's old log-probs"
            )
        if not recompute and self.generation.top_p < 1:
            # Either engine's behaviour log-probs are those of the distribution sampled
            # from (the nucleus, renormalized); the trainer scores the whole one. (The
            # `min_new_tokens` ban is allowed: it moves only the first tokens' log-probs,
            # by their stop ids' mass, and benchmarks use it for equal work.)
            raise ConfigError(
                "config key 'trainer.recompute_old_logprobs': false with generation.top_p < 1: "
                "the sampler's log-probs are those of the truncated distribution it drew from, "
                "so every ratio would be biased (set it to auto or true)"
            )
        for key in ("steps", "prompts_per_step", "epochs", "minibatches"):
            if getattr(self, key) < 1:
                raise ConfigError(f"config key '{key}': must be >= 1")
        if self.group_size < self.min_group_size:
            raise ConfigError(
                f"config key 'group_size': must be >= {self.min_group_size} "
                "(advantages compare completions of one prompt)"
            )
        if self.kl_kind not in ("k1", "k2", "k3"):
            raise ConfigError(f"config key 'kl_kind': '{self.kl_kind}' is not one of k1, k2, k3")
        if self.kl_coef < 0:
            raise ConfigError("config key 'kl_coef': must be >= 0")
        if self.max_staleness < 0:
            raise ConfigError("config key 'max_staleness': must be >= 0")
        if self.placement.policy_tp > 1:
            refused = {
                "policy.continuous": self.policy.continuous,
                "policy.engine": self.policy.engine != "hf",
                "pool.schedule": any(str(e).startswith("policy=") for e in self.pool.schedule),
            }
            for key, bad in refused.items():
                if bad:
                    raise ConfigError(
                        f"config key '{key}': tensor-parallel replicas (placement.policy_tp > 1) "
                        "sample with the hf engine's batch path and keep their number "
                        "(no policy pool schedule)"
                    )
        if self.max_staleness and make_task(self.task).multi_turn:
            raise ConfigError(
                f"config key 'max_staleness': multi-turn episodes ({self.task.name}) "
                "run with max_staleness=0"
            )
        if self.policy.engine == "vllm" and self.job.kind in ("local", "process"):
            missing = vllm_missing()  # the replicas run on this machine: say so now
            if missing:
                raise ConfigError(f"config key 'policy.engine': {missing}")
        batch = self.prompts_per_step * self.group_size
        for role in ("reference", "trainer"):  # (policy replicas take nearly equal parts)
            if batch % self.ranks(role):
                raise ConfigError(
                    f"config key 'placement.{role}': {batch} completions per step "
                    f"do not split evenly over {self.ranks(role)} procs"
                )
        if batch % (self.minibatches * self.ranks("trainer")):
            raise ConfigError(
                f"config key 'minibatches': {batch} completions per step do not split into "
                f"{self.minibatches} minibatches x {self.ranks('trainer')} trainer procs"
            )
        per_rank = batch // (self.minibatches * self.ranks("trainer"))
        if self.trainer.micro_batches > per_rank:
            raise ConfigError(
                f"config key 'trainer.micro_batches': {self.trainer.micro_batches} is more "
                f"than the {per_rank} rows each trainer proc gets per optimizer step"
            )

    @property
    def env_args(self) -> tuple:
        """The environment actor's arguments: the task, the tokenizer's model, the sandbox."""
        return self.task, self.model, self.sandbox

    @property
    def recompute_old_logprobs(self) -> bool:
        """Whether the trainer recomputes the old log-probs (`trainer.recompute_old_logprobs`)."""
        return self.trainer.recompute(self.model, self.generation, self.policy)

    def ranks(self, role: str) -> int:
        """Procs of a role over all its hosts."""
        if role == "policy" and self.placement.colocate:
            return self.ranks("trainer")
        return getattr(self.placement, role) * self.job.hosts_for(role)

    @property
    def total_updates(self) -> int:
        """Optimizer steps over the whole run (for the learning-rate schedule)."""
        return self.steps * self.epochs * self.minibatches


@dataclass
class HeldOutConfig:
    """The `eval:` section of the algorithms that evaluate on held-out data of their
    own (DPO's and SFT's held-out split, co-evolution's games): when. (The on-policy
    algorithms' `eval:` also says on what: `meshrl.loop.evaluation.EvalConfig`.)"""

    every: int = 25
    """Steps between held-out evaluations (and after the last step)."""

    def validate(self) -> None:
        if self.every < 1:
            raise ConfigError("config key 'eval.every': must be >= 1")


@dataclass
class OfflineConfig:
    """Keys shared by the algorithms that train on a fixed dataset (DPO, SFT)."""

    steps: int = 200
    """Optimizer steps."""
    batch_size: int = 32
    """Rows per step."""
    eval: HeldOutConfig = field(default_factory=HeldOutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    run: RunConfig = field(default_factory=RunConfig)
    job: JobConfig = field(default_factory=JobConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    health: HealthConfig = field(default_factory=HealthConfig)

    ALGORITHM: ClassVar[str] = ""
    """The algorithm's name in its errors."""
    MOVED: ClassVar[dict[str, str]] = {"layout": "trainer.layout", "eval_every": "eval.every"}

    @property
    def total_updates(self) -> int:
        """Optimizer steps over the run (the LR schedule's length)."""
        return self.steps

    def validate(self) -> None:
        check_sections(self)
        for key in ("steps", "batch_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"config key '{key}': must be >= 1")
        self.trainer.check_offline(self.ALGORITHM)
