"""The session every algorithm shares: the calls a notebook makes between steps,
the lifecycle of a run's meshes, and the hook defaults. Nothing of a loop.

Each algorithm writes its own `run()`, the loop a reader follows top to bottom:
it spawns its roles (`algorithms.roles`), builds its pieces with their
collaborators (`Supervisor`, `WeightSync`, `Collector`, `Checkpointer`, ...)
and makes every mesh call of a step (grpo.py, dpo.py, coevolve.py). What it
sets here (`meshes`, `log`, `sup`, `ckpt`, ...) is what the notebook calls
below act on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from algorithms.commands.train import main, run_main  # noqa: F401 - every algorithm's command line
from algorithms.rl_config import RLConfig  # noqa: F401 - its home for the algorithms
from meshrl.loop.export import start_from
from meshrl.loop.state import LoopState
from meshrl.loop.steplog import run_faults, weight_paths
from meshrl.loop.steps import Steps
from meshrl.loop.supervisor import NonFiniteLoss  # noqa: F401 - re-exported
from meshrl.model.tokenizer import context_length, load_tokenizer, vision_format
from meshrl.procs.mesh import RemoteCallError
from meshrl.types import TrainBatch


class Loss:
    """What every trainer proc runs on its shard of a batch: `(logprobs [B, T],
    batch) -> (loss, metrics)`. Built on the controller (`Algorithm.make_loss`)
    and pickled whole to each trainer proc, so whatever its constructor was
    given arrives there; it holds no mesh and no controller state."""

    def __init__(self, cfg: Any):
        self.cfg = cfg

    def __call__(self, logprobs: torch.Tensor, batch: TrainBatch) -> tuple[torch.Tensor, dict]:
        raise NotImplementedError(f"{type(self).__name__}: no loss written (__call__)")


class Algorithm:
    """An algorithm's controller: `run()` is its loop (the subclass writes it).

    `run()` trains to `cfg.steps` and stops every proc. In a notebook,
    `train(n)` and `step()` advance n steps or one and keep the meshes up
    between calls (the first call spawns them); change `cfg`, the learning rate
    (`set_lr`), the temperature or a hook in between, and `stop()` at the end.
    """

    name = "algorithm"
    headline = "reward/mean"
    Loss: type[Loss] = Loss
    """The loss its trainers run (`make_loss` builds it from the config)."""
    elastic: tuple[str, ...] = ()
    """Roles whose pools can grow and shrink while the run goes (`scale`)."""
    samples = False
    """Whether it samples (and so has a temperature to set: `set_temperature`)."""

    def __init__(self, cfg: Any):
        self.cfg = cfg
        # `model.path` naming another run (its `final/` or a checkpoint, exported once to
        # an HF directory): the model and tokenizer loaded from here on are that run's.
        start_from(cfg.model, "model.path")
        self.state = LoopState(seed=cfg.run.seed)
        self.tokenizer = load_tokenizer(cfg.model)
        self.vision = vision_format(cfg.model)  # None: a text model
        self.context = context_length(cfg.model)
        self.runtime: Any = None  # the `Run`, once spawned
        self.ready = False  # the meshes spawned and set up (`steps` says so)
        self._run_dir: str | None = None  # kept after `close`
        # What `run()` sets once its meshes are up, for the calls below; None where
        # an algorithm has no such piece (DPO and SFT have no collector, no pools, ...).
        self.log: Any = None
        self.sup: Any = None
        self.sync: Any = None
        self.ckpt: Any = None
        self.trainer: Any = None
        self.collector: Any = None
        self.scaler: Any = None
        self.dispatcher: Any = None
        self.task: Any = None

    def run(self, num_steps: int | None = None) -> list[dict]:
        """Train `num_steps` more steps (with None: to `cfg.steps`, then save the
        model and stop every proc); returns the records logged so far."""
        raise NotImplementedError

    # --- hooks ----------------------------------------------------------------------------

    def make_loss(self) -> Loss:
        """The loss object the trainer procs run, pickled whole to them: `Loss`
        built from the config (override to hand it more)."""
        return self.Loss(self.cfg)

    def after_step(self, step: int, metrics: dict) -> None:
        """A hook: a variant adds to the step's record or acts on it here, before
        the loop records it (nothing by default; no `super()` is needed)."""

    def record_step(self, step: int, metrics: dict) -> None:
        """The loop's last call of a step: the `after_step` hook, then the record
        (metrics.jsonl, the sinks, the progress bar). The step counts once
        recorded, so no hook can make the loop run it again."""
        self.after_step(step, metrics)
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
        if not self.samples:
            raise ValueError(f"{self.name}: set_temperature(): this algorithm samples nothing")
        self.cfg.generation.temperature = temperature
        if self.ready:
            for trainer in self.trainers():
                self.sup.call_all(trainer, "set_temperature", temperature)

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

    def mesh_status(self, timeout_s: float = 15.0, show: bool = True) -> list[dict]:
        """Every proc of every mesh, asked now (`Run.mesh_status`)."""
        if self.runtime is None:
            raise ValueError(f"{self.name}: mesh_status(): no meshes yet (train(0) spawns them)")
        return self.runtime.mesh_status(timeout_s, show)

    @property
    def run_dir(self) -> str | None:
        """The run directory (also after `stop()`)."""
        return self.runtime.dir if self.runtime is not None else self._run_dir

    @property
    def last_episodes(self) -> list:
        """The multi-turn episodes of the last step (`meshrl.envs.rollout.EpisodeState`);
        none where the algorithm plays no episodes (DPO, SFT)."""
        return self.collector.last_episodes if self.collector is not None else []

    def save_final(self) -> None:
        """The final model in `<run dir>/final` (`run.save_final`)."""
        self.sup.call_all(self.trainer, "save", f"{self.runtime.dir}/final")

    def stop(self, save: bool = True) -> None:
        """Save the final model (`save`, per `run.save_final`), draw the curve,
        print the summary and stop every proc. Safe to call twice."""
        if self.runtime is None:
            return
        try:
            if save and self.log is not None:
                if self.dispatcher is not None:  # late groups never trained
                    self.dispatcher.drop_all("run_end")
                if self.cfg.run.save_final:
                    self.save_final()
                paths = self.sync.paths if self.sync is not None else []
                self.log.close(weights=weight_paths(paths) + run_faults(self.state))
        finally:
            self.close()

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
        meshes, self.runtime, self.ready = self.runtime, None, False
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

    # --- around a loop: what `run()` uses ---------------------------------------------------

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
        end = (
            self.cfg.steps
            if num_steps is None
            else min(self.cfg.steps, self.state.step + num_steps)
        )
        return Steps(self.runtime, self.state, self.log, self.ckpt, end, self.before_step)

    def before_step(self, step: int) -> None:
        """As `step` begins: the `faults:` drills due, then the pool sizes due."""
        self.sup.drill(step)
        if self.scaler is not None:
            self.scaler.apply(step)
