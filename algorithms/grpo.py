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

from dataclasses import dataclass

import torch

from algorithms.base import Algorithm, RLConfig, run_main
from meshrl.config import ConfigError
from meshrl.loop.run import Role, Run
from meshrl.loop.steplog import rollout_metrics
from meshrl.loop.supervisor import RoleLost, merge_optimizer_steps
from meshrl.model.losses import AGGREGATIONS, group_advantages, kl_estimate, policy_loss, scale_of
from meshrl.types import TrainBatch


@dataclass
class GRPOConfig(RLConfig):
    clip_low: float = 0.2
    """PPO clip range below 1."""
    clip_high: float | None = None
    """PPO clip range above 1 (DAPO's clip-higher); None uses clip_low."""
    ratio_level: str = "token"
    """token (PPO/GRPO) or sequence (GSPO: one length-normalized ratio per sequence)."""
    loss_aggregation: str = "seq-mean-token-mean"
    """How per-token losses become a scalar; see meshrl.model.losses.aggregate."""
    advantage_scale: str = "group"
    """group (GRPO), batch, or none (Dr. GRPO): the std that divides advantages."""

    min_group_size = 2
    kl_in_reward = False
    """True when the algorithm puts the KL into the reward (REINFORCE++, whose own
    `loss` adds no KL term): `validate` then accepts k1."""

    def validate(self) -> None:
        super().validate()
        if self.kl_coef > 0 and self.kl_kind == "k1" and not self.kl_in_reward:
            # k1 = log(pi/ref): its expected gradient under pi is zero, so as a loss
            # term it adds noise and no pull towards the reference.
            raise ConfigError(
                "config key 'kl_kind': k1 as a loss term has an expected gradient of "
                "zero (it adds only noise); use k3 (the default) or k2, or kl_coef=0"
            )
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
    """The on-policy loop. GRPO's hooks make it GRPO; PPO (ppo.py) runs the same
    loop with a critic mesh (`spawn_critic`) and GAE advantages, and DAPO, RLOO,
    REINFORCE++, GSPO and distillation override one hook each."""

    name = "grpo"
    trains: tuple[str, ...] = ("trainer",)
    """The roles whose procs hold gradients and Adam's moments (sized so)."""

    # --- the loop ---------------------------------------------------------------------

    def run(self, num_steps: int | None = None) -> list[dict]:
        """Spawn the meshes (first call), train `num_steps` more steps (None: to
        `cfg.steps`, then save the model and stop every proc)."""
        from actors.environment import Environment
        from actors.reward_model import RewardModel

        cfg, state = self.cfg, self.state
        with self.running(num_steps):  # an error: `failed`; a whole run: `stop()` at its end
            if self.meshes is None:  # --- the meshes: one per role, one actor per proc ---
                run = self.meshes = Run(
                    cfg,
                    self.name,
                    *self.placement(),
                    elastic=self.elastic,  # pools that grow and shrink
                    beside=self.beside(),
                    trains=self.trains,
                    cpu_only=("environment",),  # no GPU for the scorers
                )
                self.trainer = self.spawn_trainer(run)
                self.critic = self.spawn_critic(run)  # a value model (PPO); none here
                self.policy = self.spawn_policy(run)
                self.environment = run.spawn("environment", Environment, *cfg.env_args)
                self.reference = self.spawn_reference(run)
                self.reward_model = None
                if cfg.reward_model.path:
                    self.reward_model = run.spawn(
                        "reward_model", RewardModel, cfg.reward_model.path
                    )
                self.assemble(run, [self.trainer, self.critic, self.frozen_copy, self.policy])
                self.start()  # a checkpoint's state, or version 0, the warm start, the copies
            run, sup, sync, log, critic = self.meshes, self.sup, self.sync, self.log, self.critic
            policy, trainer, reference = self.policy, self.trainer, self.reference
            # Ctrl-C or SIGTERM: stop after the step under way; the drills and pool sizes
            # due before each step; its count and the checkpoints due after it (`Steps`).
            with self.steps(num_steps) as steps:
                for step in steps:
                    with log.timer("step"):
                        # Generate this step's batch (and `max_staleness` batches ahead):
                        # group_size copies of each prompt, split over the policy replicas.
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
                        # Collect it, score it on the environment mesh, refill failed groups
                        # (or, by pull, the groups the free replicas took: `rollout.dispatch`).
                        completions, rewards, rollout_info = self.next_rollout()
                        batch = TrainBatch.from_completions(completions)
                        with log.timer("reference"):  # rows split over the reference procs
                            if reference is not None:
                                batch.ref_logprobs = sup.call_rows(
                                    reference, "logprobs", batch, cfg.generation.temperature
                                )
                        try:
                            rollout_info.update(self.old_logprobs(batch))  # trainer's, if on
                            if critic is not None:  # the value of every prefix
                                batch.old_values = sup.call_rows(critic, "values", batch)
                            batch.advantages = self.compute_advantages(rewards, batch)
                            if critic is not None:  # what its value step learns to predict
                                batch.returns = self.value_targets(rewards, batch)
                            advantage_info = self.advantage_metrics(rewards, batch)
                            # Each trainer rank steps on its shard of every minibatch
                            # (DDP or FSDP2 inside the mesh), and with a critic each of its
                            # ranks takes a value step on the same rows at the same time ...
                            learners = trainer if critic is None else (trainer, critic)
                            with log.timer("train"):
                                train_metrics = merge_optimizer_steps(
                                    [
                                        sup.call_sharded(learners, "train_step", batch.rows(rows))
                                        for rows in self.minibatches(len(batch))
                                    ]
                                )
                            # ... then publishes the new version, and every replica
                            # pulls it: shared memory on this host, RDMA across hosts.
                            with log.timer("weight_sync"):
                                handle = sync.publish(trainer)  # trainer.publish
                                sync.pull(policy, handle)  # policy.load_weights
                        except RoleLost as lost:  # no peer to heal from: to a checkpoint
                            self.ckpt.rewind(lost, sup, log, len(batch))
                            continue
                    sup.guard_finite(step, train_metrics, self.newest_checkpoint())
                    self.record_samples(step, completions, rewards, batch.advantages)
                    self.record_step(
                        step,
                        {
                            "step": step,
                            **rollout_metrics(rewards, completions, sync),
                            **advantage_info,
                            **rollout_info,  # after the reward keys: a rollout may refine them
                            **train_metrics,
                            **self.accounting(trained=len(batch)),
                        },
                    )
        return self.log.history

    # --- hooks: override one of these for a variant ---------------------------------

    def spawn_critic(self, run: Run) -> Role | None:
        """A value model's mesh (PPO's critic), which estimates every prefix's value
        (`batch.old_values`) and takes a value step beside each policy step; none
        in GRPO, whose baseline is the group."""
        return None

    def value_targets(self, rewards: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
        """[B] rewards -> [B, T]: what a critic learns to predict (PPO: GAE's returns);
        asked only where `spawn_critic` gave the loop a critic."""
        raise NotImplementedError(
            f"{type(self).__name__} spawns a critic: say what it learns (value_targets)"
        )

    def advantage_metrics(self, rewards: torch.Tensor, batch: TrainBatch) -> dict[str, float]:
        """Figures of the step's advantages to log beside the rewards (none here)."""
        return {}

    def spawn_reference(self, run: Run) -> Role | None:
        """The mesh whose log-probs each batch carries as `ref_logprobs`: with
        `kl_coef > 0`, a frozen copy of the starting weights (it pulls them
        from the trainer once, after any warm-start); else none. Distillation
        spawns its teacher here instead."""
        from actors.reference import Reference

        cfg = self.cfg
        if cfg.kl_coef <= 0:
            return None
        return run.spawn(
            "reference", Reference, cfg.model, cfg.run.seed, cfg.trainer.layout, frozen_copy=True
        )

    def compute_advantages(self, rewards: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
        """[B] rewards -> [B] group-normalized advantages ([B, T] per token also works).

        `batch` holds the completions, their mask and, when a reference runs,
        `ref_logprobs`.
        """
        return group_advantages(rewards, self.cfg.group_size, scale=self.cfg.advantage_scale)

    def loss(self, logprobs: torch.Tensor, batch: TrainBatch) -> tuple[torch.Tensor, dict]:
        """Runs on every trainer proc, on its shard of the batch: clipped surrogate
        (+ KL to the reference), each a mean over the whole batch (`batch.scale`)."""
        loss, metrics = self.surrogate(logprobs, batch)
        kl = self.kl_to_reference(logprobs, batch)
        if kl is not None:
            loss = loss + self.cfg.kl_coef * kl
            metrics["policy/kl_ref"] = kl.item()
        return loss, metrics

    def surrogate(self, logprobs: torch.Tensor, batch: TrainBatch) -> tuple[torch.Tensor, dict]:
        """The clipped policy-gradient surrogate and its metrics (`policy_loss`)."""
        cfg = self.cfg
        return policy_loss(
            logprobs,
            batch.old_logprobs,
            batch.advantages,
            batch.completion_mask,
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            aggregation=cfg.loss_aggregation,
            ratio_level=cfg.ratio_level,
            max_tokens=cfg.generation.max_new_tokens,
            scale=batch.scale,
            weights=batch.weights,
        )

    def kl_to_reference(self, logprobs: torch.Tensor, batch: TrainBatch) -> torch.Tensor | None:
        """The token-mean KL estimate (`kl_kind`) to the reference over the whole
        batch; None without one (`kl_coef` 0)."""
        cfg = self.cfg
        if batch.ref_logprobs is None or cfg.kl_coef <= 0:
            return None
        return scale_of(batch.completion_mask, batch.scale).token_mean(
            kl_estimate(logprobs, batch.ref_logprobs, cfg.kl_kind), batch.completion_mask
        )


if __name__ == "__main__":
    run_main(GRPO, GRPOConfig)
