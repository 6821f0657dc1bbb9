"""What every algorithm's controller shares: its config core, the meshes it
spawns, and the calls its loop makes (generate and score, train, sync weights,
reference log-probs, warm-start, save, stop).

An algorithm subclasses `Algorithm` and writes its own `run()`: the loop a
reader follows top to bottom (see grpo.py, ppo.py, dpo.py). Nothing here
decides what is trained on; that is the algorithm's.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
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
    RunConfig,
    TaskConfig,
    WarmStartConfig,
    parse_cli,
    save_config,
)
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
from meshrl.models import load_tokenizer
from meshrl.types import Completions, Prompt, TrainBatch
from meshrl.weights import rdma_backend


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
    model: ModelConfig = field(default_factory=ModelConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
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
        return getattr(self.placement, role) * self.job.hosts_for(role)

    @property
    def total_updates(self) -> int:
        """Optimizer steps over the whole run (for the learning-rate schedule)."""
        return self.steps * self.epochs * self.minibatches


class Algorithm:
    """Meshes, actors and the calls an algorithm's loop makes."""

    name = "algorithm"
    headline = "reward/mean"

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.meshes: RoleMeshes | None = None
        self.logger: RunLogger | None = None

    def __getstate__(self) -> dict:
        # The algorithm travels to the trainer procs so that its `loss` hook runs
        # there; only the config goes with it, never the mesh handles.
        return {"cfg": self.cfg, "meshes": None, "logger": None}

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
        return counts

    def setup(self) -> None:
        """Run directory, meshes and actors."""
        cfg = self.cfg
        self.resume_from = self.find_resume()
        if self.resume_from is None:
            self.run_dir = make_run_dir(cfg.run.dir, cfg.run.name, self.name)
        else:  # <run dir>/checkpoints/step_N
            self.run_dir = os.path.dirname(os.path.dirname(os.path.abspath(self.resume_from)))
        save_config(cfg, f"{self.run_dir}/config.yaml")
        self.timeout_s = cfg.run.call_timeout_s
        self.rng = random.Random(cfg.run.seed)
        self.torch_rng = torch.Generator().manual_seed(cfg.run.seed)
        self.tokenizer = load_tokenizer(cfg.model)
        self.meshes = RoleMeshes(self.roles(), cfg.job)
        try:
            self.spawn_actors()
        except BaseException:
            self.shutdown()
            raise

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
        self.task = make_task(self.cfg.task)
        for role in self.meshes.meshes:
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
            self.policy = self.meshes.spawn("policy", "policy", Policy, cfg.model, seed)
        elif role == "environment":
            self.environment = self.meshes.spawn(
                "environment", "environment", Environment, cfg.task, cfg.model
            )
        elif role == "reference":
            self.reference = self.meshes.spawn("reference", "reference", Reference, cfg.model, seed)

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
        )

    def start_logger(self, total_steps: int, first_step: int = 0) -> RunLogger:
        """metrics.jsonl and the progress bar; a resumed run keeps the records of
        the steps before `first_step` and drops any later ones."""
        self.logger = RunLogger(
            self.run_dir,
            total_steps,
            progress=self.cfg.run.progress,
            desc=self.name,
            headline=self.headline,
            first_step=first_step,
        )
        return self.logger

    # --- start, checkpoints, resume ---------------------------------------------------

    def start(self) -> int:
        """Bring every role to the state the loop starts from; returns the first step.

        Fresh: version 0 to every replica, the warm-start, the reference's copy.
        Resumed: every role's state from the checkpoint.
        """
        if self.resume_from is not None:
            return self.restore(self.resume_from)
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
        its part's path in the checkpoint `directory` (`<role>.pt`)."""
        for role in self.stateful_roles():
            call_all(
                getattr(self, role),
                endpoint,
                f"{directory}/{role}.pt",
                what=f"{role}.{endpoint}",
                timeout_s=self.timeout_s,
            )

    def maybe_checkpoint(self, steps_done: int) -> None:
        """Write a checkpoint every `checkpoint.every` steps (atomically)."""
        ck = self.cfg.checkpoint
        if not ck.every or steps_done % ck.every:
            return
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
        )
        checkpoint.commit(partial, ck.keep)

    def restore(self, path: str) -> int:
        """Every role's state from the checkpoint at `path`; returns its step."""
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
        call_each(
            self.policy,
            "set_rng_state",
            [(s,) for s in state["policy_rng"]],
            "policy.set_rng_state",
            self.timeout_s,
        )
        print(f"resumed from {path} at step {state['step']}", flush=True)
        return state["step"]

    # --- rollouts ---------------------------------------------------------------------

    def generate_and_score(self, prompts: list[Prompt]) -> tuple[Completions, torch.Tensor, dict]:
        """`group_size` completions per prompt from the policy replicas, scored on
        the environment mesh. Returns completions [B = prompts x group], rewards
        [B] and timings.

        A policy or environment proc that dies is replaced within the step
        (`recover`): generation lost with a policy replica is done again (its
        completions counted in `samples/dropped`); completions whose scoring
        was lost with an environment proc are scored again.
        """
        group = [p for p in prompts for _ in range(self.cfg.group_size)]
        prompt_ids = [self.tokenizer(p.text).input_ids for p in group]
        started = time.perf_counter()
        shards = split(prompt_ids, self.meshes.size("policy"))
        parts, retries = self.call_recovering(
            "policy", "generate", [(s, self.cfg.generation) for s in shards]
        )
        lost = retries * len(group)  # in flight on the lost replica and its peers
        completions = Completions.concat(parts, self.tokenizer.pad_token_id)
        scored = time.perf_counter()
        env_shards = zip(
            split(group, self.meshes.size("environment")),
            split(completions.completion_lists(), self.meshes.size("environment")),
            strict=True,
        )
        # After a lost environment proc, the same completions are scored again.
        scores, _ = self.call_recovering("environment", "score", list(env_shards))
        rewards = torch.tensor([r for part in scores for r in part])
        rewound, self.dropped_on_rewind = self.dropped_on_rewind, 0
        return (
            completions,
            rewards,
            {
                "time/generate_s": scored - started,
                "time/score_s": time.perf_counter() - scored,
                # Every sample is trained on once or counted here, by reason.
                "samples/dropped": lost + rewound,
                "samples/dropped_policy_lost": lost,
                "samples/dropped_trainer_rewind": rewound,
                "faults/recoveries": len(self.recoveries),
            },
        )

    # --- faults -----------------------------------------------------------------------

    recoveries: list[str] = []
    dropped_on_rewind = 0
    _drilled: frozenset = frozenset()

    def inject_faults(self, step: int) -> None:
        """Drills from `faults.kill`: end the named procs now, as a crash would
        (each once, also when a recovery brings the loop back over the step)."""
        for role, rank in self.cfg.faults.kills_at(step):
            if (role, rank, step) in self._drilled:
                continue
            self._drilled = self._drilled | {(role, rank, step)}
            getattr(self, role).slice(procs=rank).exit_now.call_one()  # never answers
            print(f"faults: killed {role}[{rank}] at step {step}", flush=True)

    def call_recovering(self, role: str, endpoint: str, args_per_rank: list) -> tuple[list, int]:
        """`call_each` on `role`, replacing its mesh and calling again each time a
        proc of it is lost (`recover`); returns the results and the retries."""
        what, retries = f"{role}.{endpoint}", 0
        while True:
            try:
                results = call_each(
                    getattr(self, role), endpoint, args_per_rank, what, self.timeout_s
                )
                return results, retries
            except RemoteCallError as error:
                self.recover(role, error)
                retries += 1

    def recover_trainer(self, step: int, error: RemoteCallError) -> int:
        """A trainer proc died during `step`: replace the trainer mesh, restore
        every role from the newest checkpoint and return its step, where the
        loop continues. The samples of the steps since are counted as dropped."""
        path = checkpoint.latest(self.run_dir)
        if error.role != "trainer" or not error.proc_lost or path is None:
            raise error  # not a lost trainer proc, or no checkpoint (checkpoint.every = 0)
        if len(self.recoveries) >= self.cfg.faults.max_recoveries:
            raise error
        print(f"recovering trainer from {path}: {error}", flush=True)
        self.meshes.respawn("trainer")
        self.spawn_role("trainer")
        back_to = self.restore(path)
        self.logger.rewind(back_to)
        self.dropped_on_rewind = (
            (step + 1 - back_to) * self.cfg.prompts_per_step * (self.cfg.group_size)
        )
        self.recoveries = [*self.recoveries, f"trainer: {error}"]
        return back_to

    def recover(self, role: str, error: RemoteCallError) -> None:
        """Replace `role`'s mesh after a failure and bring it to the current state
        (a policy replica takes the current weight version). An exception raised
        in the actor (a reward function that fails) is not a lost proc: it ends
        the run with its one-line error instead."""
        if not error.proc_lost or len(self.recoveries) >= self.cfg.faults.max_recoveries:
            raise error
        print(f"recovering {role}: {error}", flush=True)
        self.meshes.respawn(role)
        self.spawn_role(role)
        if role == "policy":
            versions = call_all(
                self.policy,
                "load_weights",
                self.handle,
                what="policy.load_weights",
                timeout_s=self.timeout_s,
            )
            assert set(versions) == {self.handle.version}, versions
        self.recoveries = [*self.recoveries, f"{role}: {error}"]

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
            "weights/generated_with": completions.weight_version,
        }

    # --- training ---------------------------------------------------------------------

    def train(self, batch: TrainBatch, endpoint: str = "train_step", *args) -> dict[str, float]:
        """One data-parallel call on the trainer mesh: each rank gets its shard
        of the batch; metrics averaged over ranks."""
        return self.collect(
            self.start_sharded("trainer", batch, endpoint, *args), f"trainer.{endpoint}"
        )

    def start_sharded(self, role: str, batch: TrainBatch, endpoint: str, *args) -> list:
        """Start `endpoint` on every proc of `role`'s mesh, each with its
        data-parallel shard of `batch` (rows i::n); returns the futures."""
        n = self.meshes.size(role)
        actors = getattr(self, role)
        return start_each(actors, endpoint, [(batch.shard(i, n), *args) for i in range(n)])

    def collect(self, futures: list, what: str) -> dict[str, float]:
        """Wait for `start_sharded`'s calls; metrics averaged over the ranks."""
        return mean_metrics(gather(futures, what, self.timeout_s))

    def call_rows(self, role: str, endpoint: str, batch: TrainBatch, *args) -> torch.Tensor:
        """`endpoint` on contiguous row blocks of `batch` over `role`'s procs,
        results concatenated in row order (reference log-probs, critic values)."""
        n = self.meshes.size(role)
        size = len(batch) // n
        parts = call_each(
            getattr(self, role),
            endpoint,
            [(batch.rows(slice(i * size, (i + 1) * size)), *args) for i in range(n)],
            f"{role}.{endpoint}",
            self.timeout_s,
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
        return mean_metrics([self.train(batch.rows(rows)) for rows in self.minibatches(len(batch))])

    def sync_weights(self) -> None:
        """Trainer rank 0 publishes its weights; every policy replica pulls them."""
        self.handle = wait(
            self.trainer.slice(procs=0).publish.call_one(), "trainer.publish", self.timeout_s
        )
        if "policy" not in self.meshes:
            return
        versions = call_all(
            self.policy,
            "load_weights",
            self.handle,
            what="policy.load_weights",
            timeout_s=self.timeout_s,
        )
        assert set(versions) == {self.handle.version}, f"replicas at {versions}"

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
                prompts = self.task.sample(cfg.batch_size, self.rng)
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
        if self.logger is not None:
            self.logger.close()
        if self.meshes is not None:
            self.meshes.stop()


def mean_metrics(records: list[dict[str, float]]) -> dict[str, float]:
    """Each key's mean over `records` (ranks of a mesh, optimizer steps of a batch)."""
    return {key: sum(r[key] for r in records) / len(records) for key in records[0]}


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


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(algorithm: type[Algorithm], schema: type, argv: list[str] | None = None) -> int:
    """`python -m algorithms.X --config FILE key=value ...` for any algorithm."""
    cfg = parse_cli(schema, argv)
    # A scheduler's SIGTERM (preemption, scancel) stops the run like Ctrl-C: every
    # proc is stopped; the newest checkpoint is what `checkpoint.resume=auto` uses.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        algorithm(cfg).run()
    except KeyboardInterrupt:
        print("interrupted: every proc stopped", file=sys.stderr)  # Ctrl-C or SIGTERM
        return 130
    except ConfigError as error:  # found once the run reads its data files
        print(f"error: {error}", file=sys.stderr)
        return 2
    except (RemoteCallError, FileExistsError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0
