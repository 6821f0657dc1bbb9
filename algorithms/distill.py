"""On-policy distillation: a student learns a frozen teacher's per-token
distribution on the student's own samples.

Each step runs GRPO's loop (grpo.py) with two changes. The frozen mesh is a
teacher with weights of its own: a model loaded by path, or built from config.
It is not a copy of the student. Each completion token t gets the advantage

    A_t = -(log pi_student(x_t) - log p_teacher(x_t))

This is minus the per-token estimate of the reverse KL on the student's sample,
with no credit to later tokens: the Thinking Machines on-policy distillation
recipe (Lu et al. 2025), after GKD (Agarwal et al. 2024) and MiniLLM (Gu et al.
2024). With one optimizer step per batch, the clipped surrogate's gradient is
then the policy gradient of the per-token reverse KL. `reward_weight` adds the
task's group-normalized reward to every token's advantage. 0 (the default)
trains on the teacher alone.

Held-out evaluation is the run's `eval:` sets (drawn once, skipped by training):
the student samples them, the environment rewards the samples and the teacher
scores them, giving `eval/<set>/reward` and `eval/<set>/reverse_kl` (per token);
`eval.before` also logs both before any update (`_before`).

Run it (the teacher is the final model of a GRPO run):
    make run ARGS="run.name=teacher"
    make run ALGO=distill CONFIG=algorithms/configs/distill.yaml
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from algorithms.base import run_main
from algorithms.grpo import GRPO, GRPOConfig, GRPOLoss
from meshrl.config import ConfigError, ModelConfig
from meshrl.envs import make_task
from meshrl.loop.export import start_from
from meshrl.loop.run import Role, Run
from meshrl.model.losses import group_advantages, masked_mean, scale_of
from meshrl.model.tokenizer import check_tokenizer_fits, context_length, load_tokenizer
from meshrl.types import Completions, TrainBatch


@dataclass
class DistillConfig(GRPOConfig):
    CHECKED_APART: ClassVar[tuple[str, ...]] = ("teacher",)  # by `validate`, by its name
    MOVED: ClassVar[dict[str, str]] = {
        "eval_every": "eval.every",
        "eval_prompts": "eval.sets.<name>.prompts",
    }
    teacher: ModelConfig = field(default_factory=ModelConfig)
    """The frozen teacher: a local HF directory (`teacher.path`) or a model built
    from these keys. Its tokenizer must be the student's (`model`)."""
    teacher_seed: int = 1
    """Initialization seed of a teacher built from config (no `teacher.path`)."""
    reward_weight: float = 0.0
    """Weight of the task's group-normalized reward, added to every token's
    advantage; 0 trains on the teacher's log-probs alone."""
    baseline: bool = True
    """Subtract from each token's advantage the mean over the batch's other tokens
    (leave-one-out: the baseline does not depend on the token's own sample, so the
    expected gradient stays the same), with much less variance."""
    loss_aggregation: str = "token-mean"
    """How per-token losses become a scalar; see meshrl.model.losses.aggregate."""

    min_group_size = 1

    def validate(self) -> None:
        super().validate()
        if self.teacher.path is not None and not os.path.isdir(self.teacher.path):
            raise ConfigError(
                f"config key 'teacher.path': no such directory: {self.teacher.path} (a trained "
                "model; `make run ARGS=run.name=teacher` writes one to runs/teacher/final)"
            )
        self.teacher.validate("teacher")
        check_tokenizer_fits(self.teacher, "teacher")
        if self.kl_coef:
            raise ConfigError(
                "config key 'kl_coef': must be 0 in distillation (the KL is to the teacher)"
            )
        if self.reward_weight < 0:
            raise ConfigError("config key 'reward_weight': must be >= 0")
        if self.reward_weight and self.group_size < 2:
            raise ConfigError(
                "config key 'group_size': must be >= 2 with reward_weight > 0 "
                "(reward advantages compare completions of one prompt)"
            )
        if make_task(self.task).multi_turn:
            raise ConfigError(
                f"config key 'task.name': distillation runs single-turn tasks ({self.task.name} "
                "is multi-turn)"
            )


class DistillLoss(GRPOLoss):
    """GRPO's loss on the per-token advantages, logging the reverse KL to the teacher."""

    def __call__(self, logprobs: torch.Tensor, batch: TrainBatch) -> tuple[torch.Tensor, dict]:
        loss, metrics = super().__call__(logprobs, batch)
        mask = batch.completion_mask
        reverse_kl = logprobs.detach() - batch.ref_logprobs
        metrics["distill/reverse_kl"] = (
            scale_of(mask, batch.scale).token_mean(reverse_kl, mask).item()
        )
        return loss, metrics


class Distill(GRPO):
    name = "distill"
    Loss = DistillLoss
    headline = "distill/reverse_kl"

    def __init__(self, cfg: DistillConfig):
        start_from(cfg.teacher, "teacher.path")  # another run's output works too
        super().__init__(cfg)
        teacher = load_tokenizer(cfg.teacher)
        if teacher.get_vocab() != self.tokenizer.get_vocab():
            raise ConfigError(
                "config key 'teacher': distillation needs a shared vocabulary: the teacher's "
                f"tokenizer ({len(teacher)} tokens) is not the student's ({len(self.tokenizer)})"
            )
        if context_length(cfg.teacher) < self.context:
            raise ConfigError(
                f"config key 'teacher': its context ({context_length(cfg.teacher)} tokens) is "
                f"shorter than the student's ({self.context}), whose samples it scores"
            )

    # --- the meshes: GRPO's, with a teacher where the reference would be ----------

    def placement(self) -> tuple[dict[str, int], dict[str, str], list[tuple[str, ...]]]:
        procs, share, busy = super().placement()
        procs["teacher"] = self.cfg.placement.teacher
        return procs, share, [*busy, ("teacher",)]

    def spawn_reference(self, run: Run) -> Role:
        """The teacher: its own weights, loaded (or built) in its procs."""
        from actors.reference import Reference

        cfg = self.cfg
        return run.spawn("teacher", Reference, cfg.teacher, cfg.teacher_seed, cfg.trainer.layout)

    def compute_advantages(self, rewards: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
        """[B, T]: minus each token's reverse-KL estimate, plus the weighted
        reward advantage."""
        mask = batch.completion_mask
        advantages = batch.ref_logprobs - batch.old_logprobs
        if self.cfg.baseline:  # leave-one-out: the mean of the batch's *other* tokens
            count, total = mask.sum(), (advantages * mask).sum()
            advantages = advantages - (total - advantages * mask) / (count - 1).clamp(min=1)
        advantages = advantages * mask
        if self.cfg.reward_weight:
            cfg = self.cfg
            rewarded = group_advantages(rewards, cfg.group_size, scale=cfg.advantage_scale)
            advantages = advantages + cfg.reward_weight * rewarded.unsqueeze(1) * mask
        return advantages

    # --- held-out evaluation (`eval:`) ------------------------------------------------

    def judge(self, completions: Completions, temperature: float) -> dict[str, float]:
        """The teacher's per-token reverse KL to the student's held-out samples."""
        batch = TrainBatch.from_completions(completions)
        teacher = self.sup.call_rows(self.reference, "logprobs", batch, temperature)
        return {
            "reverse_kl": masked_mean(batch.old_logprobs - teacher, batch.completion_mask).item()
        }


if __name__ == "__main__":
    run_main(Distill, DistillConfig)
