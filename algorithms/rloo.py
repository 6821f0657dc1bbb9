"""RLOO: REINFORCE with a leave-one-out baseline (Ahmadian et al. 2024, "Back to
Basics: Revisiting REINFORCE Style Optimization for Learning from Human
Feedback in LLMs"; Kool et al. 2019).

GRPO's loop with one hook changed: each completion's advantage is its reward
minus the mean reward of the other completions of the same prompt, with no
division by a standard deviation. With one optimizer step per batch the
clipped surrogate's gradient is exactly REINFORCE's.

    python -m algorithms.rloo --config algorithms/configs/rloo.yaml
"""

from __future__ import annotations

import torch

from algorithms.base import run_main
from algorithms.grpo import GRPO, GRPOConfig
from meshrl.model.losses import per_token, rloo_advantages
from meshrl.types import TrainBatch


class RLOO(GRPO):
    name = "rloo"

    def compute_advantages(self, rewards: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
        return per_token(rloo_advantages(rewards, self.cfg.group_size), batch.completion_mask)


if __name__ == "__main__":
    run_main(RLOO, GRPOConfig)
