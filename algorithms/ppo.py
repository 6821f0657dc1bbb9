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

The loop is GRPO's (`GRPO.run`, algorithms/grpo.py): PPO adds its critic and
its advantages through the loop's hooks, not a copy of the step.

Run it:
    python -m algorithms.ppo --config algorithms/configs/ppo.yaml
    python -m algorithms.ppo --config algorithms/configs/ppo.yaml kl_coef=0.1 placement.critic=2

In Python: `PPO(load_config(PPOConfig, "algorithms/configs/ppo.yaml")).run()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from algorithms.base import RLConfig, run_main
from algorithms.grpo import GRPO, GRPOLoss
from meshrl.config import ConfigError, OptimConfig
from meshrl.loop.run import Role, Run
from meshrl.model.losses import (
    AGGREGATIONS,
    explained_variance,
    gae,
    kl_estimate,
    masked_mean,
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

    ratio_level: ClassVar[str] = "token"  # one ratio per token (GRPOLoss's surrogate reads it)

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


class PPOLoss(GRPOLoss):
    """Runs on every trainer proc: the clipped surrogate on per-token advantages
    (the KL is already in the reward)."""

    def __call__(self, logprobs: torch.Tensor, batch: TrainBatch) -> tuple[torch.Tensor, dict]:
        return self.surrogate(logprobs, batch)


class PPO(GRPO):
    """GRPO's loop (`GRPO.run`) with a critic: its mesh (`spawn_critic`), its
    value of every prefix in each batch, GAE advantages and a value step beside
    each policy step."""

    name = "ppo"
    Loss = PPOLoss
    trains = ("trainer", "critic")

    def placement(self) -> tuple[dict[str, int], dict[str, str], list[tuple[str, ...]]]:
        procs, share, busy = super().placement()
        # The policy and value steps run at the same time (`Supervisor.call_sharded` of both).
        ahead = ("policy",) if self.cfg.max_staleness else ()
        return (
            {**procs, "critic": self.cfg.placement.critic},
            share,
            [*busy, ("trainer", "critic", *ahead)],
        )

    def spawn_critic(self, run: Run) -> Role:
        """The critic mesh: the policy's backbone with a value head, data-parallel over
        its procs (it starts from the policy's weights: `GRPO.run` loads them)."""
        from actors.critic import Critic

        cfg = self.cfg
        return run.spawn(
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

    # --- hooks ------------------------------------------------------------------------

    def compute_advantages(self, scores: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
        """[B] scores -> [B, T] advantages, as every on-policy algorithm's hook: GAE
        over KL-shaped token rewards. Needs `batch.old_values` (and `ref_logprobs`
        when kl_coef > 0); changes nothing in `batch`."""
        advantages, _ = self.gae(scores, batch)
        mask = batch.completion_mask
        return whiten(advantages, mask) if self.cfg.whiten_advantages else advantages

    def value_targets(self, scores: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
        """[B] scores -> [B, T]: what the critic learns to predict, GAE's returns."""
        return self.gae(scores, batch)[1]

    def gae(self, scores: torch.Tensor, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T] advantages and returns by GAE over the KL-shaped token rewards."""
        cfg = self.cfg
        return gae(
            self.shaped_rewards(scores, batch),
            batch.old_values,
            batch.completion_mask,
            cfg.gamma,
            cfg.lam,
        )

    def shaped_rewards(self, scores: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
        """[B, T]: each sequence's score on its last token, minus `kl_coef` times each
        token's KL to the reference."""
        cfg = self.cfg
        return token_rewards(scores, batch.completion_mask, self.token_kl(batch), cfg.kl_coef)

    def token_kl(self, batch: TrainBatch) -> torch.Tensor | None:
        """[B, T]: each sampled token's KL to the reference (None without one)."""
        if batch.ref_logprobs is None:
            return None
        return kl_estimate(batch.old_logprobs, batch.ref_logprobs, self.cfg.kl_kind)

    def advantage_metrics(self, scores: torch.Tensor, batch: TrainBatch) -> dict[str, float]:
        """How well the critic predicted the returns, and the shaped rewards' figures."""
        mask, returns = batch.completion_mask, batch.returns
        rewards, kl = self.shaped_rewards(scores, batch), self.token_kl(batch)
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


if __name__ == "__main__":
    run_main(PPO, PPOConfig)
