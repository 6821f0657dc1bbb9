"""What the algorithms' controllers share: the on-policy config core, the hook
defaults, the calls a notebook makes between steps, and `main`.

Each algorithm writes its own `run()`: the loop a reader follows top to bottom,
with the meshes spawned, the endpoint calls and the weight transfers in it
(grpo.py, ppo.py, dpo.py). The machinery every loop needs lives in small
pieces in `meshrl/` that `run()` composes: `Run` (directory, meshes, stop
request), `Supervisor` (deadlines, retries, respawns, drills), `Checkpointer`,
`LoopState` (RNGs, ledger, counters), `WeightSync`, `Collector` (rollouts) and
`StepLog` (timing and logging).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from algorithms.commands.train import main, run_main  # noqa: F401 - every algorithm's command line
from algorithms.rl_config import RLConfig  # noqa: F401 - its home for the algorithms
from meshrl.config import ConfigError
from meshrl.envs import make_task
from meshrl.loop.checkpoint import Checkpointer
from meshrl.loop.collector import Batch, Collector, decode
from meshrl.loop.dispatch import Dispatcher
from meshrl.loop.elastic import Scaler
from meshrl.loop.evaluation import Evaluator, Judge
from meshrl.loop.export import start_from
from meshrl.loop.state import LoopState
from meshrl.loop.steplog import StepLog, run_faults, weight_paths
from meshrl.loop.steps import Steps
from meshrl.loop.supervised import demonstrations, supervised_steps
from meshrl.loop.supervisor import NonFiniteLoss, Supervisor  # noqa: F401 - NonFiniteLoss: re-export
from meshrl.loop.weight_sync import WeightSync
from meshrl.model.losses import mismatch_metrics, mismatch_weights
from meshrl.model.tokenizer import context_length, load_tokenizer, vision_format
from meshrl.procs.mesh import RemoteCallError, form_groups
from meshrl.types import Completions, TrainBatch

DROP_REASONS = ("stale", "trainer_rewind")
REDO_REASONS = ("policy_lost",)
"""Reasons a step always logs as `samples/dropped_<reason>` (others when they occur)."""


class HookLoss:
    """An algorithm's `loss` hook as the trainer procs run it. Only the class and
    the config travel (pickled); the trainer makes a bare instance of the class
    with that config, never the controller with its meshes."""

    def __init__(self, algorithm: Algorithm):
        self.algorithm_class, self.cfg = type(algorithm), algorithm.cfg
        self._instance: Algorithm | None = None

    def __getstate__(self) -> dict:
        return {"algorithm_class": self.algorithm_class, "cfg": self.cfg, "_instance": None}

    def __call__(self, logprobs: torch.Tensor, batch: TrainBatch) -> tuple[torch.Tensor, dict]:
        if self._instance is None:
            self._instance = self.algorithm_class.__new__(self.algorithm_class)
            self._instance.cfg = self.cfg
        return self._instance.loss(logprobs, batch)


class Algorithm:
    """An algorithm's controller: `run()` is its loop (the subclass writes it).

    `run()` trains to `cfg.steps` and stops every proc. In a notebook,
    `train(n)` and `step()` advance n steps or one and keep the meshes up
    between calls (the first call spawns them); change `cfg`, the learning rate
    (`set_lr`), the temperature or a hook in between, and `stop()` at the end.
    """

    name = "algorithm"
    headline = "reward/mean"
    elastic: tuple[str, ...] = ("policy", "environment")
    """Roles whose pools can grow and shrink while the run goes (`scale`)."""
    judge: Judge | None = None
    """A method `(completions, temperature) -> {figure: value}` to add figures of the
    algorithm's own to each held-out set (`eval:`): distillation's teacher KL."""

    def __init__(self, cfg: Any):
        self.cfg = cfg
        start_from(cfg.model, "model.path")
        if getattr(cfg.placement, "policy_tp", 1) > 1:  # its replicas' procs form groups
            self.elastic = tuple(role for role in self.elastic if role != "policy")
        self.state = LoopState(seed=cfg.run.seed)
        self.meshes: Any = None  # the `Run`, once spawned
        self.ready = False  # the meshes spawned and set up (`steps` says so)
        self.log: Any = None
        # The pieces a loop composes once its meshes are up; None where an algorithm
        # has no such piece (DPO and SFT have no collector, no pools to scale, ...).
        self.sup: Any = None
        self.sync: Any = None
        self.ckpt: Any = None
        self.collector: Any = None
        self.evaluator: Any = None
        self.scaler: Any = None
        self.dispatcher: Any = None
        self.reference: Any = None  # a frozen mesh (a reference, a teacher), where one runs
        self.critic: Any = None  # a value model's mesh (PPO's), where one runs
        self.tokenizer = load_tokenizer(cfg.model)
        self.vision = vision_format(cfg.model)  # None: a text model
        self.context = context_length(cfg.model)
        self.task = make_task(cfg.task) if hasattr(cfg, "task") else None

    def run(self, num_steps: int | None = None) -> list[dict]:
        """Train `num_steps` more steps (with None: to `cfg.steps`, then save the
        model and stop every proc); returns the records logged so far."""
        raise NotImplementedError

    def loss(self, logprobs: torch.Tensor, batch: TrainBatch) -> tuple[torch.Tensor, dict]:
        """Runs on every trainer proc: [B, T] log-probs of the batch -> (loss, metrics)."""
        raise NotImplementedError

    def after_step(self, step: int, metrics: dict) -> None:
        """A hook: a variant adds to the step's record or acts on it here, before
        the loop records it (nothing by default; no `super()` is needed)."""

    def record_step(self, step: int, metrics: dict) -> None:
        """The loop's last call of a step: the `after_step` hook, then the held-out
        evaluation (`eval:`) when one is due, on the replicas now idle, then the
        record (metrics.jsonl, the sinks, the progress bar). The step counts once
        recorded, so no hook can make the loop run it again."""
        self.after_step(step, metrics)
        if self.evaluator is not None:
            metrics.update(self.evaluator.after_step(step, self.cfg.steps - 1, self.sync.handle))
        if self.collector is not None:  # generation sent ahead (`max_staleness`): what it
            for batch in self.state.ahead:  # records lands in this step's record, every run
                self.collector.ended(batch)
        self.log.step(metrics)

    # --- in a notebook --------------------------------------------------------------------

    def train(self, num_steps: int) -> list[dict]:
        """`num_steps` more steps, the meshes kept up; the records of those steps."""
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 0:
            raise ValueError(
                f"train(num_steps={num_steps!r}): a whole number of steps (0: spawn the meshes only)"
            )
        done = len(self.log.history) if self.log is not None else 0
        return self.run(num_steps)[done:]

    def step(self) -> dict:
        """One more step; its record."""
        return self.train(1)[-1]

    def heal_from_peers(self, trainer: Any, sync: WeightSync) -> None:
        """A DDP trainer's ranks are replicas: a lost one is healed from the others
        (`Supervisor.heal_from_peers`), the new procs publishing the version `sync`
        holds. A sharded (FSDP2) trainer goes back to its checkpoint."""
        if self.cfg.placement.sharding == "ddp":
            steps = ("train_step", "warm_start_step")  # the endpoints that change its state
            self.sup.heal_from_peers(trainer.name, steps, lambda: sync.republish(trainer))

    def spawn_trainer(
        self, run: Any, role: str = "trainer", seed: int | None = None, shm_prefix: str = ""
    ) -> Any:
        """The trainer mesh, spawned from the config the same way by every algorithm:
        `model`, `optim` and `trainer` (micro-batches, layout, routing replay); its
        LR schedule over `total_updates` optimizer steps; its log-probs at the
        sampling temperature (1 where nothing samples); `placement.sharding`."""
        from actors.trainer import Trainer

        cfg = self.cfg
        temperature = cfg.generation.temperature if hasattr(cfg, "generation") else 1.0
        trainer = run.spawn(
            role,
            Trainer,
            cfg.model,
            cfg.optim,
            loss_fn=HookLoss(self),
            total_steps=cfg.total_updates,
            temperature=temperature,
            seed=cfg.run.seed if seed is None else seed,
            sharding=cfg.placement.sharding,
            tp=cfg.placement.trainer_tp,
            replica_tp=cfg.placement.policy_tp,
            shm_prefix=shm_prefix or run.shm_prefix,
            micro_batches=cfg.trainer.micro_batches,
            layout=cfg.trainer.layout,
            routing_replay=cfg.trainer.routing_replay,
            rendezvous=True,
        )
        trainer.tensor_parallel = cfg.placement.trainer_tp  # its groups take the same rows
        return trainer

    def group_replicas(self, run: Any, role: str = "policy") -> None:
        """Form `role`'s tensor-parallel replicas: a fresh store on each leader
        proc, every proc of the leaders and followers joins its group at once
        (`Policy.join`), and each leader takes its followers (`Policy.follow`;
        `meshrl.procs.mesh.form_groups`)."""
        leaders, followers = run.roles[role], run.roles[f"{role}_tp"]
        tp = followers.size // leaders.size + 1
        masters = run.meshes.rendezvous_each(role)
        timeout_s = self.cfg.run.call_timeout_s
        form_groups(leaders.actors, followers.actors, leaders.size, tp, masters, timeout_s)

    def spawn_policy(
        self, run: Any, role: str = "policy", seed: int | None = None, shm_prefix: str = ""
    ) -> Any:
        """The policy replicas, spawned from `model` and `policy` the same way by
        every algorithm that samples; each reads its weights from `shm_prefix`'s
        slots (the trainer's of the same prefix) on this host."""
        from actors.policy import Policy, PolicyStream

        cfg = self.cfg
        rollout = getattr(cfg, "rollout", None)
        # Tensor-parallel replicas: where the run gave the role its followers' procs.
        tp = cfg.placement.policy_tp if run.meshes.counts.get(f"{role}_tp") else 1
        args = (cfg.model, cfg.run.seed if seed is None else seed, cfg.policy, self.context)
        kwargs = dict(
            role_name=role,
            partial=bool(rollout and rollout.partial),
            lengths=cfg.faults.lengths() if getattr(cfg, "faults", None) else None,
            tp=tp,
        )
        policy = run.spawn(role, Policy, *args, shm_prefix or run.shm_prefix, **kwargs)
        if tp > 1:
            run.spawn(
                f"{role}_tp", Policy, *args, shm_prefix or run.shm_prefix, **kwargs, leader=False
            )
            run.meshes.grouped_roles |= {role, f"{role}_tp"}
            self.group_replicas(run, role)
        if cfg.policy.continuous and rollout is not None and rollout.dispatch == "pull":
            # The running batch's endpoint, on the same procs: the pull queue's calls.
            policy.stream = run.spawn(f"{role}_stream", PolicyStream, role, share=role)
        return policy

    def trainers(self) -> list:
        """The trainer meshes `set_lr` and `set_temperature` reach (co-evolution:
        one per player)."""
        return [self.trainer]

    def set_lr(self, lr: float) -> None:
        """The trainers' learning rate from the next step on (its schedule keeps
        its shape: this is the new peak). Before the meshes are up, the config's."""
        self.cfg.optim.lr = lr
        if self.ready:
            for trainer in self.trainers():
                self.sup.call_all(trainer, "set_lr", lr)

    def set_temperature(self, temperature: float) -> None:
        """Sample at `temperature` from the next step on; the trainers take their
        log-probs at the same one (else the ratio would not start at 1)."""
        if not hasattr(self.cfg, "generation"):
            raise ValueError(f"{self.name}: set_temperature(): this algorithm samples nothing")
        self.cfg.generation.temperature = temperature
        if self.ready:
            for trainer in self.trainers():
                self.sup.call_all(trainer, "set_temperature", temperature)

    def mesh_status(self, timeout_s: float = 15.0, show: bool = True) -> list[dict]:
        """Every proc of every mesh, asked now (`Run.mesh_status`)."""
        if self.meshes is None:
            raise ValueError(f"{self.name}: mesh_status(): no meshes yet (train(0) spawns them)")
        return self.meshes.mesh_status(timeout_s, show)

    def stop(self, save: bool = True) -> None:
        """Save the final model (`save`, per `run.save_final`), draw the curve,
        print the summary and stop every proc. Safe to call twice."""
        if self.meshes is None:
            return
        try:
            if save and self.log is not None:
                if self.dispatcher is not None:  # late groups never trained
                    self.dispatcher.drop_all("run_end")
                if self.cfg.run.save_final:
                    self.sup.call_all(self.trainer, "save", f"{self.meshes.dir}/final")
                paths = self.sync.paths if self.sync is not None else []
                self.log.close(weights=weight_paths(paths) + run_faults(self.state))
        finally:
            self.close()

    @property
    def run_dir(self) -> str | None:
        """The run directory (also after `stop()`)."""
        return self.meshes.dir if self.meshes is not None else getattr(self, "_run_dir", None)

    @property
    def last_episodes(self) -> list:
        """The multi-turn episodes of the last step (`meshrl.envs.rollout.EpisodeState`);
        none where the algorithm plays no episodes (DPO, SFT)."""
        return self.collector.last_episodes if self.collector is not None else []

    def failed(self, error: BaseException, num_steps: int | None) -> None:
        """What a `run()` that raised `error` leaves behind. In a notebook
        (`train`, `step`), an exception in a hook or an actor, or from a bad
        argument, leaves the meshes up and the object usable: fix the cause and
        call `step()` again. The samples of the step it broke are counted as
        dropped (`samples/dropped_step_error`), so the ledger still adds up.
        Everything else stops every proc: a script's `run()`, Ctrl-C or SIGTERM,
        a lost proc no recovery replaced, a call that never answered (its mesh's
        state is unknown), and an error before the meshes were all up."""
        kept = (
            num_steps is not None
            and isinstance(error, Exception)
            and self.ready  # the meshes were all up and set (`steps` says so)
            and not (
                isinstance(error, RemoteCallError)
                and (error.proc_lost or error.timed_out or error.stray)
            )
        )
        if not kept:
            self.close()
            return
        ledger = self.state.ledger
        broken = ledger.generated - ledger.trained - sum(ledger.dropped.values())
        if broken > 0:
            ledger.drop("step_error", broken)

    def close(self) -> None:
        """Stop every proc now (no save)."""
        meshes, self.meshes, self.ready = self.meshes, None, False
        if self.dispatcher is not None:
            with contextlib.suppress(Exception):
                self.dispatcher.pause()  # its thread sends no more calls
        if self.collector is not None:
            self.collector.close()  # the policy's endpoint
        if meshes is not None:
            self._run_dir = meshes.dir
        if self.log is not None:
            self.log.logger.close()
        if meshes is not None:
            meshes.close()
        if self.task is not None:
            self.task.close()  # what the controller's copy started (a server, agent threads)

    # --- what the on-policy loops share ----------------------------------------------------

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

    def assemble(self, run: Any, stateful: list) -> None:
        """The pieces an on-policy loop uses (supervisor, weight sync, collector,
        evaluator, checkpointer, scaler, dispatcher) and each role's catch-up after a
        respawn; `stateful`: the roles a checkpoint holds. Nothing runs yet: `start`."""
        cfg, state, policy, trainer = self.cfg, self.state, self.policy, self.trainer
        self.sup = sup = Supervisor(run, cfg.faults, state)
        self.sync = sync = WeightSync.from_config(sup, cfg.weights, wait=not cfg.max_staleness)
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
        self.ckpt = Checkpointer(
            run,
            state,
            stateful,
            cfg.checkpoint,
            after_restore=lambda: sync.pull(policy, sync.publish(trainer)),
            collector=self.collector,
            same_size=("policy",),  # a replica's sampling stream is its own
        )
        self.ckpt.recover = sup.recover
        if cfg.placement.policy_tp == 1:
            sup.on_respawn("policy", lambda: sync.catch_up(policy))  # the current version
        else:  # a proc of a tensor-parallel group lost: the group is replaced whole

            def regroup(lost: str) -> None:
                run.respawn("policy_tp" if lost == "policy" else "policy")  # the other procs
                self.group_replicas(run)
                sync.catch_up(policy)

            sup.on_respawn("policy", lambda: regroup("policy"))
            sup.on_respawn("policy_tp", lambda: regroup("policy_tp"))
        if getattr(policy, "stream", None) is not None:
            sup.on_respawn(policy.stream.name)  # it finds the new replica on its proc
        self.heal_from_peers(trainer, sync)
        self.scaler = Scaler(
            run, cfg.pool, self.settle, lambda role: sup.catch_up[role](), cfg.faults.standby
        )
        self.dispatcher = self.ckpt.queue = self.make_dispatcher()
        if self.dispatcher is not None:  # each group generated with the version it was drawn at
            sync.before_pull = self.dispatcher.hand_out
        elif not self.task.multi_turn:  # each batch sent ahead likewise (`Collector.generated`)
            sync.before_pull = lambda: [self.collector.generated(b) for b in state.ahead]
        sup.on_respawn("environment")  # nothing to catch up
        sup.on_respawn("reward_model")
        sup.on_respawn("reference", self.reload_reference)
        if self.reference is not None and self.frozen_copy is None:
            sup.on_respawn(self.reference.name)  # a model of its own: it loads it itself
        if self.critic is not None:
            sup.heal_from_peers("critic", ("train_step",))  # DDP: its ranks are replicas

    def start(self) -> None:
        """The state step 0 starts from: a checkpoint's (`checkpoint.resume`), or else
        version 0 on every replica, the warm-start, the reference's copy of the
        result, the held-out evaluation before training and the critic's backbone
        (the policy's weights); then the step log."""
        cfg, state, sup, sync = self.cfg, self.state, self.sup, self.sync
        policy, trainer, run = self.policy, self.trainer, self.meshes
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

    @property
    def frozen_copy(self) -> Any:
        """The reference mesh when it holds a frozen copy of the starting policy
        (spawned with `frozen_copy=True`: pulled from the trainer once, saved in
        checkpoints); None when there is none, or when it is a model of its own
        (distillation's teacher)."""
        reference = self.reference
        return reference if reference is not None and reference.frozen_copy else None

    def spawn_evaluator(self, run: Any) -> Evaluator | None:
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

    def reload_reference(self) -> None:
        """A replaced reference takes its frozen weights from the newest checkpoint."""
        saved = self.ckpt.latest(rehash=True)
        if saved is None:
            raise RemoteCallError(
                "reference lost (a reference is recovered from a checkpoint: set checkpoint.every)",
                "reference",
                proc_lost=True,
            )
        self.sup.call_all(self.reference, "load_state", saved)

    def warm_start(self) -> None:
        """Supervised steps on task demonstrations (warm_start.jsonl), then a sync."""
        cfg = self.cfg.warm_start
        supervised_steps(
            self.sup,
            self.trainer,
            lambda step: demonstrations(self.collector, cfg.batch_size),
            cfg.steps,
            cfg.lr,
            f"{self.meshes.dir}/warm_start.jsonl",
            "warm-start",
        )
        self.sync.pull(self.policy, self.sync.publish(self.trainer))

    def make_dispatcher(self) -> Dispatcher | None:
        """Work by pull (`rollout.dispatch: pull`): the queue the replicas take
        groups from; None for the static split."""
        cfg, policy, environment = self.cfg, self.policy, self.environment
        if getattr(cfg, "rollout", None) is None or cfg.rollout.dispatch != "pull":
            return None
        if type(self).rollout is not Algorithm.rollout:  # DAPO's filter, distillation's teacher
            raise ConfigError(
                f"config key 'rollout.dispatch': pull does not run {self.name}'s own rollout "
                "hook (not yet); use split"
            )
        if cfg.rollout.overprovision:  # the one setting whose samples depend on timing
            print(
                f"note: rollout.overprovision={cfg.rollout.overprovision}: which groups a "
                "step trains on depends on which complete first, so this run does not repeat "
                "bit for bit (docs/reliability.md)",
                flush=True,
            )
        return Dispatcher(
            cfg.rollout,
            self.collector,
            policy,
            environment,
            send=lambda i, ids, seeds, images: (
                (getattr(policy, "stream", None) or policy)
                .slice(procs=i)
                .generate.call_one(ids, cfg.generation, seeds, images, record_batch=False)
            ),
            score=lambda i, prompts, texts: environment.slice(procs=i).score.call_one(
                prompts, texts
            ),
        )

    @contextlib.contextmanager
    def running(self, num_steps: int | None) -> Iterator[None]:
        """Around a call of `run()`: an error leaves what `failed` says (in a
        notebook, a hook's error keeps the meshes); a whole run (`num_steps`
        None) ends with `stop()`: the final model saved, every proc stopped."""
        try:
            yield
        except BaseException as error:
            self.failed(error, num_steps)
            raise
        if num_steps is None:
            self.stop()

    def steps(self, num_steps: int | None) -> Steps:
        """The steps of this call of `run()`, `num_steps` of them (None: to
        `cfg.steps`), with what every loop does around a step (`Steps`). A loop
        asks for them once its meshes are up and set: from here on an error in a
        notebook keeps them (`failed`)."""
        self.ready = True
        return Steps(
            self.meshes, self.state, self.log, self.ckpt, self.steps_to(num_steps), self.before_step
        )

    def before_step(self, step: int) -> None:
        """As `step` begins: the `faults:` drills due, then the pool sizes due."""
        self.sup.drill(step)
        if self.scaler is not None:
            self.scaler.apply(step)

    def settle(self) -> None:
        """Collect the work in flight (batches generated ahead, the rollout queue's
        calls, weight pulls); nothing to do where none runs ahead (DPO, SFT)."""
        if self.collector is None:
            return
        for batch in self.state.ahead:
            self.collector.collect(batch)
        if self.dispatcher is not None:
            self.dispatcher.settle()
        self.sync.wait()

    def scale(self, **sizes: int) -> None:
        """Grow or shrink elastic pools now, between steps: `algo.scale(policy=3)`."""
        if not self.elastic:
            raise ValueError(
                f"{self.name}: scale(): no pools that grow and shrink (grpo, ppo and "
                "their variants have them)"
            )
        if self.scaler is None:
            raise ValueError(f"{self.name}: scale(): no meshes yet (train(0) spawns them)")
        self.scaler.scale(**sizes)

    def steps_to(self, num_steps: int | None) -> int:
        """The step a call of `run(num_steps)` ends before."""
        if num_steps is None:
            return self.cfg.steps
        return min(self.cfg.steps, self.state.step + num_steps)

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

    def next_rollout(self) -> tuple[Completions, torch.Tensor, dict]:
        """This step's rollouts: the batch generated ahead, collected and scored
        (`rollout`), or by pull the first complete groups of the queue."""
        if self.dispatcher is not None:
            return self.dispatcher.step(self.cfg.prompts_per_step)
        return self.rollout(self.state.ahead.pop(0))

    def rollout(self, batch: Batch) -> tuple[Completions, torch.Tensor, dict]:
        """This step's batch (`prompts_per_step` prompts x `group_size`, its
        generation sent by the loop, or its episodes still to play), collected
        and scored.

        Returns completions [B = prompts x group], rewards [B] and metrics to log.
        """
        return self.collector.finish(batch)

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
        return mismatch_metrics(
            batch.old_logprobs, batch.sampler_logprobs, batch.completion_mask, batch.weights
        )

    def accounting(self, trained: int) -> dict:
        """The step's sample ledger and the run's fault counters."""
        return {
            **self.state.ledger.count_step(trained, DROP_REASONS, REDO_REASONS),
            **self.sup.metrics(),
            **self.scaler.metrics(),
            "samples/skipped_overlong_prompts": self.state.counters["skipped_prompts"],
        }

    def record_samples(self, step: int, completions: Any, rewards: Any, advantages: Any) -> None:
        """The step's samples in samples.jsonl, every `run.samples_every` steps."""
        if self.cfg.run.samples_every and step % self.cfg.run.samples_every == 0:
            prompts, texts = decode(self.tokenizer, completions)
            mask = completions.completion_mask
            self.log.samples(step, prompts, texts, rewards, advantages, mask)

    def newest_checkpoint(self) -> str | None:
        return self.ckpt.latest() if self.cfg.checkpoint.every else None
