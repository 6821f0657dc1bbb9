"""Elastic roles: one single-proc Monarch mesh per replica, so a pool can grow
and shrink while the run goes on.

Monarch 0.7 adds no procs to a proc mesh, and no hosts to a running job. So an
elastic role (policy, environment) is a `ProcGroup`: a list of members, each a
proc mesh of one proc, that looks like one proc mesh to the rest of meshrl.
`ProcGroup.spawn` returns a `PoolActors`, which answers as an actor mesh with
one dimension, `procs` (`slice(procs=i)`, `endpoint.call()` with its answers
in rank order). Each spawn is recorded and done again on every member that
joins later, so a new replica has the same actors as the others. On a
`process`, `slurm` or `kubernetes` job, members past its hosts go on hosts that
join through a one-host Monarch job of the same kind (`add_host`), stopped when
their last member leaves.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from meshrl.procs import proc_pool

logger = logging.getLogger(__name__)


class ScaleError(ValueError):
    """A pool size that cannot be: one line naming the role and the limit."""


# --- the facade: members' actors as one mesh ----------------------------------------


class PoolValues:
    """The answers of every member, in rank order (as Monarch's `ValueMesh`)."""

    def __init__(self, values: list):
        self.values = values

    def items(self) -> list[tuple[dict, Any]]:
        return [({"procs": rank}, value) for rank, value in enumerate(self.values)]

    def __len__(self) -> int:
        return len(self.values)


class PoolFuture:
    """One endpoint call on every member. `get(timeout)` keeps the answers that
    came, so polling it in short slices (`meshrl.procs.mesh.wait`) never asks twice; a
    member's error (its exception, as Monarch raised it) is raised as is."""

    def __init__(self, futures: list):
        self.futures = futures
        self.done: dict[int, Any] = {}

    def get(self, timeout: float | None = None) -> PoolValues:
        deadline = None if timeout is None else time.monotonic() + timeout
        for rank, future in enumerate(self.futures):
            if rank not in self.done:
                left = None if deadline is None else max(0.001, deadline - time.monotonic())
                self.done[rank] = future.get(timeout=left)
        values = []
        for rank in range(len(self.futures)):
            answer = self.done[rank]
            items = answer.items() if hasattr(answer, "items") else [(None, answer)]
            values += [value for _, value in items]
        return PoolValues(values)


class PoolEndpoint:
    def __init__(self, meshes: list, name: str):
        self.meshes, self.name = meshes, name

    def call(self, *args: Any, **kwargs: Any) -> PoolFuture:
        return PoolFuture([getattr(m, self.name).call(*args, **kwargs) for m in self.meshes])

    def call_one(self, *args: Any, **kwargs: Any) -> Any:
        if len(self.meshes) != 1:
            raise ValueError(f"call_one on {len(self.meshes)} procs: slice one first")
        return getattr(self.meshes[0], self.name).call_one(*args, **kwargs)


class PoolActors:
    """One actor mesh per member, addressed as one mesh over `procs`. `spares()`:
    the same actors on the role's standbys (not addressed by rank)."""

    elastic = True

    def __init__(self, meshes: list, spares: Callable[[], list] = list):
        self.meshes, self.spares = meshes, spares

    @property
    def sizes(self) -> dict[str, int]:
        return {"procs": len(self.meshes)}

    def slice(self, procs: int) -> Any:
        if not isinstance(procs, int):
            raise TypeError("an elastic role is sliced one proc at a time: slice(procs=i)")
        return self.meshes[procs]

    def stop(self) -> PoolFuture:
        return PoolFuture([m.stop() for m in self.meshes])

    def __getattr__(self, endpoint: str) -> PoolEndpoint:
        if endpoint.startswith("_"):
            raise AttributeError(endpoint)
        return PoolEndpoint(self.meshes, endpoint)


# --- the members --------------------------------------------------------------------


@dataclass
class Member:
    mesh: Any
    host: int  # index into ProcGroup.hosts
    slot: int  # its proc index on that host (its GPU offset there)
    key: tuple | None  # the `ProcPool` key it may be given back under
    actors: list = field(default_factory=list)  # one actor mesh per recorded spawn
    pid: int | None = None  # its proc's, once its Watch answered


@dataclass
class Host:
    mesh: Any  # a Monarch HostMesh of one host
    job: Any = None  # the Monarch job it joined through (None: the run's own)


@dataclass
class Spawn:
    name: str
    cls: type
    args: tuple
    kwargs: dict
    actors: PoolActors


class ProcGroup:
    """A role's procs, one single-proc mesh each (see the module docstring).

    `hosts`: the role's Monarch host meshes (one host each), `per_host` procs
    each. `spawn_proc(host_mesh, slot)` spawns a proc mesh of one proc;
    `pool_key(slot)` is the `ProcPool` key a member may be taken from and given
    back under (None: never). `add_host()` returns a `Host` that joins the job
    (None: this job cannot grow); `limit` caps the members. The first actor
    spawned on every member is its `Watch`: it is waited for before the others
    are spawned (its __init__ clears a reused proc's registry)."""

    def __init__(
        self,
        role: str,
        hosts: list[Host],
        per_host: int,
        spawn_proc: Callable[[Any, int], Any],
        pool_key: Callable[[int], tuple | None],
        limit: int,
        limit_reason: str,
        wait: Callable[[Any, str, float], Any],
        add_host: Callable[[int], Host] | None = None,
        timeout_s: float = 60.0,
    ):
        self.role, self.hosts, self.per_host = role, hosts, per_host
        self.spawn_proc, self.pool_key, self.add_host = spawn_proc, pool_key, add_host
        self.limit, self.limit_reason, self.timeout_s = limit, limit_reason, timeout_s
        self.wait = wait  # `meshrl.procs.mesh.wait`
        self.members: list[Member] = []
        self.spawns: list[Spawn] = []
        self.renew: Callable[[list[Host]], None] | None = None
        """Replaces the hosts that are gone (lost nodes, a requeued job: SLURM) in place."""
        self.standby = 0  # spare procs to keep (`faults.standby.<role>`)
        self.standbys: list[Member] = []  # spawned with every actor, given no rank

    def __len__(self) -> int:
        return len(self.members)

    def spawn(self, name: str, cls: type, *args: Any, **kwargs: Any) -> PoolActors:
        """`cls(*args, **kwargs)` on every member, now and on each that joins later."""
        meshes = []
        for member in self.members:
            member.actors.append(member.mesh.spawn(name, cls, *args, **kwargs))
            meshes.append(member.actors[-1])
        index = len(self.spawns)
        actors = PoolActors(
            meshes, lambda: [m.actors[index] for m in self.standbys if len(m.actors) > index]
        )
        self.spawns.append(Spawn(name, cls, args, kwargs, actors))
        if len(self.spawns) == 1:  # the Watches
            for rank, member in enumerate(self.members):
                self._ready(member, rank)
        return actors

    def _ready(self, member: Member, rank: int) -> None:
        """A member's Watch answers, and tells its proc its rank in the role (before
        any other actor starts there: they read it, e.g. a replica's seed)."""
        what = f"{self.role}.{self.spawns[0].name}[{rank}]"
        answer = self.wait(member.actors[0].status.call(), what, self.timeout_s)
        member.pid = next(status["pid"] for _, status in answer.items())
        self.wait(member.actors[0].set_rank.call(rank), what, self.timeout_s)

    # --- growing, shrinking, replacing ------------------------------------------------

    def _free_slot(self) -> tuple[int, int]:
        taken = {(m.host, m.slot) for m in [*self.members, *self.standbys]}
        for host in range(len(self.hosts)):
            for slot in range(self.per_host):
                if (host, slot) not in taken:
                    return host, slot
        if self.add_host is None:
            raise ScaleError(f"scale: {self.role}: no free proc slot on this job's hosts")
        self.hosts.append(self.add_host(len(self.hosts)))
        return len(self.hosts) - 1, 0

    def _start(self, host: int, slot: int) -> Member:
        key = self.pool_key(slot) if self.hosts[host].job is None else None
        mesh = proc_pool.pool.take(key) if key is not None and proc_pool.pool else None
        if mesh is None:
            mesh = self.spawn_proc(self.hosts[host].mesh, slot)
        return Member(mesh, host, slot, key)

    def _join(self, member: Member, rank: int) -> None:
        """Spawn the recorded actors on a new member (its Watch first, waited for)."""
        for i, spawn in enumerate(self.spawns):
            actors = member.mesh.spawn(spawn.name, spawn.cls, *spawn.args, **spawn.kwargs)
            member.actors.append(actors)
            if i == 0:
                self._ready(member, rank)

    def _publish(self) -> None:
        """Every recorded spawn's facade lists the members' actors in rank order."""
        for i, spawn in enumerate(self.spawns):
            spawn.actors.meshes[:] = [m.actors[i] for m in self.members]

    def grow(self, count: int) -> list[int]:
        """`count` new members (their procs spawned side by side), each with every
        recorded actor; returns their ranks."""
        if len(self.members) + count > self.limit:
            raise ScaleError(
                f"scale: {self.role}={len(self.members) + count}: past this job's limit "
                f"of {self.limit} ({self.limit_reason})"
            )
        new = []
        try:
            for _ in range(count):  # spawning is asynchronous: the procs boot together
                new.append(self._start(*self._free_slot()))
                self.members.append(new[-1])
            for member in new:
                self._join(member, self.members.index(member))
        except BaseException:
            for member in new:
                self.members.remove(member)
                self._stop_members([member])
            self._release_hosts()
            raise
        self._publish()
        return [self.members.index(m) for m in new]

    def retire(self, ranks: list[int]) -> None:
        """Stop these members (their work collected first, by the caller)."""
        gone = [self.members[r] for r in ranks]
        self.members = [m for m in self.members if m not in gone]
        self._publish()
        self._stop_members(gone)
        self._release_hosts()

    def replace(self, ranks: list[int]) -> None:
        """New procs in place of these members (lost ones), at the same ranks: a
        standby when there is one (spawned and loaded already), else a fresh
        proc. The standbys are filled up again in the background."""
        if ranks and self.renew is not None and not self.standbys:
            self.renew(self.hosts)
        for rank in ranks:
            old = self.members[rank]
            threading.Thread(target=self._stop_members, args=([old], False), daemon=True).start()
            proc_pool.lost.pop(f"{self.role}[{rank}]", None)
            if self.standbys:
                self.members[rank] = self.standbys.pop(0)
                self._ready(self.members[rank], rank)
            else:
                self.members[rank] = self._start(old.host, old.slot)
                self._join(self.members[rank], rank)
        self._publish()
        self.fill_standbys()

    def fill_standbys(self) -> None:
        """Spawn standbys up to `standby`: their procs boot and their actors load
        while the run goes (nothing waits for them here)."""
        while len(self.standbys) < self.standby:
            host, slot = self._free_slot()
            member = Member(self.spawn_proc(self.hosts[host].mesh, slot), host, slot, None)
            for spawn in self.spawns:
                member.actors.append(
                    member.mesh.spawn(spawn.name, spawn.cls, *spawn.args, **spawn.kwargs)
                )
            self.standbys.append(member)

    def dead(self, timeout_s: float = 5.0) -> list[int]:
        """Ranks of members whose proc is gone: by its pid on this machine, else
        because its Watch does not answer."""
        gone = [r for r, m in enumerate(self.members) if f"{self.role}[{r}]" in proc_pool.lost]
        if gone:
            return gone
        futures = [m.actors[0].status.call() for m in self.members]
        lost = []
        for rank, future in enumerate(futures):
            try:
                future.get(timeout=timeout_s)
            except Exception as error:  # noqa: BLE001 - any failure: replace it
                logger.info("%s[%d] is lost: %s", self.role, rank, error)
                lost.append(rank)
        return lost

    # --- stopping ---------------------------------------------------------------------

    def _stop_members(self, members: list[Member], pool: bool = True) -> None:
        def stop(member: Member) -> None:
            if pool and self._give_back(member):
                return
            try:
                member.mesh.stop().get(timeout=self.timeout_s)
            except BaseException as error:  # noqa: BLE001 - best effort, keep stopping
                logger.warning("could not stop a %s proc cleanly: %s", self.role, error)

        if members:
            with ThreadPoolExecutor(len(members), thread_name_prefix="meshrl-pool") as threads:
                list(threads.map(stop, members))

    def _give_back(self, member: Member) -> bool:
        """Stop a live member's actors and keep its proc in the `ProcPool`."""
        if member.key is None or proc_pool.pool is None or not member.actors:
            return False
        try:
            answer = member.actors[0].status.call().get(timeout=5.0)
            pids = {status["pid"] for _, status in answer.items()}
            for actors in reversed(member.actors):
                actors.stop().get(timeout=self.timeout_s)
        except BaseException as error:  # noqa: BLE001 - then the proc is stopped instead
            logger.debug("not pooling a %s proc: %s", self.role, error)
            return False
        proc_pool.pool.give(member.key, member.mesh, pids)
        return True

    def _release_hosts(self) -> None:
        """Stop joined hosts that no member uses any more (the last ones only, so
        that host indices stay valid)."""
        used = {m.host for m in [*self.members, *self.standbys]}
        while self.hosts and self.hosts[-1].job is not None and len(self.hosts) - 1 not in used:
            stop_host(self.hosts.pop(), self.role)
        if not used:  # closing: joined hosts that replaced lost ones too
            for host in self.hosts:
                stop_host(host, self.role)

    def close(self) -> None:
        """Stop every member (give the poolable ones back) and standby, then the
        joined hosts."""
        members, self.members = self.members, []
        standbys, self.standbys = self.standbys, []
        self._stop_members(members + standbys)
        self._release_hosts()


def stop_host(host: Host, role: str) -> None:
    """Stop a joined host's job (none for the run's own hosts)."""
    if host.job is None:
        return
    try:
        host.job.kill()
    except BaseException as error:  # noqa: BLE001
        logger.warning("could not stop a joined %s host: %s", role, error)
    host.job = None


_renewals = itertools.count(1)  # names of the hosts that replace lost SLURM hosts


def renew_slurm_hosts(meshes: Any, role: str, hosts: list[Host]) -> None:
    """`ProcGroup.renew` on SLURM (`meshes`: the run's `RoleMeshes`): a job that
    SLURM requeued is waited for (it starts again as the same job); a lost node's
    host is replaced by a one-node allocation that joins (the role's other nodes
    keep serving). Joined hosts that are gone are replaced the same way."""
    from meshrl.procs.slurm_faults import note_lost

    allocations, own = meshes.job.allocations, meshes.hosts[role]
    if allocations.requeued(role):
        mesh = meshes._hosts[role] = meshes.job.reallocate(role)
        hosts[:own] = [Host(mesh.slice(hosts=h)) for h in range(own)]
    else:
        note_lost(allocations.dead_nodes(role))
    for index, host in enumerate(hosts):
        if host.job is None:  # one of the role's own nodes
            if allocations.worker_alive(role, index):
                continue
        else:  # a joined host: a one-node job of its own
            joined = next(iter(host.job.meshes))
            if host.job.allocations.alive(joined):
                continue
            note_lost(host.job.allocations.dead_nodes(joined))
        stop_host(host, role)
        name = f"{index}r{next(_renewals)}"
        hosts[index] = join_checked(
            lambda name=name: join_host(meshes.job_cfg, role, name, meshes.log_dir),
            meshes.vet(role),
            role,
        )


def make_group(
    role: str,
    job: Any,
    host_mesh: Any,
    per_host: int,
    spawn_proc: Callable[[Any, int], Any],
    pool_key: Callable[[int], tuple | None],
    wait: Callable[[Any, str, float], Any],
    log_dir: str | None = None,
    vet: Callable[[Host], str | None] | None = None,
) -> ProcGroup:
    """An empty `ProcGroup` for `role` on its job's hosts (`job`: a JobConfig; the
    SLURM output of hosts that join it in `log_dir`; `vet`: the preflight each
    joining host passes first, `join_checked`)."""
    limit, reason = limit_of(job, role, per_host)
    if job.kind == "local":  # one host: a slot per proc it may have, and spares
        hosts, slots = [Host(host_mesh)], limit + 64
    else:
        hosts = [Host(host_mesh.slice(hosts=h)) for h in range(job.hosts_for(role))]
        slots = per_host
    add = None
    if job.kind != "local":

        def add(index: int) -> Host:
            return join_checked(lambda: join_host(job, role, f"{index}", log_dir), vet, role)

    return ProcGroup(role, hosts, slots, spawn_proc, pool_key, limit, reason, wait, add)


JOIN_TRIES = 3
"""Hosts that may fail the preflight in a row before a join gives up."""


def join_checked(
    make: Callable[[], Host], vet: Callable[[Host], str | None] | None, role: str
) -> Host:
    """A host that joins (`make()`: a pool that grows, a one-node job in place of a
    lost node), checked by `vet` (the preflight of that one host, judged against the
    run's first allocation: the finding's line, the host quarantined, or None)
    before any member is spawned there. A host that fails is stopped and another
    joins in its place (on SLURM the quarantined node is excluded), `JOIN_TRIES`
    times; then the join fails in one line naming the last host and its check."""
    for _ in range(JOIN_TRIES):
        host = make()
        try:
            finding = vet(host) if vet is not None else None
        except BaseException:
            stop_host(host, role)
            raise
        if finding is None:
            return host
        stop_host(host, role)
    raise ScaleError(
        f"scale: {role}: {JOIN_TRIES} hosts in a row failed the preflight; the last: {finding}"
    )


def join_host(job_cfg: Any, role: str, index: str, log_dir: str | None = None) -> Host:
    """A host that joins the run for `role`: a one-host Monarch job of the run's
    kind (`meshrl.procs.job.joining_job`; its SLURM output in `log_dir`), stopped
    with its last member."""
    from meshrl.procs.job import joining_job

    job, name = joining_job(job_cfg, role, index, log_dir)
    try:
        return Host(getattr(job.state(cached_path=None), name), job)
    except BaseException:
        job.kill()
        raise


def limit_of(job: Any, role: str, per_host: int) -> tuple[int, str]:
    """How many procs `role` may be scaled to on this job, and why: `job.max_procs`
    when given (past the job's hosts, hosts join: `join_host`); else the hosts x
    procs per host it started with, or on one local host without GPUs its cores."""
    import os

    import torch

    fixed = job.hosts_for(role) * per_host
    given = job.max_procs.get(role)
    if given:
        return given, f"job.max_procs.{role}={given}"
    if job.kind != "local":
        return fixed, f"job.hosts.{role} x placement.{role}; job.max_procs.{role} allows more"
    if torch.cuda.is_available():  # each takes a GPU: the others' are not known here
        return fixed, f"placement.{role} on a GPU host; job.max_procs.{role} allows more"
    cores = os.cpu_count() or 1
    if fixed > cores:
        return fixed, f"placement.{role}; job.max_procs.{role} allows more"
    return cores, f"this host's {cores} cores; job.max_procs.{role} allows more"


class Detector:
    """Sees a proc gone within `every_s` (Monarch's supervision says so about 10 s
    later): every `every_s` it checks the pid of each elastic role's member and of
    each proc of the other roles (`pids`: role -> pids by rank) on this machine
    (`local` and `process` jobs) and enters the dead ones in `proc_pool.lost`,
    which fails the calls waiting on them (`meshrl.procs.mesh.wait`)."""

    def __init__(
        self,
        groups: Callable[[], dict[str, ProcGroup]],
        every_s: float,
        pids: Callable[[], dict[str, list[int]]] = dict,
    ):
        self.groups, self.every_s, self.pids = groups, every_s, pids
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="meshrl-detect", daemon=True)
        self._thread.start()

    def watched(self) -> dict[str, int]:
        """`role[rank]` -> pid of every proc watched now."""
        procs = {
            f"{role}[{rank}]": member.pid
            for role, group in list(self.groups().items())
            for rank, member in enumerate(list(group.members))
            if member.pid
        }
        for role, pids in list(self.pids().items()):
            procs.update((f"{role}[{rank}]", pid) for rank, pid in enumerate(pids))
        return procs

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            for key, pid in self.watched().items():
                if key in proc_pool.lost or proc_pool.alive(pid):
                    continue
                if self.watched().get(key) == pid:  # not replaced meanwhile
                    proc_pool.lost[key] = time.monotonic()
                    logger.info("%s: proc %d is gone", key, pid)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        proc_pool.lost.clear()
