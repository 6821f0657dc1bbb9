"""Checkpoints of a whole RL run, written atomically, the last K kept.

A checkpoint is a directory `<run dir>/checkpoints/step_<NNNNNNNN>/` holding one
file per stateful role (the trainer's model, optimizer and schedule, the
reference's frozen weights, the critic's model and optimizer) and the
controller's `controller.pt` (the next step, its random generators, the policy
replicas' sampling generators). It is assembled under a temporary name and
renamed into place only when every part is written, with a `COMPLETE` marker
last, so a crash while writing leaves the previous checkpoint as the newest
valid one.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from typing import Any

from meshrl.config import ConfigError

COMPLETE = "COMPLETE"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the message is one line."""


_NAME = re.compile(r"^step_(\d{8})$")


@dataclass
class CheckpointConfig:
    every: int = 0
    """Steps between checkpoints; 0 writes none."""
    keep: int = 2
    """How many of the newest checkpoints to keep."""
    resume: str = ""
    """'' starts fresh; 'auto' continues from the newest complete checkpoint in
    the run directory (fresh if there is none); or a checkpoint directory."""

    def validate(self) -> None:
        if self.every < 0:
            raise ConfigError("config key 'checkpoint.every': must be >= 0")
        if self.keep < 1:
            raise ConfigError("config key 'checkpoint.keep': must be >= 1")
        if self.resume not in ("", "auto") and not os.path.isfile(
            os.path.join(self.resume, COMPLETE)
        ):
            raise ConfigError(
                f"config key 'checkpoint.resume': {self.resume} is not a complete checkpoint"
            )


def root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def begin(run_dir: str, step: int) -> str:
    """A fresh temporary directory to write the checkpoint after `step` steps into."""
    path = os.path.join(root(run_dir), f".partial_step_{step:08d}")
    shutil.rmtree(path, ignore_errors=True)  # a previous attempt that crashed
    os.makedirs(path)
    return path


def commit(partial: str, keep: int) -> str:
    """Mark `partial` complete, move it into place, drop all but the newest `keep`."""
    with open(os.path.join(partial, COMPLETE), "w") as f:
        f.write("ok\n")
        f.flush()
        os.fsync(f.fileno())
    final = os.path.join(os.path.dirname(partial), os.path.basename(partial)[len(".partial_") :])
    shutil.rmtree(final, ignore_errors=True)
    os.replace(partial, final)
    for old in complete(os.path.dirname(final))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def complete(checkpoints: str) -> list[str]:
    """Complete checkpoint directories under `checkpoints`, oldest first."""
    if not os.path.isdir(checkpoints):
        return []
    found = [
        os.path.join(checkpoints, name)
        for name in os.listdir(checkpoints)
        if _NAME.match(name) and os.path.isfile(os.path.join(checkpoints, name, COMPLETE))
    ]
    return sorted(found)


def latest(run_dir: str) -> str | None:
    """The newest complete checkpoint of a run, or None."""
    found = complete(root(run_dir))
    return found[-1] if found else None


def step_of(path: str) -> int:
    """Steps done when the checkpoint at `path` was written."""
    return int(_NAME.match(os.path.basename(path.rstrip("/"))).group(1))


def save_state(path: str, **parts) -> None:
    """torch.save of the state dicts of `parts` (modules, optimizers, schedulers)
    and plain values, written under a temporary name and renamed."""
    import torch

    state = {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in parts.items()}
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def load_state(path: str, device, **parts) -> dict:
    """Load what `save_state` wrote into `parts`; returns the plain values."""
    import torch

    state = torch.load(path, map_location=device, weights_only=False)
    for key, target in parts.items():
        target.load_state_dict(state[key])
    return {k: v for k, v in state.items() if k not in parts}


class Checkpointer:
    """Checkpoints of a run: every stateful role's part and the controller's
    `LoopState`, committed atomically every `checkpoint.every` steps; resume
    from one, and go back to the newest after a lost trainer (`rewind`).

    `roles`: the stateful roles; each has `save_state(directory)` and
    `load_state(directory)` endpoints and writes its own files (e.g.
    `trainer.pt`). `after_restore()` runs after the roles are restored (publish
    the restored weights to the replicas). `collector` (a `Collector`, when the
    loop generates ahead) saves and restores the batches of `LoopState.ahead`.
    Sizes of `same_size` roles must match the checkpoint's (a replica's sampling
    stream is its own), unless the role is elastic: its samples' seeds are the
    controller's, so a run may resume with another pool size."""

    def __init__(
        self,
        run,
        state,
        roles: list,
        cfg: CheckpointConfig,
        after_restore=None,
        collector=None,
        same_size: tuple[str, ...] = ("policy",),
        subdirs: dict[str, str] | None = None,
    ):
        self.run, self.state, self.cfg = run, state, cfg
        self.roles = [r for r in roles if r is not None]
        self.after_restore, self.collector, self.same_size = after_restore, collector, same_size
        self.subdirs = subdirs or {}  # role name -> its files' subdirectory (two trainers)
        self.queue: Any = None
        """The rollout queue of work by pull (`meshrl.dispatch.Dispatcher`), if any:
        saved settled in `LoopState.data`, loaded after a restore, dropped on a rewind."""
        self.saved_at = -1
        self.recover: Any = None
        """`Supervisor.recover`: a role that lost a proc while it saved (a policy
        replica's node) is recovered and asked again; None: the loss ends the run."""

    def latest(self) -> str | None:
        return latest(self.run.dir)

    def _each_role(self, endpoint: str, directory: str, roles: list | None = None) -> None:
        from meshrl.mesh import RemoteCallError, call_all

        for role in self.roles if roles is None else roles:
            target = os.path.join(directory, self.subdirs.get(role.name, ""))
            os.makedirs(target, exist_ok=True)
            for attempt in range(2):  # again once, after recovering a lost proc
                try:
                    call_all(
                        role, endpoint, target.rstrip(os.sep),
                        what=f"{role.name}.{endpoint}", timeout_s=self.run.timeout_s,
                    )  # fmt: skip
                    break
                except RemoteCallError as error:
                    if attempt or not error.proc_lost or self.recover is None:
                        raise
                    self.recover(role, error)  # raises RoleLost for a role it cannot catch up

    def load_roles(self, path: str, roles: list) -> None:
        """Restore only `roles` from the checkpoint at `path`, the loop's state
        and every other role as they are (one player of several after its
        trainer was lost)."""
        self._each_role("load_state", path, roles)

    def maybe_save(self) -> None:
        """After each step: a checkpoint every `checkpoint.every` steps; when Ctrl-C
        or SIGTERM asked to stop, a checkpoint if checkpoints are on and this step
        has none yet, then KeyboardInterrupt. When the scheduler gave notice that
        procs of the run will be killed (SLURM: a preemption, a requeue, the time
        limit near), a checkpoint now, whatever `checkpoint.every` says; a job
        warned of its time limit is then requeued (the run goes on when SLURM
        starts it again: `meshrl.slurm`)."""
        notices = self.run.scheduler_notices() if hasattr(self.run, "scheduler_notices") else []
        if notices and self.saved_at != self.state.step:
            from meshrl.mesh import log_fault

            path = self.save()
            said = ", ".join(f"{mesh} job {reason}" for mesh, reason in notices)
            log_fault(f"checkpoint {path} written on SLURM's notice ({said})")
            print(f"SLURM: {said}: checkpoint {path} written", flush=True)
        for mesh, reason in notices:
            if reason == "warning":
                self.run.meshes.job.allocations.requeue(mesh)
        done, stop = self.state.step, self.run.stop_request.requested
        due = self.cfg.every and (done % self.cfg.every == 0 or stop)
        if due and self.saved_at != done:
            self.save()
        if stop:
            saved = f"; checkpoint {self.latest()}" if self.cfg.every else ""
            raise KeyboardInterrupt(f"stopped after {done} steps{saved}")

    def save(self) -> str:
        """Write the checkpoint after `state.step` steps. A part that cannot be
        written (full disk, unwritable directory) stops the run with one line;
        the previous checkpoint stays the newest valid one."""
        import torch

        from meshrl.mesh import RemoteCallError, one_line

        done, collector = self.state.step, self.collector
        # Generation under way for the next steps is part of the state: collected
        # now and saved, so a resumed run trains on exactly these samples.
        for batch in self.state.ahead if collector else ():
            collector.collect(batch)
        if self.queue is not None:
            self.state.data["rollout_queue"] = self.queue.save()
        loop = self.state.state_dict(collector.save if collector else None)
        try:
            partial = begin(self.run.dir, done)
            self._each_role("save_state", partial)
            sizes = {role.name: role.size for role in self.roles}
            torch.save({"loop": loop, "sizes": sizes}, f"{partial}/loop.pt")
            path = commit(partial, self.cfg.keep)
        except (OSError, RemoteCallError) as error:
            if isinstance(error, RemoteCallError) and error.proc_lost:
                raise
            raise CheckpointError(
                f"checkpoint after step {done} could not be written: {one_line(error)} "
                f"(newest valid checkpoint: {self.latest()})"
            ) from error
        self.saved_at = done
        return path

    def restore(self, path: str, counts: bool = True) -> int:
        """Every role's state and the loop's from the checkpoint at `path`; returns
        its step. `counts=False` keeps the ledger and counters (a rewind)."""
        import torch

        saved = torch.load(f"{path}/loop.pt", weights_only=False)
        for role in self.roles:
            elastic = role.name in self.run.meshes.elastic  # seeds are the samples', not its
            if (
                role.name in self.same_size
                and not elastic
                and saved["sizes"].get(role.name) != role.size
            ):
                raise ConfigError(
                    f"config key 'placement.{role.name}': the checkpoint {path} has "
                    f"{saved['sizes'].get(role.name)} {role.name} procs, this run {role.size}"
                )
        self._each_role("load_state", path)
        if self.after_restore is not None:
            self.after_restore()
        restore_batch = self.collector.restore if self.collector else None
        self.state.load_state_dict(saved["loop"], restore_batch, counts=counts)
        if self.queue is not None:
            self.queue.load(self.state.data.get("rollout_queue"))
        self.saved_at = self.state.step
        return self.state.step

    def resume(self) -> int | None:
        """With `checkpoint.resume`: restore the run's checkpoint and return its
        step; else None (a fresh run)."""
        if self.run.resume_from is None:
            return None
        step = self.restore(self.run.resume_from)
        print(f"resumed from {self.run.resume_from} at step {step}", flush=True)
        return step

    def rewind(self, lost, supervisor, log, samples_per_step: int) -> int:
        """A proc of a role whose state lives only in it (trainer, critic) died
        during step `state.step`: replace its procs, restore every role from the
        newest checkpoint and return its step, where the loop continues. Samples
        of the steps undone, and those generated ahead, count as dropped."""
        path = self.latest()
        if path is None:
            raise lost  # no checkpoint (checkpoint.every = 0)
        supervisor.spend_recovery(lost.role, lost)
        print(f"recovering {lost.role} from {path}: {lost}", flush=True)
        self.run.respawn(lost.role)
        ledger, step = self.state.ledger, self.state.step
        in_flight = 0
        for batch in self.state.ahead:  # generation for the steps being undone
            in_flight += len(batch)
            ledger.generated += 0 if batch.counted else len(batch)
        self.state.ahead = []
        if self.queue is not None:  # generated for the steps being undone
            self.queue.drop_all("trainer_rewind")
        back_to = self.restore(path, counts=False)
        self.run.report()  # actors' metrics of the undone steps belong to no step
        log.rewind(back_to)
        # Steps back_to .. step-1 were trained and are undone; step's samples never were.
        ledger.trained -= (step - back_to) * samples_per_step
        ledger.drop("trainer_rewind", (step + 1 - back_to) * samples_per_step + in_flight)
        return back_to
