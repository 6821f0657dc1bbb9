"""A run: its directory, its meshes and their lifetime, and its stop request.

    with Run(cfg, "grpo", procs={"policy": 2, "trainer": 1}, trains=("trainer",)) as run:
        policy = run.spawn("policy", Policy, cfg.model)
        trainer = run.spawn("trainer", Trainer, cfg.model, rendezvous=True)
        ...

`Run` creates (or, resuming, reuses) the run directory, saves the resolved
config, spawns one proc mesh per role (`meshrl.procs.mesh.RoleMeshes`), writes
`status.json` from a thread, and on `close()` stops every proc and removes the
run's shared-memory weight files. `run.spawn` returns a `Role`: a handle on one
actor per proc that stays valid when the role's procs are replaced
(`run.respawn`). Ctrl-C and SIGTERM are this run's (`run.stop_request`), not the
process's, so runs one after another in a notebook kernel never share one.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import logging
import os
import signal
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from meshrl.config import ConfigError, save_config
from meshrl.loop import checkpoint
from meshrl.observe.metrics import make_run_dir
from meshrl.observe.monarch import Observe, merge_states
from meshrl.observe.profile import Profiler, take_request
from meshrl.observe.run_dir import make_private
from meshrl.observe.status import StatusFile
from meshrl.observe.status import table as status_table
from meshrl.procs import faultlog, mesh, slurm_faults
from meshrl.procs.health import HangWatch, Spec
from meshrl.procs.health_checks import HostChecks, on_hang
from meshrl.procs.mesh import RoleMeshes
from meshrl.procs.pool import Detector
from meshrl.procs.proc_pool import alive
from meshrl.weights.publisher import SHM_DIR

logger = logging.getLogger(__name__)


class StopRequest:
    """Ctrl-C and SIGTERM for one run.

    While the loop steps (`with stop.catching():`), the first signal asks it to
    stop at the end of the step (`requested`); a second one, or one outside the
    loop, raises KeyboardInterrupt at once. `request()` does what a signal does.
    """

    def __init__(self) -> None:
        self.requested = False

    def request(self, reason: str = "stop requested") -> None:
        if self.requested:
            raise KeyboardInterrupt(reason)
        self.requested = True
        print(f"\n{reason}: stopping at the end of this step (again to stop at once)", flush=True)

    def _handle(self, signum: int, frame: Any) -> None:
        self.request(signal.Signals(signum).name)

    @contextlib.contextmanager
    def catching(self) -> Iterator[StopRequest]:
        """Route SIGINT and SIGTERM (a scheduler's preemption) to this run while
        the block runs, in the main thread; the previous handlers come back after."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


class Role:
    """One actor per proc of a role's mesh, flat over hosts (`procs`).

    Endpoints are reached as on a Monarch actor mesh (`role.generate.call_one`,
    `role.slice(procs=i)`); the mesh behind them is replaced when the role's
    procs are (`Run.respawn`), and `respawns` counts how often."""

    def __init__(
        self,
        run: Run,
        name: str,
        make: Any,
        frozen_copy: bool = False,
        tensor_parallel: int = 1,
    ):
        self.name, self._run, self._make = name, run, make
        self.frozen_copy = frozen_copy
        """Its actors hold a frozen copy of the starting policy (a KL reference),
        as its spawn said: pulled from the trainer once, restored from checkpoints."""
        self.tensor_parallel = tensor_parallel
        """Procs per tensor-parallel group: they take the same rows (`shards`)."""
        self.actors = make()
        self.respawns = 0
        self.resizes = 0  # an elastic role's pool changes (`Run.scale`)
        self._slices: dict[tuple, Any] = {}

    @property
    def size(self) -> int:
        return self._run.meshes.size(self.name)

    @property
    def data_parallel(self) -> int:
        """Data-parallel ranks: groups of `tensor_parallel` procs."""
        return self.size // self.tensor_parallel

    def shards(self, batch: Any, rows: Any = None) -> list:
        """Per proc, its data-parallel shard of `batch` (`TrainBatch.shard`), the
        procs of one tensor-parallel group the same one. `rows(i)`: the rows of
        data-parallel rank i (default: contiguous blocks)."""
        return batch.shards(self.size, self.tensor_parallel, rows)

    def slice(self, **where: Any) -> Any:
        """A slice of the actors, kept: the loop slices every replica every step, and
        Monarch builds each slice's endpoints anew (about 0.35 ms on 2 cores)."""
        if getattr(self.actors, "elastic", False):  # members come and go; slicing is cheap
            return self.actors.slice(**where)
        key = tuple(sorted(where.items()))
        try:
            return self._slices[key]
        except KeyError:
            self._slices[key] = self.actors.slice(**where)
            return self._slices[key]
        except TypeError:  # an unhashable selection (a `slice`, before Python 3.12)
            return self.actors.slice(**where)

    def respawned(self) -> None:
        """Its procs were replaced: spawn its actors again (an elastic role's new
        members have them already)."""
        if not getattr(self.actors, "elastic", False):
            self.actors = self._make()
        self._slices = {}
        self.respawns += 1

    def __getattr__(self, endpoint: str) -> Any:
        if endpoint.startswith("_"):
            raise AttributeError(endpoint)
        return getattr(self.actors, endpoint)

    def __repr__(self) -> str:
        return f"Role({self.name!r}, procs={self.size}, respawns={self.respawns})"


class Run:
    """The run directory, the config saved in it, the meshes and their lifetime.

    `procs` maps each role to its procs per host (`job.hosts` gives the hosts);
    `share` maps a role to another whose procs it runs in (colocation); roles in
    `busy_together` compute at the same time and share the cores (see
    `RoleMeshes`); `elastic` roles' pools can grow and shrink (`scale`); `beside`
    maps a role to another on whose hosts its procs run. A role's other
    properties are said here too, never read from its name: `trains`, the roles
    whose procs hold gradients and optimizer state (the memory check sizes them
    so, `check_fits`); `cpu_only`, the roles that take no GPU (`RoleMeshes`'
    `cpu_roles`, and no `gpus-per-node` in their SLURM jobs). With
    `checkpoint.resume` the run continues in the checkpoint's directory
    (`resume_from`). Use as a context manager, or call `close()`; both are safe
    to call twice."""

    def __init__(
        self,
        cfg: Any,
        name: str,
        procs: dict[str, int],
        share: dict[str, str] | None = None,
        busy_together: list[tuple[str, ...]] | None = None,
        elastic: tuple[str, ...] = (),
        beside: dict[str, str] | None = None,
        trains: tuple[str, ...] = (),
        cpu_only: tuple[str, ...] = (),
        metric_prefix: dict[str, str] | None = None,
    ):
        self.cfg, self.name = cfg, name
        self.trains = trains
        self.elastic = tuple(role for role in elastic if role in procs)
        self.timeout_s = cfg.run.call_timeout_s
        if (
            cfg.job.kind == "local"
        ):  # before any proc starts (a process or SLURM job's hosts are their own)
            check_fits(procs, share or {}, cfg.model, trains)
        self.resume_from = find_resume(cfg)
        if self.resume_from is None:
            self.dir = make_run_dir(cfg.run.dir, cfg.run.name, name)
        else:  # <run dir>/checkpoints/step_N, its user's only again (0700)
            self.dir = make_private(
                os.path.dirname(os.path.dirname(os.path.abspath(self.resume_from)))
            )
        save_config(cfg, f"{self.dir}/config.yaml")
        faultlog.begin(f"{self.dir}/faults.log")  # mesh failures and recoveries in full
        faults = getattr(cfg, "faults", None)  # (`meshrl serve` and `meshrl eval` have none)
        if cfg.job.kind == "slurm":  # a quarantine is the run's (a notebook runs several)
            slurm_faults.begin_run(faults.quarantine_after if faults is not None else 2)
        self.stop_request = StopRequest()
        # Shared-memory weight files of this run's trainers, removed at `close`.
        self.shm_prefix = f"meshrl-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.roles: dict[str, Role] = {}
        self.status: StatusFile | None = None
        self.profiler: Profiler | None = None
        self.observe = Observe.of(cfg.run, alive)  # Monarch's telemetry and dashboard, if on
        health = getattr(cfg, "health", None)  # (`meshrl serve` and `meshrl eval` have none)
        self.meshes = RoleMeshes(
            procs,
            cfg.job,
            threads_per_proc=cfg.placement.threads_per_proc or None,
            cpu_roles=cpu_only,
            share=share,
            busy_together=busy_together,
            observe=self.observe,
            elastic=elastic,
            beside=beside,
            metric_prefix=metric_prefix,
            process_group_roles=set(),  # `spawn(..., rendezvous=True)` adds
            log_dir=f"{self.dir}/slurm",  # SLURM jobs' output
            checks=(
                HostChecks(None, preflight_spec(cfg, self.dir, trains), health)
                if health is not None and health.preflight
                else None
            ),
        )
        self.hangs: HangWatch | None = None
        if health is not None and health.hang_s > 0:
            python = cfg.job.python_exe if cfg.job.kind == "slurm" else sys.executable
            self.hangs = HangWatch(
                self.meshes, health.hang_s, functools.partial(on_hang, self.meshes, python)
            )
        self.workers: slurm_faults.WorkerWatch | None = None
        self.detector: Detector | None = None
        if faults is not None and faults.detect_s and cfg.job.kind == "slurm":
            self.workers = slurm_faults.WorkerWatch(self._watched, faults.detect_s)
        if faults is not None and faults.detect_s and cfg.job.kind in ("local", "process"):
            groups = self.meshes.by_role
            self.detector = Detector(
                lambda: {r: groups[r] for r in self.meshes.elastic if r in groups},
                faults.detect_s,
                self.meshes.watched_pids,
            )
        self.status = StatusFile(self.dir, self.proc_status, cfg.run.status_every_s)
        self.status.scheduler = self._scheduler_status
        if self.observe is not None:
            self.status.extra = self.observe.urls()
        self.status.start()
        if cfg.run.profile_steps:
            self.profiler = Profiler(
                self.dir, cfg.run.profile_steps, self.meshes, mesh.wait, self.timeout_s
            )

    def _scheduler_status(self) -> dict:
        """status.json's view of the allocations: SLURM's jobs and quarantined nodes,
        each host's preflight figures and the hosts it quarantined."""
        found = {} if self.meshes.checks is None else self.meshes.checks.status()
        if self.cfg.job.kind == "slurm":
            found["slurm"] = slurm_faults.where(self.meshes)
            found["quarantined"] = sorted(slurm_faults.quarantined)
        elif found.get("preflight_quarantined"):
            found["quarantined"] = sorted(found["preflight_quarantined"])
        return found

    def spawn(
        self,
        role: str,
        actor_class: type,
        *args: Any,
        rendezvous: bool = False,
        share: str | None = None,
        frozen_copy: bool = False,
        tensor_parallel: int = 1,
        grouped: bool = False,
        **kwargs: Any,
    ) -> Role:
        """One `actor_class(*args, **kwargs)` per proc of `role`. `rendezvous`:
        also `master=(address, port)` of rank 0 for torch.distributed, a fresh
        one each time the role is spawned again. `share`: `role` is a second actor
        on the procs of role `share` (spawned, replaced and stopped with them).
        `frozen_copy`: its actors will hold a frozen copy of the starting policy
        (`Role.frozen_copy`). `tensor_parallel`: procs per tensor-parallel group
        (they take the same rows: `Role.shards`). `grouped`: its procs, however
        few, join a process group with another role's (a tensor-parallel replica's
        leader and followers), so they are never pooled for reuse."""
        if share is not None:
            self.meshes.share[role] = self.meshes.share.get(share, share)

        if rendezvous:  # its actors form a torch.distributed group over its procs
            if self.meshes.share.get(role, role) in self.meshes.elastic:
                raise ValueError(f"{role}: an elastic role's procs form no process group")
            self.meshes.joins_group(role)
        if grouped:
            self.meshes.joins_group(role, with_others=True)

        def make() -> Any:
            extra = {"master": self.meshes.rendezvous(role)} if rendezvous else {}
            return self.meshes.spawn(role, role, actor_class, *args, **kwargs, **extra)

        try:
            self.roles[role] = handle = Role(self, role, make, frozen_copy, tensor_parallel)
        except BaseException:
            self.close()
            raise
        return handle

    def fixed_roles(self) -> dict[str, str]:
        """The roles whose pools cannot grow or shrink, each with why (`scale`)."""
        fixed = {}
        for role in self.roles:
            if role in self.meshes.elastic:
                continue
            if role in self.trains:
                fixed[role] = "its state lives in its procs"
            elif role in self.meshes.share:
                fixed[role] = f"it runs in {self.meshes.share[role]}'s procs"
            else:
                fixed[role] = "it is not pooled"
        return fixed

    def __contains__(self, role: str) -> bool:
        return role in self.roles

    def _watched(self) -> list[tuple[Any, Any]]:
        """Each SLURM allocation of the run, with what names the procs on its
        workers (`meshrl.procs.slurm_faults.WorkerWatch`): the roles' own jobs, and the
        one-node jobs of hosts that joined an elastic role's pool."""
        found = [
            (alloc, functools.partial(self._procs_on, name))
            for name, alloc in self.meshes.job.allocations.jobs.items()
        ]
        for role in self.meshes.elastic & set(self.meshes.by_role):
            for index, host in enumerate(list(self.meshes.by_role[role].hosts)):
                if host.job is not None:
                    # A joined host is a one-node job: whichever worker is down, it is this host.
                    procs = functools.partial(self._members_on, role, [index])
                    found += [
                        (alloc, lambda _down, procs=procs: procs())
                        for alloc in host.job.allocations.jobs.values()
                    ]
        return found

    def _procs_on(self, mesh_name: str, workers: list[int] | None) -> list[str]:
        """`role[rank]` of the procs on those workers (hosts) of host mesh
        `mesh_name`'s own job (None: all), every role sharing them included."""
        if mesh_name in self.meshes.elastic:  # its members one by one, on their hosts
            group = self.meshes.by_role.get(mesh_name)
            own = [i for i, h in enumerate(group.hosts) if h.job is None] if group else []
            return self._members_on(mesh_name, [i for i in own if workers is None or i in workers])
        roles = [r for r in self.meshes.roles if self.meshes.share.get(r, r) == mesh_name]
        return [f"{r}[{rank}]" for r in roles for rank in range(self.meshes.size(mesh_name))]

    def _members_on(self, role: str, hosts: list[int]) -> list[str]:
        """`role[rank]` of an elastic role's members on those of its pool's hosts,
        every role sharing its procs included."""
        group = self.meshes.by_role.get(role)
        ranks = [r for r, m in enumerate(group.members) if m.host in hosts] if group else []
        roles = [r for r in self.meshes.roles if self.meshes.share.get(r, r) == role]
        return [f"{r}[{rank}]" for r in roles for rank in ranks]

    def respawn(self, role: str, handoff: Callable[[list[Role]], None] | None = None) -> list[Role]:
        """Replace the procs `role` runs in (after one of them died) and spawn
        again the actors of every role in them; returns those roles. `handoff(roles)`
        runs once they are spawned, while the old procs that live on are still up
        (their state goes to the new ones: `Supervisor.heal`); then those stop."""
        own = self.meshes.share.get(role, role)
        if self.workers is not None and own not in self.meshes.elastic:
            # (An elastic role's replaced members clear their own, `meshrl.procs.pool`.)
            self.workers.forget(
                self.meshes.job.allocations.jobs.get(own), self._procs_on(own, None)
            )
        stop_old = self.meshes.respawn(own, keep_old=handoff is not None)
        again = [h for r, h in self.roles.items() if self.meshes.share.get(r, r) == own]
        try:
            for handle in sorted(again, key=lambda h: h.name != own):  # its own role first
                handle.respawned()
            if handoff is not None:
                handoff(again)
        finally:
            if stop_old is not None:
                stop_old()
        return again

    def scale(self, role: str, size: int) -> list[int]:
        """Grow or shrink an elastic role to `size` procs: new members get every
        actor its others have; the newest leave first (collect their work
        before). Returns the new members' ranks (they have no weights yet)."""
        if role not in self.meshes.elastic:
            raise ValueError(f"{role} is not elastic here")
        new = self.meshes.scale(role, size)
        for handle in self.roles.values():
            if self.meshes.share.get(handle.name, handle.name) == role:
                handle.resizes += 1
        return new

    def report(self) -> tuple[dict[str, float], list[dict]]:
        """What every actor recorded since the last report, reduced over the
        meshes (`meshrl.observe.telemetry`), and each proc's status."""
        return self.meshes.report(self.timeout_s)

    def mesh_status(self, timeout_s: float = 15.0, show: bool = True) -> list[dict]:
        """Ask every proc of every mesh now: its actors, their weight versions, the
        endpoint under way, the last call; a proc that is gone shows as dead.
        Prints the table (`show`) and returns one dict per proc."""
        procs = self.proc_status(timeout_s)
        if show:
            print(status_table(procs))
        return procs

    def proc_status(self, timeout_s: float = 15.0) -> list[dict]:
        """Each proc's status (`RoleMeshes.status`), with Monarch's state of its
        actors when telemetry is on (`meshrl.observe.monarch.merge_states`)."""
        procs = self.meshes.status(timeout_s)
        if self.observe is not None:
            try:
                merge_states(procs, self.observe.actor_states(timeout_s))
            except Exception as error:  # noqa: BLE001 - a view; meshrl's own stays
                logger.warning("Monarch's telemetry did not answer: %s", error)
        return procs

    def step_begins(self, step: int) -> None:
        """`step` opens (`StepLog.begin_step`, which `Steps` calls): start profiling if due."""
        if self.profiler is None or not self.profiler.on:
            steps = take_request(self.dir, step)  # `meshrl profile RUN_DIR`
            if steps is not None:
                self.profiler = Profiler(self.dir, steps, self.meshes, mesh.wait, self.timeout_s)
        if self.profiler is not None:
            self.profiler.begin(step)

    def step_ends(self, step: int, start: float, end: float, metrics: dict) -> None:
        """`step` was logged: its record into Monarch's telemetry; end profiling if due."""
        if self.observe is not None:
            self.observe.step(step, start, end, metrics)
        if self.profiler is not None:
            self.profiler.end(step, start, end)

    def close(self) -> None:
        """Stop every proc this run spawned and remove its shared-memory files."""
        if self.profiler is not None:
            try:
                self.profiler.finish()  # a run that stopped inside the profiled steps
            except Exception as error:  # noqa: BLE001 - closing goes on
                print(f"profile not written: {error}", flush=True)
        if self.hangs is not None:
            self.hangs.close()  # before the meshes go: their procs stop answering
        if self.status is not None:
            self.status.stop()  # before the meshes go: it asks their procs
        if self.detector is not None:
            self.detector.close()
        if self.workers is not None:
            self.workers.close()
        self.meshes.stop()
        if faultlog.path == f"{self.dir}/faults.log":
            faultlog.end(faultlog.path)
        # A proc that was killed could not remove its shared-memory files.
        for path in glob.glob(f"{SHM_DIR}/{self.shm_prefix}-*"):
            os.unlink(path)

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


PROC_BYTES = 450 << 20
"""What one proc holds before any model: Python, torch, transformers and Monarch
(450-550 MB resident, measured on this project's CPU procs)."""


def machine_bytes() -> int:
    """This machine's memory, or its cgroup's limit when lower (a container)."""
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total


def check_fits(
    procs: dict[str, int], share: dict[str, str], model: Any, trains: tuple[str, ...] = ()
) -> None:
    """A placement whose procs cannot all live in this machine's memory is one
    line naming the key, before any proc starts (spawning them first took
    minutes to fail). Each proc: `PROC_BYTES` and its copy of the weights; a
    proc of a role in `trains` (a trainer, a critic: `Run`'s `trains`) also its
    gradients and Adam's two moments."""
    from meshrl.model.models import weight_bytes

    weights = weight_bytes(model)
    own = {role: n for role, n in procs.items() if role not in share}
    need = sum(n * (PROC_BYTES + weights * (4 if role in trains else 1)) for role, n in own.items())
    have = machine_bytes()
    if need > have:
        counts = ", ".join(f"{role}={n}" for role, n in own.items())
        raise ConfigError(
            f"config key 'placement': {sum(own.values())} procs ({counts}) need about "
            f"{need / 2**30:.1f} GB of memory; this machine has {have / 2**30:.1f} GB"
        )


def preflight_spec(cfg: Any, run_dir: str, trains: tuple[str, ...]) -> Spec:
    """What each host's preflight checks: the model's dtype, the run directory and
    the next checkpoint's size there (the weights, and for a run that trains Adam's
    two moments), the GPUs a SLURM node was asked for."""
    from meshrl.model.models import weight_bytes

    model = getattr(cfg, "model", None)
    weights = weight_bytes(model) if model is not None else 0
    return Spec(
        dtype=getattr(model, "dtype", "float32"),
        run_dir=run_dir,
        need_bytes=weights * (3 if trains else 1),
        matmul_s=cfg.health.preflight_s if getattr(cfg, "health", None) else 0.3,
        expected_devices=cfg.job.gpus_per_node,
    )


def find_resume(cfg: Any) -> str | None:
    """The checkpoint to continue from, per `checkpoint.resume`, or None."""
    resume = cfg.checkpoint.resume
    if resume != "auto":
        return resume or None
    if not cfg.run.name:
        raise ConfigError("config key 'checkpoint.resume': 'auto' needs run.name (the run)")
    return checkpoint.latest(os.path.join(cfg.run.dir, cfg.run.name))
