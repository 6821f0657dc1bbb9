"""What every algorithm's controller shares: its config core, the meshes it
spawns, and the calls its loop makes (generate and score, train, sync weights,
reference log-probs, warm-start, save, stop).

An algorithm subclasses `Algorithm` and writes its own `run()`: the loop a
reader follows top to bottom (see grpo.py, ppo.py, dpo.py). Nothing here
decides what is trained on; that is the algorithm's.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import random
import signal
import sys
import time
import traceback
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from meshrl import checkpoint
from meshrl.checkpoint import CheckpointConfig
from meshrl.config import (
    ConfigError,
    GenerationConfig,
    ModelConfig,
    OptimConfig,
    PlacementConfig,
    PolicyConfig,
    RewardModelConfig,
    RunConfig,
    TaskConfig,
    WarmStartConfig,
    check_lora_placement,
    parse_cli,
    save_config,
)
from meshrl.engines import vllm_missing
from meshrl.envs import make_task
from meshrl.faults import FaultsConfig
from meshrl.job import JobConfig
from meshrl.mesh import (
    RemoteCallError,
    RoleMeshes,
    call_all,
    call_each,
    gather,
    split,
    start_each,
    wait,
)
from meshrl.metrics import RunLogger, make_run_dir
from meshrl.models import context_length, load_tokenizer
from meshrl.rollout import ChatFormat, run_episodes, to_completions
from meshrl.status import StatusFile
from meshrl.status import table as status_table
from meshrl.types import Completions, Prompt, TrainBatch
from meshrl.weights import SHM_DIR, WeightHandle, rdma_backend

logger = logging.getLogger(__name__)


@dataclass
class RLConfig:
    """Keys shared by the on-policy algorithms (GRPO and its variants, PPO)."""

    steps: int = 200
    """RL steps: one batch of rollouts each."""
    prompts_per_step: int = 16
    """Distinct prompts per step."""
    group_size: int = 8
    """Completions sampled per prompt."""
    epochs: int = 1
    """Passes over each batch of rollouts."""
    minibatches: int = 1
    """Optimizer steps per pass: the batch is cut into this many shuffled parts."""
    kl_coef: float = 0.0
    """Weight of the KL to the reference model; 0 spawns no reference."""
    kl_kind: str = "k3"
    """KL estimator: k1, k2 or k3 (meshrl.losses.kl_estimate)."""
    max_staleness: int = 0
    """Weight versions generation may run ahead of training: the batches of steps
    s+1..s+k are generated while step s trains. 0 is the synchronous on-policy loop."""
    model: ModelConfig = field(default_factory=ModelConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    run: RunConfig = field(default_factory=RunConfig)
    job: JobConfig = field(default_factory=JobConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)

    min_group_size = 1

    def validate(self) -> None:
        for section in (
            self.model,
            self.generation,
            self.policy,
            self.reward_model,
            self.optim,
            self.placement,
            self.task,
            self.warm_start,
            self.run,
            self.job,
            self.checkpoint,
            self.faults,
        ):
            section.validate()
        for key in ("steps", "prompts_per_step", "epochs", "minibatches"):
            if getattr(self, key) < 1:
                raise ConfigError(f"config key '{key}': must be >= 1")
        if self.group_size < self.min_group_size:
            raise ConfigError(
                f"config key 'group_size': must be >= {self.min_group_size} "
                "(advantages compare completions of one prompt)"
            )
        if self.kl_kind not in ("k1", "k2", "k3"):
            raise ConfigError(f"config key 'kl_kind': '{self.kl_kind}' is not one of k1, k2, k3")
        if self.kl_coef < 0:
            raise ConfigError("config key 'kl_coef': must be >= 0")
        if self.max_staleness < 0:
            raise ConfigError("config key 'max_staleness': must be >= 0")
        check_lora_placement(self.model, self.placement)
        if self.max_staleness and make_task(self.task).multi_turn:
            raise ConfigError(
                f"config key 'max_staleness': multi-turn episodes ({self.task.name}) "
                "run with max_staleness=0"
            )
        if self.policy.engine == "vllm" and self.job.kind in ("local", "process"):
            missing = vllm_missing()  # the replicas run on this machine: say so now
            if missing:
                raise ConfigError(f"config key 'policy.engine': {missing}")
        batch = self.prompts_per_step * self.group_size
        for role in ("policy", "reference", "trainer"):
            if batch % self.ranks(role):
                raise ConfigError(
                    f"config key 'placement.{role}': {batch} completions per step "
                    f"do not split evenly over {self.ranks(role)} procs"
                )
        if batch % (self.minibatches * self.ranks("trainer")):
            raise ConfigError(
                f"config key 'minibatches': {batch} completions per step do not split into "
                f"{self.minibatches} minibatches x {self.ranks('trainer')} trainer procs"
            )

    def ranks(self, role: str) -> int:
        """Procs of a role over all its hosts."""
        if role == "policy" and self.placement.colocate:
            return self.ranks("trainer")
        return getattr(self.placement, role) * self.job.hosts_for(role)

    @property
    def total_updates(self) -> int:
        """Optimizer steps over the whole run (for the learning-rate schedule)."""
        return self.steps * self.epochs * self.minibatches


@dataclass
class PendingBatch:
    """One step's generation: sent to the policy replicas, collected later."""

    prompts: list[Prompt]
    group: list[Prompt]  # each prompt group_size times
    args: list[tuple]  # per replica: (prompt ids, generation config)
    futures: list | None
    respawns: int  # policy mesh replacements when it was sent
    published: int  # weight versions published when it was sent
    started: float
    completions: Completions | None = None
    lost: int = 0


class Algorithm:
    """Meshes, actors and the calls an algorithm's loop makes."""

    name = "algorithm"
    headline = "reward/mean"

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.meshes: RoleMeshes | None = None
        self.logger: RunLogger | None = None
        self.status: StatusFile | None = None

    def __getstate__(self) -> dict:
        # The algorithm travels to the trainer procs so that its `loss` hook runs
        # there; only the config goes with it, never the mesh handles.
        return {"cfg": self.cfg, "meshes": None, "logger": None, "status": None}

    def run(self) -> list[dict]:
        raise NotImplementedError

    def loss(self, logprobs: torch.Tensor, batch: TrainBatch) -> tuple[torch.Tensor, dict]:
        """Runs on every trainer proc: [B, T] log-probs of the batch -> (loss, metrics)."""
        raise NotImplementedError

    # --- meshes and actors ------------------------------------------------------------

    def roles(self) -> dict[str, int]:
        """Procs per role to spawn."""
        cfg = self.cfg
        counts = {
            "policy": cfg.placement.policy,
            "trainer": cfg.placement.trainer,
            "environment": cfg.placement.environment,
        }
        if cfg.kl_coef > 0:
            counts["reference"] = cfg.placement.reference
        if cfg.reward_model.path:
            counts["reward_model"] = cfg.placement.reward_model
        if cfg.placement.colocate:
            del counts["policy"]  # in the trainer's procs (`shared_roles`)
        return counts

    def busy_together(self) -> list[tuple[str, ...]]:
        """Groups of roles whose procs compute at the same time: the loop runs one
        role at a time, and with `max_staleness > 0` generation runs while the
        trainer trains. A host's cores are shared over the largest group."""
        groups = [(role,) for role in self.roles()]
        if getattr(self.cfg, "max_staleness", 0):
            groups.append(("policy", "trainer"))
        return groups

    def shared_roles(self) -> dict[str, str]:
        """Roles that run in another role's procs (`placement.colocate`)."""
        placement = getattr(self.cfg, "placement", None)
        return {"policy": "trainer"} if placement is not None and placement.colocate else {}

    def setup(self) -> None:
        """Run directory, meshes and actors."""
        cfg = self.cfg
        self.resume_from = self.find_resume()
        if self.resume_from is None:
            self.run_dir = make_run_dir(cfg.run.dir, cfg.run.name, self.name)
        else:  # <run dir>/checkpoints/step_N
            self.run_dir = os.path.dirname(os.path.dirname(os.path.abspath(self.resume_from)))
        save_config(cfg, f"{self.run_dir}/config.yaml")
        self.prepare()
        self.meshes = RoleMeshes(
            self.roles(),
            cfg.job,
            threads_per_proc=cfg.placement.threads_per_proc or None,
            share=self.shared_roles(),
            busy_together=self.busy_together(),
        )
        try:
            self.spawn_actors()
        except BaseException:
            self.shutdown()
            raise
        self.status = StatusFile(self.run_dir, self.meshes.status, cfg.run.status_every_s)
        self.status.start()

    def prepare(self) -> None:
        """The controller's own state: random generators, tokenizer, task, sample
        counts (no process is spawned)."""
        cfg = self.cfg
        self.timeout_s = cfg.run.call_timeout_s
        self.rng = random.Random(cfg.run.seed)
        self.torch_rng = torch.Generator().manual_seed(cfg.run.seed)
        self.totals: Counter = Counter()  # samples generated, trained, dropped by reason
        self.pending: list[PendingBatch] = []  # generation under way for the next steps
        self.published = 0  # weight versions published so far
        self.respawns: Counter = Counter()  # mesh replacements per role
        self.pulls: Any = None  # replicas' pulls of the newest version, not yet waited for
        self.sync_paths: list[str] = []
        self.tokenizer = load_tokenizer(cfg.model)
        self.format = ChatFormat(self.tokenizer)  # the chat template, when it has one
        self.task = make_task(cfg.task) if hasattr(cfg, "task") else None
        self.context = context_length(cfg.model)
        # Shared-memory weight files of this run's trainers, removed at shutdown.
        self.shm_prefix = f"meshrl-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def find_resume(self) -> str | None:
        """The checkpoint to continue from, per `checkpoint.resume`, or None."""
        resume = getattr(self.cfg, "checkpoint", CheckpointConfig()).resume
        if resume != "auto":
            return resume or None
        if not self.cfg.run.name:
            raise ConfigError("config key 'checkpoint.resume': 'auto' needs run.name (the run)")
        return checkpoint.latest(os.path.join(self.cfg.run.dir, self.cfg.run.name))

    def spawn_actors(self) -> None:
        """One actor per proc of each role's mesh."""
        for role in self.meshes.roles:
            self.spawn_role(role)

    def spawn_role(self, role: str) -> None:
        """The actors of one role (again after its mesh is replaced)."""
        from actors.environment import Environment
        from actors.policy import Policy
        from actors.reference import Reference

        cfg, seed = self.cfg, self.cfg.run.seed
        if role == "trainer":
            self.spawn_trainer(cfg.total_updates, cfg.generation.temperature)
        elif role == "policy":
            self.policy = self.meshes.spawn(
                "policy", "policy", Policy, cfg.model, seed, cfg.policy, self.context
            )
        elif role == "environment":
            self.environment = self.meshes.spawn(
                "environment", "environment", Environment, cfg.task, cfg.model
            )
        elif role == "reference":
            self.reference = self.meshes.spawn("reference", "reference", Reference, cfg.model, seed)
        elif role == "reward_model":
            from actors.reward_model import RewardModel

            self.reward_model = self.meshes.spawn(
                "reward_model", "reward_model", RewardModel, cfg.reward_model.path
            )

    def spawn_trainer(self, total_steps: int, temperature: float = 1.0) -> None:
        from actors.trainer import Trainer

        self.trainer = self.meshes.spawn(
            "trainer",
            "trainer",
            Trainer,
            self.cfg.model,
            self.cfg.optim,
            loss_fn=self.loss,  # this object's `loss` hook, run on the trainer procs
            total_steps=total_steps,
            temperature=temperature,
            seed=self.cfg.run.seed,
            master=self.meshes.rendezvous("trainer"),
            sharding=self.cfg.placement.sharding,
            shm_prefix=self.shm_prefix,
        )

    def start_logger(self, total_steps: int, first_step: int = 0) -> RunLogger:
        """metrics.jsonl and the progress bar; a resumed run keeps the records of
        the steps before `first_step` and drops any later ones. The loop starts
        next: from here Ctrl-C stops at the end of a step (`end_step`)."""
        StopRequest.loop_running = True
        self.meshes.report(self.timeout_s)  # actors' metrics from before the loop: not a step's
        self.logger = RunLogger(
            self.run_dir,
            total_steps,
            progress=self.cfg.run.progress,
            desc=self.name,
            headline=self.headline,
            first_step=first_step,
            sinks=tuple(self.cfg.run.sinks),
        )
        return self.logger

    def log_step(self, metrics: dict) -> None:
        """Record one step: the loop's `metrics` and what every actor recorded
        since the last step (`meshrl.telemetry.record`, reduced across the
        meshes) go to metrics.jsonl and the sinks; each proc's state to
        status.json."""
        recorded, procs = self.meshes.report(self.timeout_s)
        self.status.write(procs, step=metrics.get("step"))
        self.logger.log({**recorded, **metrics})

    def mesh_status(self, timeout_s: float = 15.0, show: bool = True) -> list[dict]:
        """Ask every proc of every mesh now: its actors, their weight versions, the
        endpoint under way, the last call; a proc that is gone shows as dead.
        Prints the table (`show`) and returns one dict per proc."""
        procs = self.meshes.status(timeout_s)
        if show:
            print(status_table(procs))
        return procs

    # --- start, checkpoints, resume ---------------------------------------------------

    def start(self) -> int:
        """Bring every role to the state the loop starts from; returns the first step.

        Fresh: version 0 to every replica, the warm-start, the reference's copy.
        Resumed: every role's state from the checkpoint.
        """
        if self.resume_from is not None:
            step = self.restore(self.resume_from)
            print(f"resumed from {self.resume_from} at step {step}", flush=True)
            return step
        self.sync_weights()  # version 0: every replica starts from the trainer's weights
        if self.cfg.warm_start.steps:
            self.warm_start()
        if "reference" in self.meshes:
            self.load_reference()
        return 0

    def stateful_roles(self) -> list[str]:
        """Roles whose state a checkpoint writes with their `save_state` endpoint."""
        return [r for r in ("trainer", "reference", "critic") if r in self.meshes]

    def each_stateful_role(self, endpoint: str, directory: str) -> None:
        """`save_state` / `load_state` on every proc of each stateful role, with
        the checkpoint `directory` (each role's part is `<role>.pt`, and a
        sharded trainer's shards `trainer_shards/`)."""
        for role in self.stateful_roles():
            call_all(
                getattr(self, role),
                endpoint,
                directory,
                what=f"{role}.{endpoint}",
                timeout_s=self.timeout_s,
            )

    checkpointed_at = -1

    def end_step(self, steps_done: int) -> None:
        """Called by the loop after each step: writes a checkpoint every
        `checkpoint.every` steps, and stops the run when Ctrl-C or SIGTERM asked
        for it (`StopRequest`), with a checkpoint first if one is due: checkpoints
        are on and this step has none yet."""
        ck = getattr(self.cfg, "checkpoint", None)
        stop = StopRequest.requested
        due = ck is not None and ck.every and (steps_done % ck.every == 0 or stop)
        if due and self.checkpointed_at != steps_done:
            self.write_checkpoint(steps_done)
        if stop:
            saved = f"; checkpoint {checkpoint.latest(self.run_dir)}" if ck and ck.every else ""
            raise KeyboardInterrupt(f"stopped after {steps_done} steps{saved}")

    def write_checkpoint(self, steps_done: int) -> None:
        """Every stateful role's part and the controller's, then the atomic commit.
        A part that cannot be written (full disk, unwritable directory) stops the
        run with one line; the previous checkpoint stays the newest valid one."""
        # Generation under way for the next steps is part of the state: collected
        # now and saved, so a resumed run trains on exactly these samples.
        pending = [
            (b.prompts, self.finish_generation(b)[0], self.published - b.published)
            for b in self.pending
        ]
        try:
            partial = checkpoint.begin(self.run_dir, steps_done)
            self.each_stateful_role("save_state", partial)
            policy_rng = call_all(
                self.policy, "rng_state", what="policy.rng_state", timeout_s=self.timeout_s
            )
            checkpoint.save_state(
                f"{partial}/controller.pt",
                step=steps_done,
                rng=self.rng.getstate(),
                torch_rng=self.torch_rng.get_state(),
                policy_rng=policy_rng,
                totals=dict(self.totals),
                pending=pending,
            )
            checkpoint.commit(partial, self.cfg.checkpoint.keep)
        except (OSError, RemoteCallError) as error:
            if isinstance(error, RemoteCallError) and error.proc_lost:
                raise
            raise checkpoint.CheckpointError(
                f"checkpoint after step {steps_done} could not be written: {one_line(error)} "
                f"(newest valid checkpoint: {checkpoint.latest(self.run_dir)})"
            ) from error
        self.checkpointed_at = steps_done

    def restore(self, path: str, totals: bool = True) -> int:
        """Every role's state from the checkpoint at `path`; returns its step.
        `totals`: also the sample counts (a resumed run; a rewind inside the
        run keeps counting what really happened)."""
        self.each_stateful_role("load_state", path)
        self.sync_weights()  # the replicas take the restored trainer's weights
        state = torch.load(f"{path}/controller.pt", weights_only=False)
        if len(state["policy_rng"]) != self.meshes.size("policy"):
            raise ConfigError(
                f"config key 'placement.policy': the checkpoint {path} has "
                f"{len(state['policy_rng'])} policy replicas"
            )
        self.rng.setstate(state["rng"])
        self.torch_rng.set_state(state["torch_rng"])
        if totals:
            self.totals = Counter(state.get("totals", {}))
        self.pending = []
        for prompts, completions, behind in state.get("pending", []):
            batch = self.start_generation(prompts, send=False)
            batch.completions, batch.published = completions, self.published - behind
            self.pending.append(batch)
            if not totals:  # a rewind trains these again: counted as generated again
                self.totals["generated"] += len(batch.group)
        call_each(
            self.policy,
            "set_rng_state",
            [(s,) for s in state["policy_rng"]],
            "policy.set_rng_state",
            self.timeout_s,
        )
        self.checkpointed_at = state["step"]
        return state["step"]

    # --- rollouts ---------------------------------------------------------------------

    skipped_prompts = 0

    def sample_prompts(self, num_prompts: int) -> list[Prompt]:
        """`num_prompts` prompts from the task that fit the model's context with
        `generation.max_new_tokens` to spare. A prompt that does not is skipped
        and another drawn (`samples/skipped_overlong_prompts`), or is an error
        (`generation.overlong_prompt=error`)."""
        room = self.context - self.cfg.generation.max_new_tokens
        prompts: list[Prompt] = []
        for _ in range(100):  # draws of a batch, before concluding nothing fits
            drawn = self.task.sample(num_prompts - len(prompts), self.rng)
            lengths = map(len, self.format.prompts([p.text for p in drawn]))  # one batch call
            for prompt, length in zip(drawn, lengths, strict=True):
                if length <= room:
                    prompts.append(prompt)
                    continue
                message = (
                    f"a prompt of {length} tokens does not fit the model's context of "
                    f"{self.context} with generation.max_new_tokens="
                    f"{self.cfg.generation.max_new_tokens}: {prompt.text[:40]!r}"
                )
                if self.cfg.generation.overlong_prompt == "error":
                    raise PromptTooLong(f"{message} (generation.overlong_prompt=skip skips it)")
                self.skipped_prompts += 1
            if len(prompts) == num_prompts:
                return prompts
        raise PromptTooLong(f"no prompt fits: {message}")

    def next_rollout(self) -> tuple[Completions, torch.Tensor, dict]:
        """The next step's batch, scored, with the generation of the `max_staleness`
        batches after it under way (in order, so prompts and sampling streams are
        those of the synchronous loop). A batch generated more than
        `max_staleness` weight versions ago is dropped (`samples/dropped_stale`)
        and generated again."""
        if self.task.multi_turn:
            return self.play(self.sample_prompts(self.cfg.prompts_per_step))
        k = getattr(self.cfg, "max_staleness", 0)
        while len(self.pending) <= k:
            self.pending.append(
                self.start_generation(self.sample_prompts(self.cfg.prompts_per_step))
            )
        batch = self.pending.pop(0)
        completions, info = self.finish_generation(batch)
        staleness = self.published - batch.published
        if staleness > k:
            self.totals["dropped_stale"] += len(batch.group)
            info["samples/dropped_stale"] = len(batch.group)
            batch = self.start_generation(batch.prompts)
            completions, _ = self.finish_generation(batch)
            staleness = 0
        info["weights/staleness"] = staleness
        return self.score(batch, completions, info)

    def generate_and_score(self, prompts: list[Prompt]) -> tuple[Completions, torch.Tensor, dict]:
        """`group_size` completions per prompt, generated now and scored (the
        synchronous path; DAPO's sampling rounds use it)."""
        if self.task.multi_turn:
            return self.play(prompts)
        batch = self.start_generation(prompts)
        completions, info = self.finish_generation(batch)
        return self.score(batch, completions, info)

    def start_generation(self, prompts: list[Prompt], send: bool = True) -> PendingBatch:
        """Send `group_size` completions per prompt to the policy replicas (split
        evenly); `finish_generation` collects them. `send=False`: only the batch's
        layout (its completions come from elsewhere: a checkpoint)."""
        k = self.cfg.group_size
        group = [p for p in prompts for _ in range(k)]
        ids = [i for i in self.format.prompts([p.text for p in prompts]) for _ in range(k)]
        shards = split(ids, self.meshes.size("policy"))
        args = [(s, self.cfg.generation) for s in shards]
        return PendingBatch(
            prompts,
            group,
            args,
            start_each(self.policy, "generate", args) if send else None,
            self.respawns["policy"],
            self.published,
            time.perf_counter(),
        )

    def finish_generation(self, batch: PendingBatch) -> tuple[Completions, dict]:
        """Collect a batch's completions. A policy proc that dies is replaced
        (`recover`) and a call that raised may be retried (`retry_error`): the
        generation is done again, the completions of the failed call counted in
        `samples/dropped_policy_lost`."""
        if batch.completions is None:
            parts, repeats = self.call_recovering(
                "policy", "generate", batch.args, (batch.futures, batch.respawns)
            )
            lost = repeats * len(batch.group)  # generated by the failed call on every replica
            self.totals["generated"] += len(batch.group) + lost
            self.totals["dropped_policy_lost"] += lost
            batch.completions = Completions.concat(parts, self.tokenizer.pad_token_id)
            batch.lost = lost
        return batch.completions, {
            "time/generate_s": time.perf_counter() - batch.started,
            "samples/dropped_policy_lost": batch.lost,
        }

    def score(
        self, batch: PendingBatch, completions: Completions, info: dict
    ) -> tuple[Completions, torch.Tensor, dict]:
        """Rewards of a batch's completions from the environment mesh. Scoring that
        failed (a lost environment proc, a retried error) is done again on the
        same completions: nothing is lost."""
        scored = time.perf_counter()
        env_shards = zip(
            split(batch.group, self.meshes.size("environment")),
            split(completions.completion_lists(), self.meshes.size("environment")),
            strict=True,
        )
        scores, _ = self.call_recovering("environment", "score", list(env_shards))
        rewards = torch.tensor([r for part, _ in scores for r in part])
        failures, offset = {}, 0
        for part, failed in scores:
            failures.update({offset + row: reason for row, reason in failed.items()})
            offset += len(part)
        if failures:  # those groups go; new prompts take their place
            completions, rewards = self.refill(completions, rewards, failures, info)
        info["samples/dropped_stale"] = info.get("samples/dropped_stale", 0)
        completions, rewards, info = self.score_info(completions, rewards, info)
        info["time/score_s"] = time.perf_counter() - scored
        return completions, rewards, info

    max_refills = 3
    """Times in a row failed episodes' groups are sampled again before the run stops."""

    def refill(
        self, completions: Completions, rewards: torch.Tensor, failures: dict[int, str], info: dict
    ) -> tuple[Completions, torch.Tensor]:
        """Drop the groups of single-turn completions whose scoring failed (each
        reason logged, counted in `episodes/failed` and `samples/dropped_env_failed`)
        and score new prompts in their place."""
        k = self.cfg.group_size
        groups = sorted({row // k for row in failures})
        self.count_failures(list(failures.values()), len(groups) * k, info)
        keep = torch.tensor([r for r in range(len(rewards)) if r // k not in groups])
        self.refills = getattr(self, "refills", 0) + 1
        try:
            new, new_rewards, _ = self.generate_and_score(self.sample_prompts(len(groups)))
        finally:
            self.refills -= 1
        kept = completions.rows(keep)
        return (
            Completions.concat([kept, new], self.tokenizer.pad_token_id),
            torch.cat([rewards[keep], new_rewards]),
        )

    def count_failures(self, reasons: list[str], dropped: int, info: dict) -> None:
        if getattr(self, "refills", 0) >= self.max_refills:
            raise RuntimeError(
                f"environment: episodes failed in {self.max_refills} refills in a row; "
                f"the last: {reasons[-1]}"
            )
        for reason in reasons:
            logger.warning("episode failed: %s", reason)
        self.totals["dropped_env_failed"] += dropped
        self.totals["episodes_failed"] += len(reasons)
        info["episodes/failed"] = info.get("episodes/failed", 0) + len(reasons)
        info["samples/dropped_env_failed"] = info.get("samples/dropped_env_failed", 0) + dropped

    def play(self, prompts: list[Prompt]) -> tuple[Completions, torch.Tensor, dict]:
        """Multi-turn episodes (`meshrl.rollout`): `group_size` per prompt, the
        model's turns on the policy replicas and the environment's replies on
        the environment procs, interleaved. A group with a failed episode is
        dropped (counted, its reasons logged) and new prompts played instead."""
        k = self.cfg.group_size
        kept: list = []
        info: dict = {"samples/dropped_policy_lost": 0}
        started = time.perf_counter()
        for attempt in range(self.max_refills + 1):
            self.refills = attempt
            group = [p for p in prompts for _ in range(k)]
            episodes, timing = run_episodes(
                group,
                lambda role: getattr(self, role),
                self.meshes.size("policy"),
                self.meshes.size("environment"),
                self.format,
                self.cfg.generation,
                self.task.turns,
                self.context,
                self.timeout_s,
                on_lost=self.recover,
                key_prefix=f"{self.published}.{attempt}.",
            )
            self.totals["generated"] += len(episodes)
            failed = {i // k for i, e in enumerate(episodes) if e.failed}
            kept += [e for i, e in enumerate(episodes) if i // k not in failed]
            if not failed:
                break
            reasons = [e.failed for e in episodes if e.failed]
            self.count_failures(reasons, len(failed) * k, info)
            prompts = self.sample_prompts(len(failed))
        self.refills = 0
        completions, rewards = to_completions(kept, self.tokenizer.pad_token_id)
        mask, attention = completions.completion_mask, completions.attention
        info.update(
            {
                "time/generate_s": timing["time/episode_generate_s"],
                "time/episodes_s": time.perf_counter() - started,
                "episodes/turns_mean": sum(e.turns for e in kept) / len(kept),
                "episodes/truncated": sum(e.truncated for e in kept),
                "tokens/environment": int((attention - mask).sum().item()),
            }
        )
        self.last_episodes = kept
        return self.score_info(completions, rewards, info)

    def add_model_reward(self, completions: Completions, rewards: torch.Tensor, info: dict):
        """With `reward_model.path`: rule_weight x the environment's reward + weight x
        the reward model's score of prompt + completion (both logged)."""
        cfg = getattr(self.cfg, "reward_model", None)
        if cfg is None or not cfg.path or getattr(self, "refills", 0):
            return rewards  # (a refill's rows are scored with the whole batch)
        prompts, texts = self.decode(completions)
        n = self.meshes.size("reward_model")
        parts, _ = self.call_recovering(
            "reward_model",
            "score",
            [(chunk,) for chunk in split([p + t for p, t in zip(prompts, texts, strict=True)], n)],
        )
        model = torch.tensor([s for part in parts for s in part])
        info["reward/rule_mean"] = rewards.mean().item()
        info["reward/model_mean"] = model.mean().item()
        return cfg.rule_weight * rewards + cfg.weight * model

    def score_info(
        self, completions: Completions, rewards: torch.Tensor, info: dict
    ) -> tuple[Completions, torch.Tensor, dict]:
        """The reward model's part of the rewards (if any), and the step's sample
        accounting: every sample is trained on once or counted here, by reason."""
        rewards = self.add_model_reward(completions, rewards, info)
        rewound, self.dropped_on_rewind = self.dropped_on_rewind, 0
        dropped = (
            info["samples/dropped_policy_lost"]
            + rewound
            + info.get("samples/dropped_stale", 0)
            + info.get("samples/dropped_env_failed", 0)
        )
        return (
            completions,
            rewards,
            {
                **info,
                "samples/dropped": dropped,
                "samples/dropped_trainer_rewind": rewound,
                "faults/recoveries": len(self.recoveries),
            },
        )

    # --- faults -----------------------------------------------------------------------

    @property
    def fault_cfg(self) -> FaultsConfig:
        """The `faults:` section (defaults for an algorithm whose config has none)."""
        return getattr(self.cfg, "faults", None) or FaultsConfig()

    recoveries: list[str] = []
    errors_retried = 0
    nonfinite_steps = 0
    nonfinite_in_row = 0
    dropped_on_rewind = 0
    _drilled: frozenset = frozenset()

    def inject_faults(self, step: int) -> None:
        """Drills from the `faults:` config, each once (also when a recovery brings
        the loop back over the step): `kill` ends the named procs now, as a crash
        would; `raise_in` makes the named endpoint raise on its next call in
        every proc of the role."""
        faults = self.fault_cfg
        drills = [("kill", role, rank) for role, rank in faults.kills_at(step)]
        drills += [("raise", role, name) for role, name in faults.raises_at(step)]
        for kind, role, target in drills:
            if (kind, role, target, step) in self._drilled:
                continue
            self._drilled = self._drilled | {(kind, role, target, step)}
            if role not in self.meshes:
                raise ConfigError(f"config key 'faults': this run has no {role} mesh to drill")
            actors = getattr(self, role)
            if kind == "kill":
                actors.slice(procs=target).exit_now.call_one()  # never answers
                print(f"faults: killed {role}[{target}] at step {step}", flush=True)
            else:
                call_all(actors, "arm_error", target, what=f"{role}.arm_error", timeout_s=60)
                print(f"faults: {role}.{target} will raise at step {step}", flush=True)

    def retry_error(self, error: RemoteCallError, tries: int) -> None:
        """Re-raise `error` unless it is an exception raised in an actor (not a
        lost proc) and `faults.retry_errors` allows another try."""
        if error.proc_lost or tries >= self.fault_cfg.retry_errors:
            raise error
        self.errors_retried += 1
        print(f"retrying: {error}", flush=True)

    def call_recovering(
        self, role: str, endpoint: str, args_per_rank: list, started: tuple | None = None
    ) -> tuple[list, int]:
        """`call_each` on `role`. A lost proc has its mesh replaced (`recover`), an
        exception raised there is retried (`retry_error`); each time the call is
        made again. `started`: (futures, respawns) of the call already sent.
        Returns the results and the number of repeats."""
        what, repeats, errors = f"{role}.{endpoint}", 0, 0
        futures, respawns = started or (None, None)
        while True:
            try:
                if futures is None:
                    futures = start_each(getattr(self, role), endpoint, args_per_rank)
                    respawns = self.respawns[role]
                return gather(futures, what, self.timeout_s), repeats
            except RemoteCallError as error:
                futures = None
                if error.proc_lost:
                    if respawns == self.respawns[role]:  # else: replaced since it was sent
                        self.recover(role, error)
                else:
                    self.retry_error(error, errors)
                    errors += 1
                repeats += 1

    def rewind(self, step: int, error: RemoteCallError) -> int:
        """A trainer or critic proc died during `step`: replace its mesh, restore
        every role from the newest checkpoint and return its step, where the loop
        continues. The samples of the steps since are counted as dropped."""
        path = checkpoint.latest(self.run_dir)
        if error.role not in ("trainer", "critic") or not error.proc_lost or path is None:
            raise error  # not a lost proc, or no checkpoint (checkpoint.every = 0)
        if len(self.recoveries) >= self.fault_cfg.max_recoveries:
            raise error
        print(f"recovering {error.role} from {path}: {error}", flush=True)
        self.meshes.respawn(error.role)
        self.respawns[error.role] += 1
        self.spawn_role(error.role)
        for role, host in self.shared_roles().items():  # they died with its procs
            if host == error.role:
                self.respawns[role] += 1
                self.spawn_role(role)
        in_flight = self.drop_pending()  # generation for the steps being undone
        back_to = self.restore(path, totals=False)
        self.meshes.report(self.timeout_s)  # actors' metrics of the undone steps: no step's
        self.logger.rewind(back_to)
        batch = self.cfg.prompts_per_step * self.cfg.group_size
        # Steps back_to .. step-1 were trained and are undone; step's samples never were.
        self.totals["trained"] -= (step - back_to) * batch
        self.dropped_on_rewind = (step + 1 - back_to) * batch + in_flight
        self.totals["dropped_trainer_rewind"] += self.dropped_on_rewind
        self.recoveries = [*self.recoveries, f"{error.role}: {error}"]
        return back_to

    def recover(self, role: str, error: RemoteCallError) -> None:
        """Replace `role`'s mesh after one of its procs was lost and bring it to the
        current state: a policy replica takes the current weight version, a
        reference reloads its frozen weights from the newest checkpoint. Trainer
        and critic state lives only in them: those go through `rewind`."""
        if not error.proc_lost or role in ("trainer", "critic", *self.shared_roles()):
            raise error  # not a lost proc; or its state is restored by `rewind` only
        if len(self.recoveries) >= self.fault_cfg.max_recoveries:
            raise error
        saved = checkpoint.latest(self.run_dir)
        if role == "reference" and saved is None:
            raise RemoteCallError(
                f"{error} (a reference is recovered from a checkpoint: set checkpoint.every)",
                error.what,
            ) from error
        print(f"recovering {role}: {error}", flush=True)
        self.meshes.respawn(role)
        self.respawns[role] += 1
        self.spawn_role(role)
        if role == "policy":
            self.pull_weights()
        elif role == "reference":
            call_all(
                self.reference,
                "load_state",
                saved,
                what="reference.load_state",
                timeout_s=self.timeout_s,
            )
        self.recoveries = [*self.recoveries, f"{role}: {error}"]

    def guard_finite(self, step: int, train_metrics: dict) -> None:
        """Count a step whose trainer skipped an update for a NaN or infinite
        loss or gradient; `faults.max_nonfinite_steps` of them in a row stop the
        run (the newest checkpoint holds the last good state)."""
        skipped = any(
            train_metrics.get(key, 0) > 0
            for key in ("train/nonfinite_skipped", "value/nonfinite_skipped")
        )
        self.nonfinite_steps += skipped
        self.nonfinite_in_row = self.nonfinite_in_row + 1 if skipped else 0
        limit = self.fault_cfg.max_nonfinite_steps
        if self.nonfinite_in_row >= limit:
            newest = checkpoint.latest(self.run_dir) if self.cfg.checkpoint.every else None
            raise NonFiniteLoss(
                f"steps {step - limit + 1}..{step}: {limit} steps in a row had a NaN or "
                f"infinite loss or gradient and were skipped (faults.max_nonfinite_steps); "
                f"newest checkpoint: {newest}"
            )

    # --- sample accounting ------------------------------------------------------------

    def account(self, trained: int) -> dict:
        """Count `trained` samples of this step; the run's totals so far. Every
        sample generated is trained on once or dropped with its reason, so
        `generated_total == trained_total + dropped_total` after every step."""
        self.totals["trained"] += trained
        dropped = sum(v for k, v in self.totals.items() if k.startswith("dropped"))
        return {
            "samples/trained": trained,
            "samples/generated_total": self.totals["generated"],
            "samples/trained_total": self.totals["trained"],
            "samples/dropped_total": dropped,
            "faults/errors_retried": self.errors_retried,
            "faults/nonfinite_steps": self.nonfinite_steps,
            "samples/skipped_overlong_prompts": self.skipped_prompts,
        }

    def decode(self, completions: Completions) -> tuple[list[str], list[str]]:
        """The prompts' and the completions' texts (an episode's whole transcript)."""
        prompts = [
            ids[m.bool()].tolist()
            for ids, m in zip(completions.prompt_ids, completions.prompt_mask, strict=True)
        ]
        return (
            self.tokenizer.batch_decode(prompts, skip_special_tokens=True),
            self.tokenizer.batch_decode(completions.completion_lists(), skip_special_tokens=True),
        )

    def record_samples(self, step: int, completions: Completions, rewards, advantages) -> None:
        """Every `run.samples_every` steps: the step's prompts, completions, rewards
        and advantages (a per-token advantage as its mean) in samples.jsonl."""
        every = self.cfg.run.samples_every
        if not every or step % every:
            return
        prompts, texts = self.decode(completions)
        mask = completions.completion_mask
        if advantages.dim() == 2:
            advantages = (advantages * mask).sum(1) / mask.sum(1).clamp(min=1)
        self.logger.log_samples(
            step,
            [
                {"prompt": p, "completion": c, "reward": float(r), "advantage": float(a)}
                for p, c, r, a in zip(prompts, texts, rewards, advantages, strict=True)
            ],
            console=self.cfg.run.console_samples,
        )

    def rollout_metrics(self, rewards: torch.Tensor, completions: Completions) -> dict:
        """What every on-policy step logs about its rollouts."""
        mask = completions.completion_mask
        return {
            "reward/mean": rewards.mean().item(),
            "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
            "reward/max": rewards.max().item(),
            "tokens/generated": int(mask.sum().item()),
            "completion/mean_length": mask.sum(1).mean().item(),
            "weights/version": self.handle.version,
            "weights/shm_replicas": self.sync_paths.count("shm"),
            "weights/rdma_replicas": self.sync_paths.count("rdma"),
            "weights/generated_with": completions.weight_version,
        }

    # --- training ---------------------------------------------------------------------

    def train(self, batch: TrainBatch, endpoint: str = "train_step", *args) -> dict[str, float]:
        """One data-parallel call on the trainer mesh: each rank gets its shard
        of the batch; metrics averaged over ranks."""

        def start() -> list:
            return self.start_sharded("trainer", batch, endpoint, *args)

        return self.collect(start(), f"trainer.{endpoint}", again=start)

    def start_sharded(self, role: str, batch: TrainBatch, endpoint: str, *args) -> list:
        """Start `endpoint` on every proc of `role`'s mesh, each with its
        data-parallel shard of `batch` (rows i::n); returns the futures."""
        n = self.meshes.size(role)
        actors = getattr(self, role)
        return start_each(actors, endpoint, [(batch.shard(i, n), *args) for i in range(n)])

    def collect(self, futures: list, what: str, again: Any = None) -> dict[str, float]:
        """Wait for `start_sharded`'s calls; metrics averaged over the ranks. When
        the actors raised and `again` is given, `again()` starts the calls anew
        (`retry_error` decides whether)."""
        tries = 0
        while True:
            try:
                return mean_metrics(gather(futures, what, self.timeout_s))
            except RemoteCallError as error:
                if again is None:
                    raise
                self.retry_error(error, tries)
                tries += 1
                futures = again()

    def call_rows(self, role: str, endpoint: str, batch: TrainBatch, *args) -> torch.Tensor:
        """`endpoint` on contiguous row blocks of `batch` over `role`'s procs,
        results concatenated in row order (reference log-probs, critic values)."""
        n = self.meshes.size(role)
        size = len(batch) // n
        parts, _ = self.call_recovering(
            role,
            endpoint,
            [(batch.rows(slice(i * size, (i + 1) * size)), *args) for i in range(n)],
        )
        return torch.cat(parts)

    def minibatches(self, batch_size: int) -> list[torch.Tensor | slice]:
        """Row indices of each optimizer step: `epochs` shuffled passes cut into
        `minibatches` parts (one pass over the batch in order when both are 1)."""
        cfg = self.cfg
        if cfg.epochs == 1 and cfg.minibatches == 1:
            return [slice(None)]
        size = batch_size // cfg.minibatches
        parts = []
        for _ in range(cfg.epochs):
            order = torch.randperm(batch_size, generator=self.torch_rng)
            parts += [order[i * size : (i + 1) * size] for i in range(cfg.minibatches)]
        return parts

    def optimize(self, batch: TrainBatch) -> dict[str, float]:
        """Every optimizer step on one batch of rollouts; metrics averaged over them."""
        return step_metrics([self.train(batch.rows(rows)) for rows in self.minibatches(len(batch))])

    def sync_weights(self) -> None:
        """The trainer publishes its weights (every owning rank writes its part);
        every policy replica pulls them, from shared memory on the trainer's host
        and over RDMA elsewhere (`weights/shm_replicas`, `weights/rdma_replicas`).

        With `max_staleness > 0` the pulls are not waited for: each replica takes
        the version after the generation it is running, and the loop goes on.
        They are waited for before the next publish, which keeps the slot a
        replica may still read intact (`meshrl.weights`: double buffering)."""
        self.wait_pulls()
        self.handle = WeightHandle.merge(
            call_all(self.trainer, "publish", what="trainer.publish", timeout_s=self.timeout_s)
        )
        self.published += 1
        if "policy" not in self.meshes:
            return
        self.pulls = (self.policy.load_weights.call(self.handle), self.respawns["policy"])
        if not getattr(self.cfg, "max_staleness", 0):
            self.wait_pulls()

    def wait_pulls(self) -> None:
        """Wait until every replica serves the newest version; a replica lost on
        the way is replaced (and pulls it then)."""
        pulls, self.pulls = self.pulls, None
        if pulls is None:
            return
        future, respawns = pulls
        try:
            pulled = [v for _, v in wait(future, "policy.load_weights", self.timeout_s).items()]
        except RemoteCallError as error:
            if respawns == self.respawns["policy"]:  # else: replaced (and pulled) since
                self.recover("policy", error)  # the new replicas pull the newest version
            return
        assert {v for v, _ in pulled} == {self.handle.version}, f"replicas at {pulled}"
        self.sync_paths = [path for _, path in pulled]

    def pull_weights(self) -> None:
        """Every policy replica takes the current version (`self.handle`), now."""
        self.pulls = (self.policy.load_weights.call(self.handle), self.respawns["policy"])
        self.wait_pulls()

    def drop_pending(self) -> int:
        """Forget the generation under way for later steps (a rewind); returns
        its samples, counted as generated (and, by the caller, dropped)."""
        dropped = sum(len(batch.group) for batch in self.pending)
        self.totals["generated"] += dropped
        self.pending = []
        return dropped

    def load_reference(self) -> None:
        """The reference takes the weights RL starts from (the last published
        version) and keeps them."""
        call_all(
            self.reference,
            "load_weights",
            self.handle,
            what="reference.load_weights",
            timeout_s=self.timeout_s,
        )

    def reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, T] log-probs of the batch's completions under the reference."""
        return self.call_rows("reference", "logprobs", batch, self.cfg.generation.temperature)

    def warm_start(self) -> None:
        """Supervised steps on task demonstrations (logged to warm_start.jsonl),
        then a weight sync."""
        cfg, eos = self.cfg.warm_start, self.tokenizer.eos_token_id
        losses = []
        with open(f"{self.run_dir}/warm_start.jsonl", "w") as log:
            for step in range(cfg.steps):
                prompts = self.sample_prompts(cfg.batch_size)
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

    # --- the end ----------------------------------------------------------------------

    def finish(self) -> None:
        """Save the model, draw the headline curve, print the summary."""
        self.logger.close()
        if self.cfg.run.save_final:
            wait(self.trainer.save.call(f"{self.run_dir}/final"), "trainer.save", self.timeout_s)
        self.logger.plot_reward(f"{self.headline.split('/')[0]}.png")  # reward.png, eval.png
        print(
            f"{self.name}: {self.logger.summary()} | weights over RDMA ({rdma_backend()})",
            flush=True,
        )

    def shutdown(self) -> None:
        """Stop every proc this run spawned (safe to call twice)."""
        StopRequest.loop_running = StopRequest.requested = False
        if self.status is not None:
            self.status.stop()  # before the meshes go: it asks their procs
        if self.logger is not None:
            self.logger.close()
        if self.meshes is not None:
            self.meshes.stop()
        # A proc that was killed could not remove its shared-memory files.
        for path in glob.glob(f"{SHM_DIR}/{getattr(self, 'shm_prefix', None)}-*"):
            os.unlink(path)


class PromptTooLong(ValueError):
    """A prompt does not fit the model's context; one line."""


class NonFiniteLoss(RuntimeError):
    """Too many steps in a row with a NaN or infinite loss; one line."""


def mean_metrics(records: list[dict[str, float]]) -> dict[str, float]:
    """Each key's mean over `records` (ranks of a mesh, optimizer steps of a batch)."""
    return {key: sum(r[key] for r in records) / len(records) for key in records[0]}


def step_metrics(optimizer_steps: list[dict[str, float]]) -> dict[str, float]:
    """The metrics of one RL step's optimizer steps: means, except `sampling/`
    keys, taken from the first step (before the batch moved the weights)."""
    merged = mean_metrics(optimizer_steps)
    merged.update({k: v for k, v in optimizer_steps[0].items() if k.startswith("sampling/")})
    return merged


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
    return TrainBatch(ids, mask, completion_mask, torch.zeros_like(completion_mask))


class StopRequest:
    """Ctrl-C and SIGTERM in a command-line run (`main`).

    While a loop is stepping (`Algorithm.stepping`), the first signal asks it to
    stop at the end of the step: `Algorithm.end_step` then writes a
    checkpoint if one is due and stops the run. Outside the loop (spawning,
    warm-start), or on a second signal, the run stops at once.
    """

    requested = False
    loop_running = False

    @classmethod
    def handle(cls, signum: int, frame: Any) -> None:
        if cls.loop_running and not cls.requested:
            cls.requested = True
            print(
                f"\n{signal.Signals(signum).name}: stopping at the end of this step "
                "(again to stop at once)",
                file=sys.stderr,
                flush=True,
            )
            return
        raise KeyboardInterrupt


def one_line(error: BaseException) -> str:
    """The error as one line: its own message for meshrl's errors (which name the
    key, file or call), else its type and first line."""
    if isinstance(error, (ConfigError, RemoteCallError, OSError)):
        return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def main(algorithm: type[Algorithm], schema: type, argv: list[str] | None = None) -> int:
    """`python -m algorithms.X --config FILE key=value ... [--debug]` for any algorithm.

    A failure prints one line, `error: ...`; `--debug` (or MESHRL_DEBUG=1) adds
    the full traceback, the remote one included.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("MESHRL_DEBUG", "") not in ("", "0")
    cfg = parse_cli(schema, [a for a in args if a != "--debug"])
    # A scheduler's SIGTERM (preemption, scancel) stops the run like Ctrl-C.
    signal.signal(signal.SIGTERM, StopRequest.handle)
    signal.signal(signal.SIGINT, StopRequest.handle)
    try:
        algorithm(cfg).run()
    except KeyboardInterrupt as stop:
        if debug:
            traceback.print_exc()
        print(f"interrupted: {stop or 'every proc stopped'}", file=sys.stderr)
        return 130
    except Exception as error:  # noqa: BLE001 - the CLI's last word: one line, not a wall
        if debug:
            traceback.print_exc()
        print(f"error: {one_line(error)}", file=sys.stderr)
        if not debug:
            print("(run again with --debug for the full traceback)", file=sys.stderr)
        return 2 if isinstance(error, ConfigError) else 1
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return 0
