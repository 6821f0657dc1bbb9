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
`after_step`) for a variant: rloo.py, reinforce_pp.py and dapo.py do.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch

from algorithms.base import Algorithm, RLConfig, main
from meshrl.config import ConfigError
from meshrl.losses import AGGREGATIONS, group_advantages, kl_estimate, masked_mean, policy_loss
from meshrl.mesh import RemoteCallError
from meshrl.types import Completions, TrainBatch


@dataclass
class GRPOConfig(RLConfig):
    clip_low: float = 0.2
    """PPO clip range below 1."""
    clip_high: float | None = None
    """PPO clip range above 1 (DAPO's clip-higher); None uses clip_low."""
    ratio_level: str = "token"
    """token (PPO/GRPO) or sequence (GSPO: one length-normalized ratio per sequence)."""
    loss_aggregation: str = "seq-mean-token-mean"
    """How per-token losses become a scalar; see meshrl.losses.aggregate."""
    advantage_scale: str = "group"
    """group (GRPO), batch, or none (Dr. GRPO): the std that divides advantages."""

    min_group_size = 2

    def validate(self) -> None:
        super().validate()
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
        if self.ratio_level not in ("token", "sequence"):
            raise ConfigError(
                f"config key 'ratio_level': '{self.ratio_level}' is not one of token, sequence"
            )


class GRPO(Algorithm):
    name = "grpo"
    kl_in_reward = False
    """True when `compute_advantages` puts the KL into the reward (REINFORCE++):
    then `loss` adds no KL term of its own."""

    # --- the loop ---------------------------------------------------------------------

    def run(self) -> list[dict]:
        """Spawn the meshes, train for `cfg.steps` steps, save, and stop every proc."""
        cfg = self.cfg
        self.setup()
        try:
            # Version 0 to every replica, warm-start, reference; or a checkpoint's state.
            first_step = self.start()
            self.start_logger(cfg.steps, first_step)
            step = first_step
            while step < cfg.steps:
                self.inject_faults(step)  # drills from the `faults:` config, if any
                started = time.perf_counter()
                completions, rewards, rollout_info = self.rollout()
                batch = TrainBatch.from_completions(completions)
                reference_started = time.perf_counter()
                if "reference" in self.meshes:
                    batch.ref_logprobs = self.reference_logprobs(batch)
                reference_s = time.perf_counter() - reference_started
                batch.advantages = self.compute_advantages(rewards, batch)

                train_started = time.perf_counter()
                try:
                    train_metrics = self.optimize(batch)
                    sync_started = time.perf_counter()
                    self.sync_weights()
                except RemoteCallError as error:
                    step = self.rewind(step, error)  # lost trainer: back to the newest checkpoint
                    continue
                finished = time.perf_counter()
                self.guard_finite(step, train_metrics)  # NaN/inf steps were skipped; too many stop
                self.record_samples(step, completions, rewards, batch.advantages)

                self.after_step(
                    step,
                    {
                        "step": step,
                        **self.rollout_metrics(rewards, completions),
                        **rollout_info,  # after the reward keys: a rollout may refine them
                        **train_metrics,
                        **self.account(trained=len(batch)),
                        "time/reference_s": reference_s,
                        "time/train_s": sync_started - train_started,
                        "time/weight_sync_s": finished - sync_started,
                        "time/step_s": finished - started,
                    },
                )
                self.end_step(step + 1)  # checkpoint when due; stop on Ctrl-C
                step += 1
            self.finish()
        finally:
            self.shutdown()
        return self.logger.history

    # --- hooks: override one of these for a variant ---------------------------------

    def rollout(self) -> tuple[Completions, torch.Tensor, dict]:
        """This step's `prompts_per_step` prompts with `group_size` completions each,
        scored (generated ahead when `max_staleness > 0`).

        Returns completions [B = prompts x group], rewards [B] and metrics to log.
        """
        return self.next_rollout()

    def compute_advantages(self, rewards: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
        """[B] rewards -> [B] group-normalized advantages ([B, T] per token also works).

        `batch` holds the completions, their mask and, when a reference runs,
        `ref_logprobs`.
        """
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
            ratio_level=cfg.ratio_level,
            max_tokens=cfg.generation.max_new_tokens,
        )
        if batch.ref_logprobs is not None and cfg.kl_coef > 0:
            kl = masked_mean(
                kl_estimate(logprobs, batch.ref_logprobs, cfg.kl_kind), batch.completion_mask
            )
            if not self.kl_in_reward:
                loss = loss + cfg.kl_coef * kl
            metrics["policy/kl_ref"] = kl.item()
        return loss, metrics

    def after_step(self, step: int, metrics: dict) -> None:
        """Record the step (metrics.jsonl, progress bar)."""
        self.log_step(metrics)


if __name__ == "__main__":
    sys.exit(main(GRPO, GRPOConfig))
