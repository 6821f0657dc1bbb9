"""GRPO: group-relative policy optimization on Monarch meshes.

Each step samples `prompts_per_step` prompts, generates `group_size`
completions per prompt on the policy replicas, scores them on the environment
mesh, normalizes rewards within each group into advantages, takes one clipped
policy-gradient step on the trainer mesh (plus a k3 KL penalty to a frozen
reference when `kl_coef > 0`), and pushes the new weights to every policy
replica over RDMA buffers.

Departures from the paper (Shao et al. 2024, DeepSeekMath):
- one optimizer step per batch of rollouts (so the ratio is 1 at the step and
  the clipping guards only the sampling/training numerics), as in most
  open-source GRPO runs;
- the default aggregation is the paper's per-sequence mean of token means;
  `loss_aggregation=token-mean` gives DAPO's token-level mean;
- `kl_coef` defaults to 0 (no reference mesh is spawned), following DAPO and
  Dr. GRPO, which found the KL term unnecessary for verifiable rewards.

Run it:
    make run                                   # embedded default task and model
    python -m algorithms.grpo --config algorithms/configs/grpo_default.yaml steps=50
    python -m algorithms.grpo --config algorithms/configs/grpo_default.yaml \
        model.path=/path/to/hf_model placement.policy=2 kl_coef=0.01

In a notebook: `GRPO(load_config(GRPOConfig, "algorithms/configs/grpo_default.yaml")).run()`.
Subclass and override one hook (`rollout`, `compute_advantages`, `loss`,
`after_step`) for a variant.
"""

from __future__ import annotations

import json
import random
import socket
import sys
import time
from dataclasses import dataclass, field

import torch

from meshrl.config import (
    ConfigError,
    GenerationConfig,
    ModelConfig,
    OptimConfig,
    PlacementConfig,
    RunConfig,
    TaskConfig,
    WarmStartConfig,
    parse_cli,
    save_config,
)
from meshrl.envs import make_task
from meshrl.losses import AGGREGATIONS, group_advantages, kl_estimate, masked_mean, policy_loss
from meshrl.mesh import RemoteCallError, RoleMeshes, call_all, call_each, split, wait
from meshrl.metrics import RunLogger, make_run_dir
from meshrl.models import load_tokenizer
from meshrl.types import Completions, Prompt, TrainBatch
from meshrl.weights import rdma_backend


@dataclass
class GRPOConfig:
    steps: int = 200
    """RL steps (one optimizer step each)."""
    prompts_per_step: int = 16
    """Distinct prompts per step."""
    group_size: int = 8
    """Completions per prompt; advantages are normalized within each group."""
    clip_low: float = 0.2
    """PPO clip range below 1."""
    clip_high: float | None = None
    """PPO clip range above 1 (DAPO's clip-higher); None uses clip_low."""
    loss_aggregation: str = "seq-mean-token-mean"
    """How per-token losses become a scalar; see meshrl.losses.aggregate."""
    advantage_scale: str = "group"
    """group (GRPO), batch, or none (Dr. GRPO): the std that divides advantages."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference model; 0 spawns no reference."""
    kl_kind: str = "k3"
    """KL estimator: k1, k2 or k3."""
    model: ModelConfig = field(default_factory=ModelConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def validate(self) -> None:
        for section in (
            self.model,
            self.generation,
            self.optim,
            self.placement,
            self.task,
            self.warm_start,
            self.run,
        ):
            section.validate()
        if self.steps < 1:
            raise ConfigError("config key 'steps': must be >= 1")
        if self.group_size < 2:
            raise ConfigError("config key 'group_size': must be >= 2 (advantages compare a group)")
        if self.loss_aggregation not in AGGREGATIONS:
            raise ConfigError(
                f"config key 'loss_aggregation': '{self.loss_aggregation}' is not "
                f"one of {', '.join(AGGREGATIONS)}"
            )
        if self.advantage_scale not in ("group", "batch", "none"):
            raise ConfigError(
                f"config key 'advantage_scale': '{self.advantage_scale}' is not "
                "one of group, batch, none"
            )
        if self.kl_kind not in ("k1", "k2", "k3"):
            raise ConfigError(f"config key 'kl_kind': '{self.kl_kind}' is not one of k1, k2, k3")
        batch = self.prompts_per_step * self.group_size
        for role in ("policy", "trainer") + (("reference",) if self.kl_coef > 0 else ()):
            if batch % getattr(self.placement, role):
                raise ConfigError(
                    f"config key 'placement.{role}': {batch} completions per step "
                    f"do not split evenly over {getattr(self.placement, role)} procs"
                )


class GRPO:
    name = "grpo"

    def __init__(self, cfg: GRPOConfig):
        self.cfg = cfg
        self.meshes: RoleMeshes | None = None
        self.logger: RunLogger | None = None

    def __getstate__(self) -> dict:
        # The algorithm travels to the trainer procs so that its `loss` hook runs
        # there; only the config goes with it, never the mesh handles.
        return {"cfg": self.cfg, "meshes": None, "logger": None}

    # --- the loop ---------------------------------------------------------------------

    def run(self) -> list[dict]:
        """Spawn the meshes, train for `cfg.steps` steps, save, and stop every proc."""
        cfg = self.cfg
        self.setup()
        try:
            self.sync_weights()  # version 0: every replica starts from the trainer's weights
            if cfg.warm_start.steps:
                self.warm_start()
            if "reference" in self.meshes:
                self.load_reference()
            self.logger = RunLogger(self.run_dir, cfg.steps, progress=cfg.run.progress)
            for step in range(cfg.steps):
                started = time.perf_counter()
                prompts = self.task.sample(cfg.prompts_per_step, self.rng)
                completions, rewards, rollout_times = self.rollout(prompts)
                advantages = self.compute_advantages(rewards)
                batch = TrainBatch.from_completions(completions, advantages)
                if "reference" in self.meshes:
                    batch.ref_logprobs = self.reference_logprobs(batch)

                train_started = time.perf_counter()
                train_metrics = self.train(batch)
                sync_started = time.perf_counter()
                self.sync_weights()
                finished = time.perf_counter()

                self.after_step(
                    step,
                    {
                        "step": step,
                        "reward/mean": rewards.mean().item(),
                        "reward/std": rewards.std().item(),
                        "reward/max": rewards.max().item(),
                        "tokens/generated": int(completions.completion_mask.sum().item()),
                        "completion/mean_length": completions.completion_mask.sum(1).mean().item(),
                        "weights/version": self.handle.version,
                        "weights/generated_with": completions.weight_version,
                        **train_metrics,
                        **rollout_times,
                        "time/train_s": sync_started - train_started,
                        "time/weight_sync_s": finished - sync_started,
                        "time/step_s": finished - started,
                    },
                )
            self.finish()
        finally:
            self.shutdown()
        return self.logger.history

    # --- hooks: override one of these for a variant ---------------------------------

    def rollout(self, prompts: list[Prompt]) -> tuple[Completions, torch.Tensor, dict]:
        """Generate `group_size` completions per prompt and score them.

        Returns completions [B = prompts x group], rewards [B] and timings.
        """
        group = [p for p in prompts for _ in range(self.cfg.group_size)]
        prompt_ids = [self.tokenizer(p.text).input_ids for p in group]
        started = time.perf_counter()
        shards = split(prompt_ids, self.cfg.placement.policy)
        parts = call_each(
            self.policy,
            "generate",
            [(s, self.cfg.generation) for s in shards],
            "policy.generate",
            self.timeout_s,
        )
        completions = Completions.concat(parts, self.tokenizer.pad_token_id)
        scored = time.perf_counter()
        env_shards = zip(
            split(group, self.cfg.placement.environment),
            split(completions.completion_lists(), self.cfg.placement.environment),
            strict=True,
        )
        scores = call_each(
            self.environment, "score", list(env_shards), "environment.score", self.timeout_s
        )
        rewards = torch.tensor([r for part in scores for r in part])
        times = {"time/generate_s": scored - started, "time/score_s": time.perf_counter() - scored}
        return completions, rewards, times

    def compute_advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """[B] rewards -> [B] group-normalized advantages."""
        return group_advantages(rewards, self.cfg.group_size, scale=self.cfg.advantage_scale)

    def loss(self, logprobs: torch.Tensor, batch: TrainBatch) -> tuple[torch.Tensor, dict]:
        """Runs on every trainer proc: clipped surrogate (+ KL to the reference)."""
        cfg = self.cfg
        loss, metrics = policy_loss(
            logprobs,
            batch.old_logprobs,
            batch.advantages,
            batch.completion_mask,
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            aggregation=cfg.loss_aggregation,
            max_tokens=cfg.generation.max_new_tokens,
        )
        if batch.ref_logprobs is not None and cfg.kl_coef > 0:
            kl = kl_estimate(logprobs, batch.ref_logprobs, cfg.kl_kind)
            kl_mean = masked_mean(kl, batch.completion_mask)
            loss = loss + cfg.kl_coef * kl_mean
            metrics["policy/kl_ref"] = kl_mean.item()
        return loss, metrics

    def after_step(self, step: int, metrics: dict) -> None:
        """Record the step (metrics.jsonl, progress bar)."""
        self.logger.log(metrics)

    # --- the machinery the loop calls ------------------------------------------------

    def setup(self) -> None:
        """Run directory, meshes and actors."""
        from actors.environment import Environment
        from actors.policy import Policy
        from actors.reference import Reference
        from actors.trainer import Trainer

        cfg = self.cfg
        self.run_dir = make_run_dir(cfg.run.dir, cfg.run.name, self.name)
        save_config(cfg, f"{self.run_dir}/config.yaml")
        self.timeout_s = cfg.run.call_timeout_s
        self.rng = random.Random(cfg.run.seed)
        self.task = make_task(cfg.task)
        self.tokenizer = load_tokenizer(cfg.model)
        counts = {
            "policy": cfg.placement.policy,
            "trainer": cfg.placement.trainer,
            "environment": cfg.placement.environment,
        }
        if cfg.kl_coef > 0:
            counts["reference"] = cfg.placement.reference
        self.meshes = RoleMeshes(counts)
        try:
            seed = cfg.run.seed
            self.trainer = self.meshes["trainer"].spawn(
                "trainer",
                Trainer,
                cfg.model,
                cfg.optim,
                loss_fn=self.loss,  # this object's `loss` hook, run on the trainer procs
                total_steps=cfg.steps,
                temperature=cfg.generation.temperature,
                seed=seed,
                master_port=_free_port(),
            )
            self.policy = self.meshes["policy"].spawn("policy", Policy, cfg.model, seed)
            self.environment = self.meshes["environment"].spawn(
                "environment", Environment, cfg.task, cfg.model
            )
            if "reference" in self.meshes:
                self.reference = self.meshes["reference"].spawn(
                    "reference", Reference, cfg.model, seed
                )
        except BaseException:
            self.shutdown()
            raise

    def train(self, batch: TrainBatch, endpoint: str = "train_step", *args) -> dict[str, float]:
        """One data-parallel optimizer step (each trainer rank gets its shard of
        the batch); metrics averaged over ranks."""
        n = self.cfg.placement.trainer
        per_rank = call_each(
            self.trainer,
            endpoint,
            [(batch.shard(i, n), *args) for i in range(n)],
            f"trainer.{endpoint}",
            self.timeout_s,
        )
        return {key: sum(m[key] for m in per_rank) / n for key in per_rank[0]}

    def sync_weights(self) -> None:
        """Trainer rank 0 publishes its weights; every policy replica pulls them."""
        self.handle = wait(
            self.trainer.slice(procs=0).publish.call_one(), "trainer.publish", self.timeout_s
        )
        versions = call_all(
            self.policy,
            "load_weights",
            self.handle,
            what="policy.load_weights",
            timeout_s=self.timeout_s,
        )
        assert set(versions) == {self.handle.version}, f"replicas at {versions}"

    def load_reference(self) -> None:
        """The reference takes the weights RL starts from and keeps them."""
        call_all(
            self.reference,
            "load_weights",
            self.handle,
            what="reference.load_weights",
            timeout_s=self.timeout_s,
        )

    def reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        n = self.cfg.placement.reference
        parts = call_each(
            self.reference,
            "logprobs",
            [(_rows(batch, i, n), self.cfg.generation.temperature) for i in range(n)],
            "reference.logprobs",
            self.timeout_s,
        )
        return torch.cat(parts)

    def warm_start(self) -> None:
        """Supervised steps on task demonstrations (logged to warm_start.jsonl),
        then a weight sync."""
        cfg, eos = self.cfg.warm_start, self.tokenizer.eos_token_id
        losses = []
        with open(f"{self.run_dir}/warm_start.jsonl", "w") as log:
            for step in range(cfg.steps):
                prompts = self.task.sample(cfg.batch_size, self.rng)
                prompt_ids = [self.tokenizer(p.text).input_ids for p in prompts]
                targets = [
                    self.tokenizer(self.task.demonstration(p), add_special_tokens=False).input_ids
                    + [eos]
                    for p in prompts
                ]
                batch = supervised_batch(prompt_ids, targets, self.tokenizer.pad_token_id)
                metrics = self.train(batch, "warm_start_step", cfg.lr)
                log.write(json.dumps({"step": step, **metrics}) + "\n")
                losses.append(metrics["loss/nll"])
        self.sync_weights()
        print(
            f"warm-start: {cfg.steps} supervised steps, nll {losses[0]:.3f} -> {losses[-1]:.3f}",
            flush=True,
        )

    def finish(self) -> None:
        """Save the model, draw the reward curve, print the summary."""
        self.logger.close()
        if self.cfg.run.save_final:
            wait(self.trainer.save.call(f"{self.run_dir}/final"), "trainer.save", self.timeout_s)
        self.logger.plot_reward()
        print(
            f"{self.name}: {self.logger.summary()} | weights over RDMA ({rdma_backend()})",
            flush=True,
        )

    def shutdown(self) -> None:
        """Stop every proc this run spawned (safe to call twice)."""
        if self.logger is not None:
            self.logger.close()
        if self.meshes is not None:
            self.meshes.stop()


def supervised_batch(
    prompt_ids: list[list[int]], targets: list[list[int]], pad_id: int
) -> TrainBatch:
    """Prompt + target token ids -> a TrainBatch whose completion is the target."""
    P, T = max(map(len, prompt_ids)), max(map(len, targets))
    ids = torch.full((len(prompt_ids), P + T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompt_ids), P + T)
    for row, (prompt, target) in enumerate(zip(prompt_ids, targets, strict=True)):
        ids[row, P - len(prompt) : P + len(target)] = torch.tensor(prompt + target)
        mask[row, P - len(prompt) : P + len(target)] = 1
    completion_mask = mask[:, P:]
    return TrainBatch(
        ids, mask, completion_mask, torch.zeros_like(completion_mask), torch.zeros(len(prompt_ids))
    )


def _rows(batch: TrainBatch, index: int, count: int) -> TrainBatch:
    """Contiguous rows for reference proc `index` of `count` (results are concatenated)."""
    size = len(batch) // count
    return batch.apply(lambda t: t[index * size : (index + 1) * size])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    cfg = parse_cli(GRPOConfig, argv)
    try:
        GRPO(cfg).run()
    except KeyboardInterrupt:
        print("interrupted: every proc stopped", file=sys.stderr)
        return 130
    except (RemoteCallError, FileExistsError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
