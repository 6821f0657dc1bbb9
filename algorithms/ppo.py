"""PPO with a learned critic on its own mesh (Schulman et al. 2017; the RLHF
recipe of Ziegler et al. 2019 and Ouyang et al. 2022).

Each step samples completions on the policy replicas and scores them on the
environment mesh. The critic mesh estimates the value of every prefix; the
reward of a sequence is placed on its last token and every token pays
`kl_coef` times its KL to the frozen reference (the KL-shaped reward); GAE
turns rewards and values into per-token advantages and value targets. Then
`epochs` passes over the batch, cut into `minibatches`, each take one clipped
policy step on the trainer mesh and one clipped value step on the critic mesh
at the same time. New weights go to the policy replicas over RDMA.

Run it:
    python -m algorithms.ppo --config algorithms/configs/ppo.yaml
    python -m algorithms.ppo --config algorithms/configs/ppo.yaml kl_coef=0.1 placement.critic=2

In Python: `PPO(load_config(PPOConfig, "algorithms/configs/ppo.yaml")).run()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from algorithms.base import Algorithm, RLConfig, run_main
from meshrl.config import ConfigError, OptimConfig
from meshrl.loop.run import Run
from meshrl.loop.steplog import rollout_metrics
from meshrl.loop.supervisor import RoleLost, step_metrics
from meshrl.model.losses import (
    AGGREGATIONS,
    explained_variance,
    gae,
    kl_estimate,
    masked_mean,
    policy_loss,
    token_rewards,
    whiten,
)
from meshrl.types import TrainBatch


@dataclass
class PPOConfig(RLConfig):
    CHECKED_APART: ClassVar[tuple[str, ...]] = ("critic_optim",)  # by `validate`, by its name
    group_size: int = 1
    """Completions per prompt (PPO needs no group: the critic is the baseline)."""
    epochs: int = 2
    minibatches: int = 4
    kl_coef: float = 0.05
    """Per-token KL penalty in the reward (spawns the reference mesh when > 0)."""
    kl_kind: str = "k1"
    clip_low: float = 0.2
    """Policy ratio clip range below 1."""
    clip_high: float | None = None
    """Policy ratio clip range above 1; None uses clip_low."""
    loss_aggregation: str = "token-mean"
    """How per-token policy losses become a scalar; see meshrl.model.losses.aggregate."""
    value_clip: float = 0.2
    """How far a value may move from its rollout-time estimate before clipping."""
    gamma: float = 1.0
    """Discount per token."""
    lam: float = 0.95
    """GAE lambda: 0 is one-step TD, 1 is Monte Carlo returns."""
    whiten_advantages: bool = True
    """Normalize advantages over the batch's tokens (mean 0, std 1)."""
    critic_optim: OptimConfig = field(default_factory=OptimConfig)
    """The critic's own optimizer and schedule."""

    def validate(self) -> None:
        super().validate()
        self.critic_optim.validate("critic_optim")
        if self.loss_aggregation not in AGGREGATIONS:
            raise ConfigError(
                f"config key 'loss_aggregation': '{self.loss_aggregation}' is not "
                f"one of {', '.join(AGGREGATIONS)}"
            )
        if not 0 <= self.gamma <= 1:
            raise ConfigError("config key 'gamma': must be in [0, 1]")
        if not 0 <= self.lam <= 1:
            raise ConfigError("config key 'lam': must be in [0, 1]")
        batch = self.prompts_per_step * self.group_size
        if batch % (self.minibatches * self.ranks("critic")):
            raise ConfigError(
                f"config key 'placement.critic': {batch} completions per step do not split "
                f"into {self.minibatches} minibatches x {self.ranks('critic')} critic procs"
            )


class PPO(Algorithm):
    name = "ppo"

    def placement(self) -> tuple[dict[str, int], dict[str, str], list[tuple[str, ...]]]:
        procs, share, busy = super().placement()
        # The policy and value steps run at the same time (`Supervisor.call_sharded` of both).
        ahead = ("policy",) if self.cfg.max_staleness else ()
        return (
            {**procs, "critic": self.cfg.placement.critic},
            share,
            [*busy, ("trainer", "critic", *ahead)],
        )

    def run(self, num_steps: int | None = None) -> list[dict]:
        """As `GRPO.run`, with a critic mesh and GAE advantages."""
        from actors.critic import Critic
        from actors.environment import Environment
        from actors.reference import Reference
        from actors.reward_model import RewardModel

        cfg, state = self.cfg, self.state
        with self.running(num_steps):  # an error: `failed`; a whole run: `stop()` at its end
            if self.meshes is None:  # --- the meshes: one per role, one actor per proc ---
                run = self.meshes = Run(
                    cfg,
                    self.name,
                    *self.placement(),
                    elastic=self.elastic,
                    beside=self.beside(),
                    trains=("trainer", "critic"),
                    cpu_only=("environment",),
                )
                self.trainer = self.spawn_trainer(run)
                self.critic = run.spawn(
                    "critic",
                    Critic,
                    cfg.model,
                    cfg.critic_optim,
                    total_steps=cfg.total_updates,
                    value_clip=cfg.value_clip,
                    seed=cfg.run.seed,
                    layout=cfg.trainer.layout,
                    micro_batches=cfg.trainer.micro_batches,
                    rendezvous=True,
                )
                self.policy = self.spawn_policy(run)
                self.environment = run.spawn("environment", Environment, *cfg.env_args)
                self.reference = self.reward_model = None
                if cfg.kl_coef > 0:  # a frozen copy of the starting weights
                    self.reference = run.spawn(
                        "reference",
                        Reference,
                        cfg.model,
                        cfg.run.seed,
                        cfg.trainer.layout,
                        frozen_copy=True,
                    )
                if cfg.reward_model.path:
                    self.reward_model = run.spawn(
                        "reward_model", RewardModel, cfg.reward_model.path
                    )
                self.compose(run, [self.trainer, self.critic, self.reference, self.policy])
                self.sup.heal_from_peers("critic", ("train_step",))  # DDP: ranks are replicas
                if run.resume_from is None:  # the critic's backbone starts as the policy
                    self.sup.call_all(self.critic, "load_backbone", self.sync.handle)
            run, sup, sync, log, critic = self.meshes, self.sup, self.sync, self.log, self.critic
            policy, trainer, reference = self.policy, self.trainer, self.reference
            # Ctrl-C or SIGTERM: stop after the step under way; the drills and pool sizes
            # due before each step; its count and the checkpoints due after it (`Steps`).
            with self.steps(num_steps) as steps:
                for step in steps:
                    with log.timer("step"):
                        # Generate this step's batch (and `max_staleness` batches ahead), split
                        # over the policy replicas (or by pull: `rollout.dispatch`); score it.
                        while self.dispatcher is None and len(state.ahead) <= cfg.max_staleness:
                            batch = self.collector.layout(
                                self.collector.sample_prompts(cfg.prompts_per_step)
                            )
                            if not self.task.multi_turn:  # (episodes are played in `rollout`)
                                batch.calls = [
                                    policy.slice(procs=i).generate.call_one(
                                        ids, cfg.generation, seeds, images
                                    )
                                    for i, (ids, seeds, images) in enumerate(batch.shards)
                                ]
                            state.ahead.append(batch)
                        completions, scores, rollout_info = self.next_rollout()
                        batch = TrainBatch.from_completions(completions)
                        with log.timer("reference"):  # rows split over the reference procs
                            if reference is not None:
                                batch.ref_logprobs = sup.call_rows(
                                    reference, "logprobs", batch, cfg.generation.temperature
                                )
                        try:
                            rollout_info.update(self.old_logprobs(batch))  # trainer's, if on
                            batch.old_values = sup.call_rows(critic, "values", batch)  # prefixes
                            batch.advantages = self.compute_advantages(scores, batch)
                            advantage_info = self.advantage_metrics(scores, batch)
                            # Each minibatch: a policy step on the trainer mesh and a value
                            # step on the critic mesh at the same time, each rank its shard.
                            with log.timer("train"):
                                train_metrics = step_metrics(
                                    [
                                        sup.call_sharded(
                                            (trainer, critic), "train_step", batch.rows(rows)
                                        )
                                        for rows in self.minibatches(len(batch))
                                    ]
                                )
                            with log.timer("weight_sync"):  # shm on this host, RDMA across
                                handle = sync.publish(trainer)  # trainer.publish
                                sync.pull(policy, handle)  # policy.load_weights
                        except RoleLost as lost:  # trainer or critic lost: back to a checkpoint
                            self.ckpt.rewind(lost, sup, log, len(batch))
                            continue
                    sup.guard_finite(step, train_metrics, self.newest_checkpoint())
                    self.record_samples(step, completions, scores, batch.advantages)
                    self.after_step(
                        step,
                        {
                            "step": step,
                            **rollout_metrics(scores, completions, sync),
                            **advantage_info,
                            **rollout_info,
                            **train_metrics,
                            **self.accounting(trained=len(batch)),
                        },
                    )
        return self.log.history

    # --- hooks ------------------------------------------------------------------------

    def compute_advantages(self, scores: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
        """[B] scores -> [B, T] advantages, as every on-policy algorithm's hook: GAE
        over KL-shaped token rewards. Also sets the critic's targets, `batch.returns`.
        Needs `batch.old_values` (and `ref_logprobs` when kl_coef > 0)."""
        cfg, mask = self.cfg, batch.completion_mask
        advantages, batch.returns = gae(
            self.shaped_rewards(scores, batch), batch.old_values, mask, cfg.gamma, cfg.lam
        )
        return whiten(advantages, mask) if cfg.whiten_advantages else advantages

    def shaped_rewards(self, scores: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
        """[B, T]: each sequence's score on its last token, minus `kl_coef` times each
        token's KL to the reference."""
        cfg = self.cfg
        return token_rewards(
            scores, batch.completion_mask, self.kl_to_reference(batch), cfg.kl_coef
        )

    def kl_to_reference(self, batch: TrainBatch) -> torch.Tensor | None:
        if batch.ref_logprobs is None:
            return None
        return kl_estimate(batch.old_logprobs, batch.ref_logprobs, self.cfg.kl_kind)

    def advantage_metrics(self, scores: torch.Tensor, batch: TrainBatch) -> dict[str, float]:
        """How well the critic predicted the returns, and the shaped rewards' figures."""
        mask, returns = batch.completion_mask, batch.returns
        rewards, kl = self.shaped_rewards(scores, batch), self.kl_to_reference(batch)
        advantages = (returns - batch.old_values) * mask  # GAE's, before any whitening
        info = {
            "value/explained_variance": explained_variance(batch.old_values, returns, mask),
            "value/rollout_mean": masked_mean(batch.old_values, mask).item(),
            "returns/mean": masked_mean(returns, mask).item(),
            "advantages/mean_raw": masked_mean(advantages, mask).item(),
            "reward/shaped_mean": rewards.sum(1).mean().item(),
        }
        if kl is not None:
            info["policy/kl_ref"] = masked_mean(kl, mask).item()
        return info

    def loss(self, logprobs: torch.Tensor, batch: TrainBatch) -> tuple[torch.Tensor, dict]:
        """Runs on every trainer proc: the clipped surrogate on per-token advantages
        (the KL is already in the reward)."""
        cfg = self.cfg
        return policy_loss(
            logprobs,
            batch.old_logprobs,
            batch.advantages,
            batch.completion_mask,
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            aggregation=cfg.loss_aggregation,
            max_tokens=cfg.generation.max_new_tokens,
            scale=batch.scale,
            weights=batch.weights,
        )


if __name__ == "__main__":
    run_main(PPO, PPOConfig)
