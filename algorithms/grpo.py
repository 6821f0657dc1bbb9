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
from typing import Any

import torch

from algorithms.base import Algorithm, Loss, RLConfig, run_main
from algorithms.rl_config import POOLS
from algorithms.roles import (
    group_replicas,
    heal_trainer,
    restore_frozen,
    spawn_policy,
    spawn_trainer,
)
from meshrl.config import ConfigError
from meshrl.envs import make_task
from meshrl.loop.checkpoint import Checkpointer
from meshrl.loop.collector import Batch, Collector, decode
from meshrl.loop.dispatch import Dispatcher, token_lags
from meshrl.loop.elastic import Scaler
from meshrl.loop.evaluation import Evaluator
from meshrl.loop.run import Role, Run
from meshrl.loop.steplog import StepLog, rollout_metrics
from meshrl.loop.supervised import demonstrations, supervised_steps
from meshrl.loop.supervisor import RoleLost, Supervisor, merge_optimizer_steps
from meshrl.loop.weight_sync import WeightSync
from meshrl.model.losses import (
    AGGREGATIONS,
    group_advantages,
    kl_estimate,
    mismatch_metrics,
    mismatch_weights,
    per_token,
    policy_loss,
    scale_of,
)
from meshrl.types import Completions, TrainBatch


def per_token_advantages(advantages: Any, batch: TrainBatch) -> torch.Tensor:
    """What `compute_advantages` returned, checked: [B, T] like the batch's mask."""
    want = tuple(batch.completion_mask.shape)
    got = tuple(getattr(advantages, "shape", ()))
    if got != want:
        raise ValueError(
            f"compute_advantages returned shape {list(got)}, not [B, T] = {list(want)}: one "
            "advantage per completion token (meshrl.model.losses.per_token(a, "
            "batch.completion_mask) spreads one a sequence)"
        )
    return advantages


DROP_REASONS = ("stale", "trainer_rewind")
REDO_REASONS = ("policy_lost",)
"""Reasons a step always logs as `samples/dropped_<reason>` (others when they occur)."""


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


class GRPOLoss(Loss):
    """Runs on every trainer proc, on its shard of the batch: the clipped surrogate
    (+ `kl_coef` times the KL to the reference), each a mean over the whole batch
    (`batch.scale`)."""

    def __call__(self, logprobs: torch.Tensor, batch: TrainBatch) -> tuple[torch.Tensor, dict]:
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


class GRPO(Algorithm):
    """The on-policy loop. GRPO's hooks make it GRPO; PPO (ppo.py) runs the same
    loop with a critic mesh (`spawn_critic`) and GAE advantages, and DAPO, RLOO,
    REINFORCE++, GSPO and distillation override one hook each."""

    name = "grpo"
    Loss = GRPOLoss
    samples = True
    trains: tuple[str, ...] = ("trainer",)
    """The roles whose procs hold gradients and Adam's moments (sized so)."""
    judge = None
    """A method `(completions, temperature) -> {figure: value}` to add figures of the
    algorithm's own to each held-out set (`eval:`): distillation's teacher KL."""

    def __init__(self, cfg: RLConfig):
        super().__init__(cfg)
        self.task = make_task(cfg.task)
        # Roles whose pools grow and shrink (`scale`); a tensor-parallel replica's procs
        # form a group, so its pool does not.
        self.elastic = POOLS if cfg.placement.policy_tp == 1 else ("environment",)
        self.reference: Role | None = None  # a frozen mesh (a reference, a teacher), where one runs
        self.critic: Role | None = None  # a value model's mesh (PPO's), where one runs
        self.stream: Role | None = None  # the policy's running-batch endpoint (pull dispatch)
        self.evaluator: Evaluator | None = None

    # --- the loop ---------------------------------------------------------------------

    def run(self, num_steps: int | None = None) -> list[dict]:
        """Spawn the meshes (first call), train `num_steps` more steps (None: to
        `cfg.steps`, then save the model and stop every proc)."""
        from actors.environment import Environment
        from actors.policy import PolicyStream
        from actors.reward_model import RewardModel

        cfg, state = self.cfg, self.state
        with self.running(num_steps):  # an error: `failed`; a whole run: `stop()` at its end
            if self.runtime is None:  # --- the meshes: one per role, one actor per proc ---
                run = self.runtime = Run(
                    cfg,
                    self.name,
                    *self.placement(),
                    elastic=self.elastic,  # pools that grow and shrink
                    beside=self.beside(),
                    trains=self.trains,
                    cpu_only=("environment",),  # no GPU for the scorers
                )
                self.critic = self.spawn_critic(run)  # a value model (PPO); none here
                self.reference = self.spawn_reference(run)
                temperature = cfg.generation.temperature  # the trainer's log-probs' too
                self.trainer = spawn_trainer(
                    run,
                    cfg,
                    self.make_loss(),
                    temperature,
                    # who pulls its weights whole, beside the replicas in their precision
                    full_readers=self.critic is not None or self.frozen_copy is not None,
                )
                self.policy = spawn_policy(
                    run,
                    cfg,
                    self.context,
                    tp=cfg.placement.policy_tp,  # >1: each replica a tensor-parallel group
                    partial=cfg.rollout.partial,
                    lengths=cfg.faults.lengths(),
                )
                if cfg.policy.continuous and cfg.rollout.dispatch == "pull":
                    # The running batch's endpoint, on the same procs: the pull queue's calls.
                    self.stream = run.spawn("policy_stream", PolicyStream, "policy", share="policy")
                self.environment = run.spawn("environment", Environment, *cfg.env_args)
                self.reward_model = None
                if cfg.reward_model.path:
                    self.reward_model = run.spawn(
                        "reward_model", RewardModel, cfg.reward_model.path
                    )
                self.assemble(run)  # supervisor, sync, collector, evaluator, checkpoints, ...
                self.start()  # a checkpoint's state, or version 0, the warm start, the copies
            run, sup, sync, log, critic = self.runtime, self.sup, self.sync, self.log, self.critic
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
                            batch.advantages = per_token_advantages(
                                self.compute_advantages(rewards, batch), batch
                            )
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

    # --- the start of a run -----------------------------------------------------------

    def placement(self) -> tuple[dict[str, int], dict[str, str], list[tuple[str, ...]]]:
        """`Run`'s procs per role, the roles colocated in another's procs, and the
        groups of roles whose procs compute at the same time (they share a
        host's cores): the loop runs one role at a time, and with
        `max_staleness > 0` generation runs while the trainer trains."""
        cfg = self.cfg
        procs = {"trainer": cfg.placement.trainer, "environment": cfg.placement.environment}
        if not cfg.placement.colocate:
            procs["policy"] = cfg.placement.policy
        if cfg.placement.policy_tp > 1:  # each replica's other tensor-parallel procs
            procs["policy_tp"] = cfg.placement.policy * (cfg.placement.policy_tp - 1)
        if cfg.kl_coef > 0:
            procs["reference"] = cfg.placement.reference
        if cfg.reward_model.path:
            procs["reward_model"] = cfg.placement.reward_model
        if cfg.eval.every and cfg.eval.mesh:
            procs["eval"] = cfg.eval.procs
        sampler = ("policy", "policy_tp") if "policy_tp" in procs else ("policy",)
        busy = [(role,) for role in procs if role != "policy_tp"] + [sampler]
        if cfg.max_staleness:
            busy.append((*sampler, "trainer"))
        if "eval" in procs:  # it samples while the next step trains
            busy.append(("eval", "trainer"))
        return procs, {"policy": "trainer"} if cfg.placement.colocate else {}, busy

    def beside(self) -> dict[str, str]:
        """Roles whose procs run on another role's hosts: a tensor-parallel replica's
        followers on its leader's (`RoleMeshes`' `beside`)."""
        return {"policy_tp": "policy"} if self.cfg.placement.policy_tp > 1 else {}

    def assemble(self, run: Run) -> None:
        """The pieces the loop uses, each built with its collaborators: supervisor,
        weight sync, collector, evaluator, rollout queue (by pull), checkpointer and
        scaler; and each role's catch-up after a respawn. Nothing runs yet: `start`."""
        cfg, state, policy, trainer = self.cfg, self.state, self.policy, self.trainer
        self.sup = sup = Supervisor(run, cfg.faults, state)
        # Generation sent ahead with the old weights is handed out before each pull.
        wait = not cfg.max_staleness
        self.sync = sync = WeightSync.from_config(sup, cfg.weights, wait, self.before_pull)
        self.collector = Collector(
            cfg,
            state,
            sup,
            sync,
            self.tokenizer,
            self.task,
            self.context,
            policy,
            self.environment,
            self.reward_model,
            self.vision,
        )
        if cfg.policy.serve_port:  # its token printed and in status.json: its callers need it
            endpoint = self.collector.endpoint(cfg.policy.serve_port)
            print(f"policy endpoint: {endpoint.access()}")
            if run.status is not None:
                run.status.extra.update(endpoint.status_fields())
        # Held-out sets, drawn before any training prompt (which then skips them).
        self.evaluator = self.spawn_evaluator(run)
        self.dispatcher = self.make_dispatcher()
        self.ckpt = Checkpointer(
            run,
            state,
            [trainer, self.critic, self.frozen_copy, policy],  # the roles a checkpoint holds
            cfg.checkpoint,
            after_restore=lambda: sync.pull(policy, sync.publish(trainer)),
            collector=self.collector,
            same_size=("policy",),  # a replica's sampling stream is its own
            queue=self.dispatcher,
            recover=sup.recover,
        )
        if cfg.placement.policy_tp == 1:
            sup.on_respawn("policy", lambda: sync.catch_up(policy))  # the current version
        else:  # a proc of a tensor-parallel group lost: the group is replaced whole

            def regroup(lost: str) -> None:
                run.respawn("policy_tp" if lost == "policy" else "policy")  # the other procs
                group_replicas(run, cfg.run.call_timeout_s)
                sync.catch_up(policy)

            sup.on_respawn("policy", lambda: regroup("policy"))
            sup.on_respawn("policy_tp", lambda: regroup("policy_tp"))
        if self.stream is not None:
            sup.on_respawn(self.stream.name)  # it finds the new replica on its proc
        heal_trainer(sup, cfg, trainer, sync)
        self.scaler = Scaler(
            run, cfg.pool, self.settle, lambda role: sup.catch_up[role](), cfg.faults.standby
        )
        sup.on_respawn("environment")  # nothing to catch up
        sup.on_respawn("reward_model")
        if self.frozen_copy is not None:
            sup.on_respawn(
                self.reference.name, lambda: restore_frozen(sup, self.ckpt, self.reference)
            )
        elif self.reference is not None:
            sup.on_respawn(self.reference.name)  # a model of its own: it loads it itself
        if self.critic is not None:
            sup.heal_from_peers("critic", ("train_step",))  # DDP: its ranks are replicas

    def start(self) -> None:
        """The state step 0 starts from: a checkpoint's (`checkpoint.resume`), or else
        version 0 on every replica, the warm-start, the reference's copy of the
        result, the held-out evaluation before training and the critic's backbone
        (the policy's weights); then the step log."""
        cfg, state, sup, sync = self.cfg, self.state, self.sup, self.sync
        policy, trainer, run = self.policy, self.trainer, self.runtime
        if self.ckpt.resume() is None:
            sync.pull(policy, sync.publish(trainer))  # version 0: the trainer's weights
            if cfg.warm_start.steps:
                self.warm_start()
            if self.frozen_copy is not None:
                sup.call_all(self.reference, "load_weights", sync.handle)
            if self.evaluator is not None:  # `eval.before`: the held-out sets, untrained
                self.evaluator.evaluate_before()
        self.log = StepLog(run, cfg.steps, state.step, self.headline)
        if self.critic is not None and run.resume_from is None:  # it starts as the policy
            sup.call_all(self.critic, "load_backbone", sync.handle)

    def warm_start(self) -> None:
        """Supervised steps on task demonstrations (warm_start.jsonl), then a sync."""
        cfg = self.cfg.warm_start
        supervised_steps(
            self.sup,
            self.trainer,
            lambda step: demonstrations(self.collector, cfg.batch_size),
            cfg.steps,
            cfg.lr,
            f"{self.runtime.dir}/warm_start.jsonl",
            "warm-start",
        )
        self.sync.pull(self.policy, self.sync.publish(self.trainer))

    @property
    def frozen_copy(self) -> Role | None:
        """The reference mesh when it holds a frozen copy of the starting policy
        (spawned with `frozen_copy=True`: pulled from the trainer once, saved in
        checkpoints); None when there is none, or when it is a model of its own
        (distillation's teacher)."""
        reference = self.reference
        return reference if reference is not None and reference.frozen_copy else None

    def spawn_evaluator(self, run: Run) -> Evaluator | None:
        """The held-out sets' `Evaluator` (None without `eval.every`): on the policy
        replicas, or on an `eval` mesh of its own (`eval.mesh`) with its own weight
        sync. It runs before the warm-start and the first step draw any prompt."""
        cfg = self.cfg
        if not cfg.eval.every:
            return None
        if not cfg.eval.mesh:
            return Evaluator(cfg.eval, self.collector, cfg.run.seed, judge=self.judge)
        from actors.policy import Policy

        mesh = run.spawn(
            "eval", Policy, cfg.model, cfg.run.seed, cfg.policy, self.context, run.shm_prefix
        )
        sync = WeightSync.from_config(self.sup, cfg.weights)
        self.sup.on_respawn("eval", lambda: sync.catch_up(mesh))
        return Evaluator(cfg.eval, self.collector, cfg.run.seed, mesh, sync, self.judge)

    def make_dispatcher(self) -> Dispatcher | None:
        """Work by pull (`rollout.dispatch: pull`): the queue the replicas take
        groups from, sending to the running batch's endpoint where there is one;
        None for the static split."""
        cfg, policy, environment = self.cfg, self.policy, self.environment
        if cfg.rollout.dispatch != "pull":
            return None
        if type(self).rollout is not GRPO.rollout:  # DAPO's filter, distillation's teacher
            raise ConfigError(
                f"config key 'rollout.dispatch': pull hands each group to a free replica as "
                f"it completes, so {self.name}'s own `rollout` hook, which sees the whole "
                "step's batch, has no batch to see; use split"
            )
        if cfg.rollout.overprovision:  # the one setting whose samples depend on timing
            print(
                f"note: rollout.overprovision={cfg.rollout.overprovision}: which groups a "
                "step trains on depends on which complete first, so this run does not repeat "
                "bit for bit (docs/reliability.md)",
                flush=True,
            )
        sampler = self.stream or policy
        return Dispatcher(
            cfg.rollout,
            self.collector,
            policy,
            environment,
            send=lambda i, ids, seeds, images: sampler.slice(procs=i).generate.call_one(
                ids, cfg.generation, seeds, images, record_batch=False
            ),
            score=lambda i, prompts, texts: environment.slice(procs=i).score.call_one(
                prompts, texts
            ),
        )

    # --- around a step ----------------------------------------------------------------

    def before_pull(self) -> None:
        """As a weight pull begins (`WeightSync.pull`): what was sent with the old
        weights is handed out first, so it is generated with the version it was
        drawn at: the pull queue's drawn groups, or each batch sent ahead."""
        if self.dispatcher is not None:
            self.dispatcher.hand_out()
        elif not self.task.multi_turn:
            for batch in self.state.ahead:
                self.collector.generated(batch)

    def settle(self) -> None:
        """Collect the work in flight (batches generated ahead, the rollout queue's
        calls, weight pulls): before a pool changes size."""
        for batch in self.state.ahead:
            self.collector.collect(batch)
        if self.dispatcher is not None:
            self.dispatcher.settle()
        self.sync.wait()

    def next_rollout(self) -> tuple[Completions, torch.Tensor, dict]:
        """This step's rollouts: the batch generated ahead, collected and scored
        (`rollout`), or by pull the first complete groups of the queue."""
        if self.dispatcher is not None:
            return self.dispatcher.step(self.cfg.prompts_per_step)
        return self.rollout(self.state.ahead.pop(0))

    def old_logprobs(self, batch: TrainBatch) -> dict[str, float]:
        """When `trainer.recompute_old_logprobs` is on: the trainer's own log-probs
        of `batch`, taken before its first optimizer step, become the old ones
        (rows split over the trainer's procs), the sampler's move to
        `batch.sampler_logprobs`, and `trainer.correction` weighs each token for
        the mismatch between the two. Returns the `sampling/` figures."""
        cfg = self.cfg
        if not cfg.recompute_old_logprobs:
            return {}
        with self.log.timer("old_logprobs"):
            trainer_logprobs = self.sup.call_rows(self.trainer, "logprobs", batch)
        batch.sampler_logprobs, batch.old_logprobs = batch.old_logprobs, trainer_logprobs
        batch.weights = mismatch_weights(
            batch.old_logprobs,
            batch.sampler_logprobs,
            batch.completion_mask,
            cfg.trainer.correction,
            *cfg.trainer.correction_band(),
        )
        # Partial rollouts: each token's version is known, so the mismatch is also
        # given by lag (how far the trainer has moved since the token's version).
        lags = None
        if batch.token_versions is not None:
            lags = token_lags(batch.token_versions, self.sync.published, self.sync.published_at)
        return mismatch_metrics(
            batch.old_logprobs,
            batch.sampler_logprobs,
            batch.completion_mask,
            batch.weights,
            lags,
        )

    def minibatches(self, batch_size: int) -> list[torch.Tensor | slice]:
        """Row indices of each optimizer step: `epochs` shuffled passes cut into
        `minibatches` parts (one pass over the batch in order when both are 1)."""
        cfg = self.cfg
        if cfg.epochs == 1 and cfg.minibatches == 1:
            return [slice(None)]
        size = batch_size // cfg.minibatches
        parts = []
        for _ in range(cfg.epochs):
            order = torch.randperm(batch_size, generator=self.state.torch_rng)
            parts += [order[i * size : (i + 1) * size] for i in range(cfg.minibatches)]
        return parts

    def newest_checkpoint(self) -> str | None:
        return self.ckpt.latest() if self.cfg.checkpoint.every else None

    def record_samples(self, step: int, completions: Any, rewards: Any, advantages: Any) -> None:
        """The step's samples in samples.jsonl, every `run.samples_every` steps."""
        if self.cfg.run.samples_every and step % self.cfg.run.samples_every == 0:
            prompts, texts = decode(self.tokenizer, completions)
            mask = completions.completion_mask
            self.log.samples(step, prompts, texts, rewards, advantages, mask)

    def accounting(self, trained: int) -> dict:
        """The step's sample ledger and the run's fault counters."""
        return {
            **self.state.ledger.count_step(trained, DROP_REASONS, REDO_REASONS),
            **self.sup.metrics(),
            **self.scaler.metrics(),
            "samples/skipped_overlong_prompts": self.state.counters["skipped_prompts"],
        }

    def record_step(self, step: int, metrics: dict) -> None:
        """The `after_step` hook, then the held-out evaluation (`eval:`) when one is
        due, on the replicas now idle, and what generation sent ahead recorded;
        then the record."""
        self.after_step(step, metrics)
        if self.evaluator is not None:
            metrics.update(self.evaluator.after_step(step, self.cfg.steps - 1, self.sync.handle))
        for batch in self.state.ahead:  # generation sent ahead (`max_staleness`): what
            self.collector.ended(batch)  # it records lands in this step's record, every run
        self.log.step(metrics)

    # --- hooks: override one of these for a variant ---------------------------------

    def rollout(self, batch: Batch) -> tuple[Completions, torch.Tensor, dict]:
        """This step's batch (`prompts_per_step` prompts x `group_size`, its
        generation sent by the loop, or its episodes still to play), collected
        and scored. Not run under work by pull, whose groups are collected one
        by one as they complete (`make_dispatcher` refuses an override).

        Returns completions [B = prompts x group], rewards [B] and metrics to log.
        """
        return self.collector.finish(batch)

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
        """[B] rewards -> [B, T] advantages, one per completion token and 0 off the
        mask, in every algorithm (`per_token` spreads one a sequence); nothing in
        `batch` changes. GRPO's: each row's group-normalized reward.

        `batch` holds the completions, their mask, the sampler's log-probs and,
        when a reference runs, `ref_logprobs` (with a critic, `old_values`).
        """
        cfg = self.cfg
        advantages = group_advantages(rewards, cfg.group_size, scale=cfg.advantage_scale)
        return per_token(advantages, batch.completion_mask)


if __name__ == "__main__":
    run_main(GRPO, GRPOConfig)
