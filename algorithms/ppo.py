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

import sys
import time
from dataclasses import dataclass, field

import torch

from algorithms.base import Algorithm, RLConfig, main, step_metrics
from meshrl.config import ConfigError, OptimConfig
from meshrl.losses import (
    AGGREGATIONS,
    explained_variance,
    gae,
    kl_estimate,
    masked_mean,
    policy_loss,
    token_rewards,
    whiten,
)
from meshrl.mesh import RemoteCallError, call_all
from meshrl.types import TrainBatch


@dataclass
class PPOConfig(RLConfig):
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

    def run(self) -> list[dict]:
        cfg = self.cfg
        self.setup()
        try:
            first_step = self.start()
            self.start_logger(cfg.steps, first_step)
            step = first_step
            while step < cfg.steps:
                self.inject_faults(step)  # drills from the `faults:` config, if any
                started = time.perf_counter()
                completions, scores, rollout_info = self.next_rollout()
                batch = TrainBatch.from_completions(completions)
                if "reference" in self.meshes:
                    batch.ref_logprobs = self.reference_logprobs(batch)

                train_started = time.perf_counter()
                try:
                    batch.old_values = self.call_rows("critic", "values", batch)
                    advantage_info = self.compute_advantages(scores, batch)
                    train_metrics = self.optimize(batch)
                    sync_started = time.perf_counter()
                    self.sync_weights()
                except RemoteCallError as error:
                    step = self.rewind(step, error)  # lost trainer/critic: back to a checkpoint
                    continue
                finished = time.perf_counter()
                self.guard_finite(step, train_metrics)  # NaN/inf steps were skipped; too many stop
                self.record_samples(step, completions, scores, batch.advantages)

                self.log_step(
                    {
                        "step": step,
                        **self.rollout_metrics(scores, completions),
                        **advantage_info,
                        **rollout_info,
                        **train_metrics,
                        **self.account(trained=len(batch)),
                        "time/train_s": sync_started - train_started,
                        "time/weight_sync_s": finished - sync_started,
                        "time/step_s": finished - started,
                    }
                )
                self.end_step(step + 1)  # checkpoint when due; stop on Ctrl-C
                step += 1
            self.finish()
        finally:
            self.shutdown()
        return self.logger.history

    # --- hooks ------------------------------------------------------------------------

    def compute_advantages(self, scores: torch.Tensor, batch: TrainBatch) -> dict[str, float]:
        """KL-shaped token rewards -> GAE advantages and value targets, set on
        `batch`; returns metrics. Needs `batch.old_values` (and `ref_logprobs`
        when kl_coef > 0)."""
        cfg, mask = self.cfg, batch.completion_mask
        kl = None
        if batch.ref_logprobs is not None:
            kl = kl_estimate(batch.old_logprobs, batch.ref_logprobs, cfg.kl_kind)
        rewards = token_rewards(scores, mask, kl, cfg.kl_coef)
        advantages, returns = gae(rewards, batch.old_values, mask, cfg.gamma, cfg.lam)
        batch.advantages = whiten(advantages, mask) if cfg.whiten_advantages else advantages
        batch.returns = returns
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
        )

    # --- the critic -------------------------------------------------------------------

    def roles(self) -> dict[str, int]:
        return {**super().roles(), "critic": self.cfg.placement.critic}

    def busy_together(self) -> list[tuple[str, ...]]:
        # The policy and value steps run at the same time (`optimize`).
        ahead = ("policy",) if self.cfg.max_staleness else ()
        return [*super().busy_together(), ("trainer", "critic", *ahead)]

    def spawn_role(self, role: str) -> None:
        if role != "critic":
            return super().spawn_role(role)
        from actors.critic import Critic

        cfg = self.cfg
        self.critic = self.meshes.spawn(
            "critic",
            "critic",
            Critic,
            cfg.model,
            cfg.critic_optim,
            total_steps=cfg.total_updates,
            value_clip=cfg.value_clip,
            seed=cfg.run.seed,
            master=self.meshes.rendezvous("critic"),
        )

    def start(self) -> int:
        first_step = super().start()
        if first_step == 0:
            self.load_critic()  # the critic's backbone starts from the policy RL starts from
        return first_step

    def load_critic(self) -> None:
        call_all(
            self.critic,
            "load_backbone",
            self.handle,
            what="critic.load_backbone",
            timeout_s=self.timeout_s,
        )

    def optimize(self, batch: TrainBatch) -> dict[str, float]:
        """Each minibatch: a policy step on the trainer mesh and a value step on
        the critic mesh, running at the same time."""
        steps = []
        for rows in self.minibatches(len(batch)):
            part = batch.rows(rows)

            def policy_step(part=part) -> list:
                return self.start_sharded("trainer", part, "train_step")

            def value_step(part=part) -> list:
                return self.start_sharded("critic", part, "train_step")

            policy, value = policy_step(), value_step()
            steps.append(
                {
                    **self.collect(policy, "trainer.train_step", again=policy_step),
                    **self.collect(value, "critic.train_step", again=value_step),
                }
            )
        return step_metrics(steps)


if __name__ == "__main__":
    sys.exit(main(PPO, PPOConfig))
