"""Role meshes on a Monarch host, deadlines on remote calls, and clean shutdown.

`RoleMeshes(placement_counts)` spawns one proc mesh per role (its procs named
`procs`), gives each proc its share of the CPU cores, and stops every proc on
`stop()`, on leaving a `with` block, on error and on Ctrl-C. `wait(future,
"policy.generate")` is how the controller collects a result: it honours a
deadline, stays responsive to Ctrl-C, and turns an actor failure into a
`RemoteCallError` naming the role, the endpoint and the cause.
"""

from __future__ import annotations

import functools
import logging
import re
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from meshrl.config.files import ConfigError, first_paragraph
from meshrl.procs import faultlog, proc_pool

# (Their old home: callers import them from here.)
from meshrl.procs.faultlog import debugging, log_fault  # noqa: F401

# (Their old home: callers import them from here.)
from meshrl.procs.proc_pool import DEVICE_OFFSET_ENV, HOST_TAG_ENV, monarch_pids  # noqa: F401
from meshrl.procs.proc_pool import setup_proc as _setup_proc

logger = logging.getLogger(__name__)

POLL_S = 0.05

# In a Jupyter kernel an asyncio loop runs in the main thread, and Monarch warns
# (a log record and a UserWarning) at every blocking `Future.get()` there: dozens
# a step. The controller blocks on purpose, and its futures are driven by
# Monarch's own runtime, never by that loop, so the warning does not apply.
_BLOCKING_GET = (
    r"Future\.get\(\) (was )?called from within an active event loop"
    r"|Blocking get\(\) was called from a running asyncio event loop"
)
warnings.filterwarnings("ignore", message=_BLOCKING_GET)


class _NoBlockingGetWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not re.match(_BLOCKING_GET, str(record.msg))


logging.getLogger("monarch._src.actor.telemetry").addFilter(_NoBlockingGetWarning())


class RemoteCallError(RuntimeError):
    """A remote call failed, timed out, or its mesh lost a process. `what` names
    the call (`trainer.train_step[1]`); `role` is its first part."""

    def __init__(
        self,
        message: str,
        what: str = "",
        proc_lost: bool = False,
        stray: bool = False,
        timed_out: bool = False,
    ):
        super().__init__(message)
        self.what = what
        self.proc_lost = proc_lost
        """True when the proc behind the call died (Monarch supervision), False
        for an exception raised in the actor or a deadline."""
        self.timed_out = timed_out
        """True when the call did not answer within its deadline (it may still run)."""
        self.stray = stray
        """True when the call failed on Monarch's report that stopping *another*
        mesh failed (one meshrl replaced, whose node is gone): the call's own procs
        may be fine (`Supervisor.stray` asks them; elsewhere it counts as a loss)."""

    @property
    def role(self) -> str:
        return self.what.split(".")[0]


class RoleLost(RemoteCallError):
    """A proc of a role with no catch-up (`Supervisor.on_respawn`) died: its
    state is gone with it. The loop goes back to a checkpoint or ends."""

    def __init__(self, error: RemoteCallError, role: str):
        super().__init__(str(error), error.what, proc_lost=True)
        self.lost_role = role

    @property
    def role(self) -> str:
        return self.lost_role


def one_line(error: BaseException) -> str:
    """The error as one line: its own message for meshrl's errors (which name the
    key, file or call), else its type and first line."""
    if isinstance(error, OSError) and error.filename is None and error.strerror:
        return error.strerror  # meshrl's own (`cannot write FILE: ...`) or the OS's words
    if isinstance(error, (ConfigError, RemoteCallError, OSError)):
        return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    text = first_paragraph(error)  # a sentence wrapped over lines stays whole
    return (
        type(error).__name__ if text == type(error).__name__ else f"{type(error).__name__}: {text}"
    )


# --- faults --------------------------------------------------------------------------

LOST_STOP_S = 35.0
"""How long the stop of a mesh whose node is gone is waited for: Monarch gives up
after 30 s and reports the failure then."""

faults: list[str] = []
"""Mesh failures Monarch reported with no handler, oldest first (for inspection)."""


def _record_fault(failure: Any) -> None:
    """Monarch's unhandled-fault hook. Its default ends the client process; here
    the failure is recorded and written to the run's `faults.log` (the console
    shows one line per recovery, `Supervisor.recover`), and the call that needed
    the dead proc fails at the controller with a `RemoteCallError` instead."""
    text = str(failure).strip()
    faults.append(text)
    log_fault(f"mesh failure: {text or 'unknown'}")
    if faultlog.current() is None or debugging():
        logger.warning("mesh failure: %s", text.splitlines()[0] if text else "unknown")


def install_fault_hook() -> None:
    import monarch.actor

    monarch.actor.unhandled_fault_hook = _record_fault


def wait(future: Any, what: str, timeout_s: float) -> Any:
    """Block on a Monarch future for at most `timeout_s` seconds.

    Polls in short slices so that Ctrl-C is handled at once; an error inside
    the actor, or the death of its proc, raises `RemoteCallError` naming `what`.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return future.get(timeout=POLL_S)
        except TimeoutError:
            pass
        except Exception as error:
            # Monarch raises SupervisionError when the proc is gone, ActorError when
            # the endpoint raised.
            raise call_error(error, what) from error
        if proc_pool.lost and proc_pool.is_lost(what):  # seen gone before Monarch says
            gone = "its proc is gone (seen before Monarch's supervision says so)"
            raise RemoteCallError(f"{what} failed: {gone}", what, True)
        if time.monotonic() > deadline:
            raise RemoteCallError(
                f"{what} did not answer within {timeout_s:g}s", what, timed_out=True
            )


def call_error(error: BaseException, what: str) -> RemoteCallError:
    """What a Monarch future raised, as the `RemoteCallError` of call `what`."""
    lost = type(error).__name__ == "SupervisionError"
    # Seen under load on SLURM: the stop of a mesh on a lost node times out (Monarch
    # waits 30 s) and that report reaches a call on the mesh that replaced it.
    stray = lost and STOP_FAILED in str(error)
    # A lost proc's report says how it ended on its second line ("exited with
    # non-zero code 3", "Killed(sig=9)"): keep it, on one line.
    said = " ".join(str(error).split()) if lost else _first_line(error)
    return RemoteCallError(f"{what} failed: {said}", what, lost, stray)


STOP_FAILED = "error stopping proc mesh"
"""Monarch's words when stopping a proc mesh failed: meshrl stops only meshes it
replaced or is closing, so a call failing with them is not the loss of its procs."""


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    # Actor errors carry the remote traceback; its last line is the cause.
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    return lines[-1].strip() if "Traceback" in text else lines[0].strip()


def start_each(actors: Any, endpoint: str, args_per_rank: Sequence[tuple], skip: Any = ()) -> list:
    """Call `endpoint` on proc i of `actors` with `args_per_rank[i]`, all at once;
    returns the futures (collect them with `gather`), None for the ranks in `skip`."""
    return [
        None if i in skip else getattr(actors.slice(procs=i), endpoint).call_one(*args)
        for i, args in enumerate(args_per_rank)
    ]


def gather(futures: Sequence, what: str, timeout_s: float, done: dict | None = None) -> list:
    """The results of `start_each`'s futures in rank order.

    When calls fail, every future is still waited for, and a lost proc is
    reported before an exception: when one rank of a torch.distributed group
    dies, its peers fail first with a connection error of their own, but
    what happened is the lost proc. `done` (rank -> result) keeps each rank's
    result as it comes, also when another rank fails, and stands in for the
    ranks whose future is None (answered by an earlier call).
    """
    results, errors = [], []
    for i, future in enumerate(futures):
        if future is None:
            results.append(done[i])
            continue
        try:
            results.append(wait(future, f"{what}[{i}]", timeout_s))
            if done is not None:
                done[i] = results[-1]
        except RemoteCallError as error:
            errors.append(error)
    if errors:
        lost = [e for e in errors if e.proc_lost]
        raise next((e for e in lost if not e.stray), lost[0] if lost else errors[0])
    return results


def call_each(
    actors: Any, endpoint: str, args_per_rank: Sequence[tuple], what: str, timeout_s: float
) -> list:
    """Call `endpoint` on proc i of `actors` with `args_per_rank[i]`, all at once,
    and return the results in rank order."""
    return gather(start_each(actors, endpoint, args_per_rank), what, timeout_s)


def call_all(actors: Any, endpoint: str, *args: Any, what: str, timeout_s: float) -> list:
    """Call `endpoint` with the same arguments on every proc; results in rank order."""
    values = wait(getattr(actors, endpoint).call(*args), what, timeout_s)
    return [value for _, value in values.items()]


def form_groups(
    leaders: Any, followers: Any, replicas: int, tp: int, masters: list, timeout_s: float
) -> None:
    """Form `replicas` tensor-parallel groups of `tp` `Policy` actors each: leader i
    and followers i * (tp - 1) onwards, meeting at `masters[i]`
    (`RoleMeshes.rendezvous_each`). Every proc joins its group at once
    (`Policy.join`), then each leader takes its followers (`Policy.follow`)."""
    for future in [leaders.join.call(masters), followers.join.call(masters)]:
        wait(future, "policy.join", timeout_s)
    for i in range(replicas):
        group = followers.slice(procs=slice(i * (tp - 1), (i + 1) * (tp - 1)))
        wait(leaders.slice(procs=i).follow.call_one(group), "policy.follow", 600)


def split(items: Sequence, num_parts: int) -> list[list]:
    """Contiguous, nearly equal parts (order kept): shards for replicas."""
    size, extra = divmod(len(items), num_parts)
    parts, start = [], 0
    for i in range(num_parts):
        end = start + size + (1 if i < extra else 0)
        parts.append(list(items[start:end]))
        start = end
    return parts


# --- meshes --------------------------------------------------------------------------


class RoleMeshes:
    """One Monarch proc mesh per role, on this host or on a Monarch job's hosts.

    `counts` maps role -> procs per host, e.g. {"policy": 1, "trainer": 2}.
    `job` (a `meshrl.procs.job.JobConfig`) says where: `local` (default) puts every
    role on this host; the other kinds give each role `job.hosts[role]` hosts
    of its own. A role's ranks are numbered hosts-major and its actor mesh is
    flattened to one dimension, `procs`, so callers slice it the same way on
    one host or many. On a GPU host a host's roles take consecutive GPUs in
    the order given (policy 0.., then trainer ..), except `cpu_roles`: roles
    whose procs take no GPU (an environment's; none unless the caller says so).
    `share` maps a role to another whose procs it runs on (e.g. {"policy":
    "trainer"}: policy actors in the trainer's procs); it has no mesh of its own.
    `beside` maps a role to another on whose hosts its procs run (e.g. {"policy_tp":
    "policy"}: a tensor-parallel replica's other procs on its leader's host, where
    its all-reduces stay); it has procs of its own but no hosts of its own, and on
    a host with GPUs it takes those after the other role's.
    `busy_together` lists groups of roles whose procs compute at the same time
    (default: all of them); each proc gets the cores over the largest group.
    Use as a context manager, or call `stop()`.
    """

    def __init__(
        self,
        counts: dict[str, int],
        job: Any = None,
        threads_per_proc: int | None = None,
        cpu_roles: tuple[str, ...] = (),
        share: dict[str, str] | None = None,
        busy_together: list[tuple[str, ...]] | None = None,
        observe: Any = None,
        elastic: tuple[str, ...] = (),
        beside: dict[str, str] | None = None,
        metric_prefix: dict[str, str] | None = None,
        process_group_roles: set[str] | None = None,
        log_dir: str | None = None,
        checks: Any = None,
    ):
        from meshrl.procs.job import JobConfig, build_job, host_meshes

        install_fault_hook()
        self.job_cfg = job if job is not None else JobConfig()
        self.counts = dict(counts)
        self.share = dict(share or {})
        self.beside = dict(beside or {})
        self.hosts = {
            role: self.job_cfg.hosts_for(self.beside.get(role, role)) for role in self.counts
        }
        self.by_role: dict[str, Any] = {}
        """Role -> its proc mesh (an elastic role's: a `meshrl.procs.pool.ProcGroup`)."""
        self.watches: dict[str, Any] = {}  # role -> its procs' `Watch` actors
        # role -> a prefix for its actors' metrics (a player's meshes: "a/")
        self.metric_prefix: dict[str, str] = dict(metric_prefix or {})
        self.carried: list[dict] = []
        """Metrics of procs replaced while they lived on (a heal), for the next report."""
        self._stopping: list[threading.Thread] = []  # failed meshes' stops still under way
        self.pids: dict[str, list[int]] = {}
        """A role's own procs' pids by rank (not an elastic role's: its members have
        theirs), for the pid watch on this machine (`meshrl.procs.pool.Detector`)."""
        self.actors: dict[str, list] = {}  # role -> the actor meshes spawned on its procs
        self.process_group_roles = process_group_roles
        """Roles whose actors join a torch.distributed group (their multi-proc meshes
        are never pooled); None: unknown, so only single-proc meshes are."""
        self.grouped_roles: set[str] = set()
        """Roles whose procs, however few, joined a process group (a tensor-parallel
        policy replica's leader and followers): never pooled for reuse."""
        self.elastic = set(elastic) & set(self.counts)
        """Roles whose procs are a `meshrl.procs.pool.ProcGroup`: they can grow and shrink."""
        self.job: Any = None
        self.log_dir = log_dir  # SLURM jobs' output, hosts that join later included
        self._notices: Any = None  # the scheduler's notices (SLURM: `NoticeWatch`), once asked
        self.checks = checks
        """The preflight of every allocation (`meshrl.procs.health_checks.HostChecks`:
        `run(roles)` before any of their actors), its figures for status; None: none."""
        if checks is not None:
            checks.meshes = self
        self.observe = observe  # Monarch telemetry (`meshrl.observe.monarch.Observe`) or None
        # On one machine (local, process) the procs that compute at the same time
        # share its cores; elsewhere each proc takes its share of its own host's.
        shared = self.job_cfg.kind in ("local", "process")
        groups = busy_together or [tuple(self.counts)]
        busy = max(
            sum(
                self.counts[r] * self.hosts[r]
                for r in {self._own(r) for r in g}
                if r in self.counts
            )
            for g in groups
        )
        threads = threads_per_proc or (max(1, proc_pool.local_cores() // busy) if shared else None)
        device_offset = 0
        self._spawn_args: dict[str, tuple] = {}
        try:
            hosted = [role for role in self.counts if role not in self.beside]
            self.job = build_job(self.job_cfg, hosted, observe, cpu_roles, log_dir)
            self._hosts = host_meshes(self.job_cfg, self.job, hosted, observe)
            for role, count in self.counts.items():
                offset = device_offset
                if role in self.beside and self.job_cfg.kind != "local":
                    offset = self.counts[self.beside[role]]  # after its host role's, per host
                self._spawn_args[role] = (threads, count, offset)
                self._spawn_procs(role)
                # Separate hosts have GPUs of their own; local roles share this host's.
                if role not in cpu_roles and self.job_cfg.kind == "local":
                    device_offset += count
            if self.checks is not None:  # every host, before any role's actor runs there
                self.checks.run(list(self.counts))
            if self.job_cfg.kind == "slurm":  # the scheduler's notices to its jobs, asked now on
                from meshrl.procs.slurm_faults import NoticeWatch

                self._notices = NoticeWatch(self.job.allocations)
        except BaseException:
            self.stop()
            raise

    def scheduler_notices(self) -> list[tuple[str, str]]:
        """New notices of the scheduler to the job's allocations, as (mesh,
        "warning" | "terminated"): their procs are killed soon (SLURM's KillWait
        or GraceTime after "terminated"; at the time limit after "warning").
        None on one machine."""
        return self._notices.take() if self._notices is not None else []

    def requeue(self, mesh: str) -> None:
        """Ask the scheduler to start `mesh`'s allocation again after its time limit
        (the run goes on when it does: `meshrl.procs.slurm`)."""
        self.job.allocations.requeue(mesh)

    def joins_group(self, role: str, with_others: bool = False) -> None:
        """`role`'s actors join a torch.distributed group over its procs, or (with
        `with_others`) with another role's, however few its procs: never pooled."""
        if self.process_group_roles is not None:
            self.process_group_roles.add(self.share.get(role, role))
        if with_others:
            self.grouped_roles.add(role)

    def _pool_key(self, role: str) -> tuple | None:
        """What a pooled mesh must match to serve `role`, or None: not poolable
        (pooling off, hosts of a job, or several procs whose actors may have
        joined a torch.distributed group: see `process_group_roles`)."""
        threads, count, device_offset = self._spawn_args[role]
        # (Procs spawned before telemetry was on would not report to it.)
        if role in self.elastic:  # its members are pooled one by one
            return None
        if proc_pool.pool is None or self.job_cfg.kind != "local" or self.observe:
            return None
        if count > 1 and (self.process_group_roles is None or role in self.process_group_roles):
            return None
        if role in self.grouped_roles:  # a process group with another role's procs
            return None
        return (threads, count, device_offset, self.job_cfg.fork_server)

    def _spawn_procs(self, role: str) -> None:
        threads, count, device_offset = self._spawn_args[role]
        key = self._pool_key(role)
        mesh = proc_pool.pool.take(key) if key is not None else None
        if role in self.elastic:
            mesh = self._group(role)
        elif mesh is None:
            mesh = self._host_mesh(role).spawn_procs(
                per_host={"procs": count},
                bootstrap=functools.partial(
                    _setup_proc, threads, count, device_offset, self.job_cfg.kind != "local"
                ),
                name=role,
                bootstrap_command=self._bootstrap_command(),
            )
        self.by_role[role] = mesh
        self.actors[role] = []
        from meshrl.observe.telemetry import Watch

        self.watches[role] = self.spawn(role, "watch", Watch, role)
        # Its __init__ clears what earlier runs registered in a pooled proc: it must
        # be done before the role's actors register (spawning is asynchronous).
        if role not in self.elastic:
            # A loss seen of the procs these replace is theirs, not the new ones'.
            self.pids.pop(role, None)
            mine = {r for r in self.roles if self._own(r) == role}
            for key in [k for k in proc_pool.lost if k.split("[")[0] in mine]:
                proc_pool.lost.pop(key, None)
        answer = wait(self.watches[role].status.call(), f"{role}.watch", 60.0)
        if role not in self.elastic:
            self.pids[role] = [status["pid"] for _, status in answer.items()]

    def pid_of(self, role: str, rank: int) -> int | None:
        """The pid rank `rank` of `role`'s procs answered with when it was spawned
        (its Watch's first status), None when unknown."""
        pids = self.pids.get(self._own(role))
        if pids is not None:
            return pids[rank] if rank < len(pids) else None
        members = getattr(self.by_role.get(role), "members", None) or []
        return members[rank].pid if rank < len(members) else None

    def watched_pids(self) -> dict[str, list[int]]:
        """Each role's procs' pids by rank, a role that shares another's procs
        with theirs, elastic roles left out (`meshrl.procs.pool.Detector`)."""
        return {r: self.pids[self._own(r)] for r in self.roles if self._own(r) in self.pids}

    def _bootstrap_command(self) -> Any:
        """How Monarch starts a proc: a fork of this process's fork server on a
        job whose hosts are this machine (`local`, `process`; `job.fork_server`);
        on SLURM nodes and without the fork server, a fresh `job.python_exe` (this
        Python here) running `meshrl.procs.proc_main`; Monarch's default on
        Kubernetes, whose image may hold another Python."""
        from monarch._rust_bindings.monarch_hyperactor.host_mesh import BootstrapCommand

        from meshrl.procs import zygote

        kind = self.job_cfg.kind
        if kind in ("local", "process") and self.job_cfg.fork_server:
            return zygote.server().command()
        if kind not in ("local", "process", "slurm"):
            return None
        python = self.job_cfg.python_exe if kind == "slurm" else sys.executable
        return BootstrapCommand(python, None, ["-m", "meshrl.procs.proc_main"], {})

    def _group(self, role: str) -> Any:
        """An elastic role's procs, one mesh each (`meshrl.procs.pool.ProcGroup`)."""
        from meshrl.procs.pool import make_group, renew_slurm_hosts

        threads, count, offset = self._spawn_args[role]
        kind, keyed = self.job_cfg.kind, proc_pool.pool is not None and not self.observe

        def spawn_proc(host: Any, slot: int) -> Any:
            setup = functools.partial(_setup_proc, threads, count, offset + slot, kind != "local")
            return host.spawn_procs(
                per_host={"procs": 1},
                bootstrap=setup,
                name=role,
                bootstrap_command=self._bootstrap_command(),
            )

        def pool_key(slot: int) -> tuple | None:
            if not keyed or kind != "local":
                return None
            return (threads, 1, offset + slot, self.job_cfg.fork_server)

        group = make_group(
            role,
            self.job_cfg,
            self._host_mesh(role),
            count,
            spawn_proc,
            pool_key,
            wait,
            self.log_dir,
            self.vet(role, spawn_proc),
        )
        if kind == "slurm":
            group.renew = functools.partial(renew_slurm_hosts, self, role)
        group.grow(count * self.hosts[role])
        return group

    def vet(self, role: str, spawn_proc: Any = None) -> Any:
        """The preflight of one host that joins `role` (`HostChecks.joined`, with a
        proc of its own spawned by `spawn_proc`: the role's by default), or None
        without one."""
        if self.checks is None:
            return None
        if spawn_proc is None:
            spawn_proc = self.by_role[role].spawn_proc
        return functools.partial(self.checks.joined, role, spawn_proc)

    def scale(self, role: str, size: int) -> list[int]:
        """Grow or shrink an elastic role to `size` procs (the newest leave first;
        collect their work before); returns the new members' ranks."""
        group = self.by_role[role]
        if size > len(group):
            return group.grow(size - len(group))
        group.retire(list(range(size, len(group))))
        return []

    @property
    def roles(self) -> list[str]:
        """Every role, those sharing another's procs included."""
        return [*self.counts, *self.share]

    def _host_mesh(self, role: str) -> Any:
        """The hosts `role`'s procs run on: its own, or those of the role it runs
        beside (so it follows that role to a new allocation, whichever goes first)."""
        return self._hosts[self.beside.get(role, role)]

    def _own(self, role: str) -> str:
        return self.share.get(role, role)

    def respawn(
        self, role: str, timeout_s: float = 20.0, keep_old: bool = False
    ) -> Callable[[], None] | None:
        """Replace a role's proc mesh (after one of its procs died): stop what is
        left of it and spawn a fresh one on the same hosts. Actors must be spawned
        on it again, also those of roles sharing its procs. `keep_old`: the old
        procs that live on stay up until the returned function is called (new
        ranks read their state from a surviving one: `Supervisor.heal`)."""
        if role in self.share:
            raise RuntimeError(f"{role} runs in the {self.share[role]} procs: respawn those")
        if role in self.elastic:  # only its lost members
            group = self.by_role[role]
            group.replace(group.dead())
            return None
        old = self.by_role.pop(role)
        self.pids.pop(role, None)  # stopping: no longer watched
        if keep_old:
            watch, size = self.watches.get(role), self.size(role)
            # Seen gone by pid, it may not be by Monarch yet: not asked (no answer comes).
            live = [r for r in range(size) if not proc_pool.is_lost(f"{role}.report[{r}]")]
            self._spawn_procs(role)
            if self.checks is not None:
                self.checks.run([role])

            def stop_old() -> None:
                self._carry(role, watch, live)
                self._stop_failed(role, old, timeout_s)

            return stop_old
        # Its node (or its whole job: a requeue) is gone: a new allocation. SLURM ended
        # the old one's processes, so no answer to a stop can come; Monarch gives up on
        # it after 30 s, and nothing waits for that (twice per requeue before).
        hosts = self.beside.get(role, role)  # whose hosts its procs run on
        gone = self.job_cfg.kind == "slurm" and not self.job.allocations.alive(hosts)
        # Waited for past Monarch's own 30 s: the stop's failure then reaches the fault
        # hook while the run is up (`stop` joins this thread), not after its client
        # has stopped, where it ended a finished run's process with exit code 1.
        stopping = threading.Thread(
            target=self._stop_failed,
            args=(role, old, LOST_STOP_S if gone else timeout_s),
            daemon=True,
        )
        stopping.start()
        self._stopping.append(stopping)
        if gone:
            self._hosts[hosts] = self.job.reallocate(hosts)
        else:  # its live procs (on the same hosts) go before new ones start
            stopping.join()
        self._spawn_procs(role)
        if self.checks is not None:
            self.checks.run([role])

    def _carry(self, role: str, watch: Any, ranks: list[int], timeout_s: float = 5.0) -> None:
        """What the procs of `role` that live on recorded since the last report
        (the work they finished, which the loop keeps: a colocated replica's
        generation), carried into the next report before they stop."""
        if watch is None:
            return
        asked = {rank: watch.slice(procs=rank).report.call_one() for rank in ranks}
        prefix = self.metric_prefix.get(role, "")
        for rank, future in asked.items():
            try:
                metrics, _ = wait(future, f"{role}.watch.report[{rank}]", timeout_s)
            except RemoteCallError:
                continue  # the lost proc
            self.carried.append({prefix + key: value for key, value in metrics.items()})

    def keeps_survivors(self, role: str) -> bool:
        """Whether `respawn(role)` can keep the procs that live on up until the new
        ones have started: not on SLURM when a node of the role's job is gone (the
        job is cancelled and submitted anew, its other nodes with it)."""
        own = self._own(role)
        return not (self.job_cfg.kind == "slurm" and not self.job.allocations.alive(own))

    @staticmethod
    def _stop_failed(role: str, mesh: Any, timeout_s: float) -> None:
        try:
            mesh.stop().get(timeout=timeout_s)
        except BaseException as error:  # noqa: BLE001 - a mesh with a dead proc may not stop cleanly
            logger.warning("stopping the failed %s mesh: %s", role, error)

    def __getitem__(self, role: str) -> Any:
        return self.by_role[self._own(role)]

    def __contains__(self, role: str) -> bool:
        return self._own(role) in self.by_role

    def size(self, role: str) -> int:
        """Ranks of a role: hosts x procs per host (an elastic role's: as it is now)."""
        if self._own(role) in self.elastic and self._own(role) in self.by_role:
            return len(self.by_role[self._own(role)])
        return self.counts[self._own(role)] * self.hosts[self._own(role)]

    def spawn(self, role: str, name: str, actor_class: type, *args: Any, **kwargs: Any) -> Any:
        """One `actor_class` per proc of `role`, as a mesh with one dimension, `procs`."""
        actors = self[role].spawn(name, actor_class, *args, **kwargs)
        self.actors.setdefault(self._own(role), []).append(actors)
        return actors.flatten("procs") if "hosts" in actors.sizes else actors

    def rendezvous(self, role: str, timeout_s: float = 60.0) -> tuple[str, int]:
        """(address, port) of the role's rank 0 for torch.distributed: a store its
        proc 0 opens now and serves from then on (`parallel.Rendezvous`); when every
        host of the run is this one, a FileStore in a directory only this uid can
        open (`parallel.private_store`), removed at the latest with these meshes."""
        from meshrl.procs.parallel import Rendezvous, remove_with

        probe = self.spawn(role, "rendezvous", Rendezvous)
        loopback = self.job_cfg.kind in ("local", "process")
        answer = probe.slice(procs=0).address.call_one(loopback)
        return remove_with(self, tuple(wait(answer, f"{role}.rendezvous", timeout_s)))

    def rendezvous_each(self, role: str, timeout_s: float = 60.0) -> list[tuple[str, int]]:
        """`rendezvous` on every proc of `role`: one store per proc, for process
        groups that each proc leads (a tensor-parallel policy replica's)."""
        from meshrl.procs.parallel import Rendezvous, remove_with

        probe = self.spawn(role, "rendezvous_each", Rendezvous)
        loopback = self.job_cfg.kind in ("local", "process")
        answers = wait(probe.address.call(loopback), f"{role}.rendezvous", timeout_s)
        return [remove_with(self, tuple(address)) for _, address in answers.items()]

    def _give_back(self, role: str, mesh: Any, watch: Any, timeout_s: float) -> bool:
        """Stop `role`'s actors and give its procs to the pool, if they are poolable
        and alive; False when they must be stopped instead."""
        key = self._pool_key(role) if role in self._spawn_args else None
        if key is None or watch is None:
            return False
        try:
            status = wait(watch.status.call(), f"{role}.watch", 5.0)
            pids = {answer["pid"] for _, answer in status.items()}
            for actors in reversed(self.actors.get(role, [])):
                actors.stop().get(timeout=timeout_s)
        except BaseException as error:  # noqa: BLE001 - then the procs are stopped, not kept
            logger.debug("not pooling the %s procs: %s", role, error)
            return False
        proc_pool.pool.give(key, mesh, pids)
        return True

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop every proc, then the job's hosts (procs that a `ProcPool` keeps:
        their actors only). Safe to call twice; never raises."""
        meshes, self.by_role = self.by_role, {}
        watches, self.watches = self.watches, {}
        if self._notices is not None:
            self._notices.close()
            self._notices = None

        # One thread per mesh: a mesh's stop waits for its procs to exit (about a
        # second each with torch loaded), and Monarch drives a future only while
        # something waits on it, so waiting in turn would add the seconds up.
        def stop_one(role: str) -> None:
            if role in self.elastic:
                return meshes[role].close()
            if self._give_back(role, meshes[role], watches.get(role), timeout_s):
                return
            try:
                # Not `wait`: polling a `stop()` future with short timeouts cancels it.
                meshes[role].stop().get(timeout=timeout_s)
            except BaseException as error:  # noqa: BLE001 - best effort, keep stopping the rest
                logger.warning("could not stop %s mesh cleanly: %s", role, error)

        if meshes:
            with ThreadPoolExecutor(len(meshes), thread_name_prefix="meshrl-stop") as pool:
                list(pool.map(stop_one, meshes))
        # A failed mesh's stop (a lost node's: no answer comes) must end before the
        # job and Monarch's runtime do (see `respawn`).
        stopping, self._stopping = self._stopping, []
        for thread in stopping:
            thread.join(LOST_STOP_S + 5)
        job, self.job = self.job, None
        if job is not None:
            try:
                job.kill()
            except BaseException as error:  # noqa: BLE001
                logger.warning("could not stop the %s job cleanly: %s", self.job_cfg.kind, error)
        if self.observe is not None:
            self.observe.close()

    def report(self, timeout_s: float) -> tuple[dict[str, float], list[dict]]:
        """Every proc's metrics recorded since the last report, reduced across
        all meshes, and each proc's status. A mesh that does not answer (a proc
        lost since the loop last called it) is left out; the loop's next call
        to it recovers it."""
        from meshrl.observe.telemetry import reduce_partials

        futures = {role: watch.report.call() for role, watch in self.watches.items()}
        parts, procs = self.carried, []
        self.carried = []
        for role, future in futures.items():
            try:
                answers = wait(future, f"{role}.watch.report", timeout_s)
            except RemoteCallError as error:
                logger.warning("no report from the %s mesh: %s", role, error)
                continue
            prefix = self.metric_prefix.get(role, "")
            for _, (metrics, status) in answers.items():
                parts.append({prefix + key: value for key, value in metrics.items()})
                procs.append(status)
        return reduce_partials(parts), procs

    def status(self, timeout_s: float = 15.0) -> list[dict]:
        """Each proc of every mesh, asked now, one by one: its status, or `state`
        dead (its proc is gone) or unresponsive (no answer within `timeout_s`)."""
        asked = [
            (role, rank, self.watches[role].slice(procs=rank).status.call_one())
            for role in self.watches
            for rank in range(self.size(role))
        ]
        rows = []
        for role, rank, future in asked:
            try:
                answer = wait(future, f"{role}.watch[{rank}]", timeout_s)
                rows.append({**answer, "state": "alive", "rank": rank})  # its rank in the mesh
            except RemoteCallError as error:
                state = "dead" if error.proc_lost else "unresponsive"
                rows.append({"role": role, "rank": rank, "state": state, "error": str(error)})
        return rows

    def __enter__(self) -> RoleMeshes:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
