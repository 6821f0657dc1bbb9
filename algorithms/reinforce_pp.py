"""REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for
Aligning Large Language Models"), with its "-baseline" variant.

GRPO's loop with the advantage hook changed: the sequence reward sits on the
last token, every token pays `kl_coef` times its k1 KL to the reference (the
KL lives in the reward, not in the loss), advantages are the returns-to-go,
and they are normalized over all tokens of the batch (global, not per group).
With `subtract_group_mean: true` the group's mean reward is removed first
(REINFORCE++-baseline), which keeps the prompt-level baseline of GRPO/RLOO.

    python -m algorithms.reinforce_pp --config algorithms/configs/reinforce_pp.yaml
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from algorithms.base import run_main
from algorithms.grpo import GRPO, GRPOConfig, GRPOLoss
from meshrl.config import ConfigError
from meshrl.model.losses import kl_estimate, returns_to_go, token_rewards, whiten
from meshrl.types import TrainBatch


@dataclass
class ReinforcePPConfig(GRPOConfig):
    kl_kind: str = "k1"
    subtract_group_mean: bool = True
    """REINFORCE++-baseline: remove each prompt's mean reward before normalizing."""
    loss_aggregation: str = "token-mean"

    min_group_size = 1
    kl_in_reward = True  # k1 is accepted: the KL is in the reward, not a loss term

    def validate(self) -> None:
        super().validate()
        if self.subtract_group_mean and self.group_size < 2:
            raise ConfigError(
                "config key 'group_size': subtract_group_mean needs >= 2 completions per prompt"
            )


class ReinforcePPLoss(GRPOLoss):
    """The clipped surrogate alone: the KL is in the reward (`compute_advantages`),
    so it is only logged here."""

    def __call__(self, logprobs: torch.Tensor, batch: TrainBatch) -> tuple[torch.Tensor, dict]:
        loss, metrics = self.surrogate(logprobs, batch)
        kl = self.kl_to_reference(logprobs, batch)
        if kl is not None:
            metrics["policy/kl_ref"] = kl.item()
        return loss, metrics


class ReinforcePP(GRPO):
    name = "reinforce_pp"
    Loss = ReinforcePPLoss

    def compute_advantages(self, rewards: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
        """[B] rewards -> [B, T] globally normalized returns of KL-shaped rewards."""
        cfg, mask = self.cfg, batch.completion_mask
        if cfg.subtract_group_mean:
            grouped = rewards.float().view(-1, cfg.group_size)
            rewards = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)
        kl = None
        if batch.ref_logprobs is not None:
            kl = kl_estimate(batch.old_logprobs, batch.ref_logprobs, cfg.kl_kind)
        shaped = token_rewards(rewards, mask, kl, cfg.kl_coef)
        return whiten(returns_to_go(shaped, mask), mask)


if __name__ == "__main__":
    run_main(ReinforcePP, ReinforcePPConfig)
