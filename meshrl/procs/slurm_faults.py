"""What a scheduler does to a run on SLURM, as the controller sees it: notices
(preemption, requeue, the time limit's warning) read from the jobs' comments
(`NoticeWatch`), workers gone with their node seen within seconds
(`WorkerWatch`), nodes that lost procs counted and quarantined (`note_lost`),
and each role's job and live nodes for `meshrl status` (`where`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from meshrl.procs import proc_pool
from meshrl.procs.faultlog import log_fault

logger = logging.getLogger(__name__)


class NoticeWatch:
    """Reads the run's SLURM jobs' notices every `every_s` (a thread); `take()`
    returns the new ones as (host mesh, "warning" | "terminated")."""

    def __init__(self, allocations: Any, every_s: float = 1.0):
        self.allocations, self.every_s = allocations, every_s
        self.seen: set[str] = set()
        self.pending: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="meshrl-slurm-notices", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                notices = self.allocations.notices()
            except Exception as error:  # noqa: BLE001 - a scheduler hiccup: ask again
                logger.debug("squeue: %s", error)
                continue
            for name, comment in notices.items():
                key = f"{self.allocations.jobs[name].job_id}:{comment}"
                if key in self.seen:
                    continue
                self.seen.add(key)
                reason = comment.split(":")[1]
                log_fault(f"SLURM notice for the {name} job: {reason}")
                with self._lock:
                    self.pending.append((name, reason))

    def take(self) -> list[tuple[str, str]]:
        with self._lock:
            taken, self.pending = self.pending, []
        return taken

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class WorkerWatch:
    """Sees a node's worker gone within about two seconds. Monarch's supervision
    says so only when its channel to that host gives up reconnecting (a minute,
    `channel_reconnect_timeout`), and the call waiting on it waits as long.

    `targets()` gives each SLURM allocation of the run (its roles' own jobs and
    the one-node jobs of hosts that joined a pool) with `procs(workers)`, which
    names the procs (`role[rank]`) on those of its workers (None: all). Every
    `every_s` each worker is dialled; when one that has answered before (not one
    still starting, however slowly: the job's start timeout covers those) does
    not answer twice in a row,
    its allocation unchanged meanwhile, its procs are entered in
    `proc_pool.lost`, which fails the calls waiting on them at once
    (`meshrl.procs.mesh.wait`); the recovery then replaces them as for any lost proc.
    `forget()`, as a mesh's recovery begins, clears them."""

    def __init__(self, targets: Callable[[], list[tuple[Any, Callable]]], every_s: float = 1.0):
        self.targets, self.every_s = targets, every_s
        self.lock = threading.Lock()
        self.misses: dict[tuple, int] = {}
        self.answered: dict[tuple, set[int]] = {}  # layout -> workers seen listening
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="meshrl-slurm-workers", daemon=True)
        self._thread.start()

    @staticmethod
    def _layout(alloc: Any) -> tuple:
        return (alloc.name, alloc.job_id, tuple(alloc.addresses), alloc.restarts)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                targets = self.targets()
            except Exception as error:  # noqa: BLE001 - a pool changing meanwhile: next time
                logger.debug("workers to watch: %s", error)
                continue
            for alloc, procs in targets:
                if not alloc.addresses or self._stop.is_set():
                    continue  # not started yet, or the run is closing
                layout = self._layout(alloc)
                up = {i for i in range(len(alloc.addresses)) if alloc.listening(i)}
                seen = self.answered.setdefault(layout, set())
                seen |= up
                down = sorted(seen - up)
                if not down:
                    self.misses.pop(layout, None)
                    continue
                with self.lock:
                    self.misses[layout] = self.misses.get(layout, 0) + 1
                    if self.misses[layout] != 2 or self._layout(alloc) != layout:
                        continue  # twice in a row, reported once; or replaced meanwhile
                    nodes = ", ".join(alloc.nodes[i] for i in down if i < len(alloc.nodes))
                    log_fault(f"the {alloc.name} workers on SLURM node(s) {nodes} do not answer")
                    now = time.monotonic()
                    for key in procs(down):
                        proc_pool.lost.setdefault(key, now)

    def forget(self, alloc: Any, keys: list[str]) -> None:
        """These procs (on `alloc`) are being replaced: calls to them go through
        again, and what was seen of `alloc` as it is now is not reported again."""
        with self.lock:
            for key in keys:
                proc_pool.lost.pop(key, None)
            if alloc is not None:
                layout = self._layout(alloc)
                self.misses[layout] = max(self.misses.get(layout, 0), 2)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def where(meshes: Any) -> dict[str, dict]:
    """Each role's SLURM job id and live nodes, its joined hosts' included
    (`meshes`: the run's `RoleMeshes` on a SLURM job)."""
    allocations, found = meshes.job.allocations, {}
    for role, alloc in allocations.where().items():
        lost = set(losses) & set(allocations.dead_nodes(role))  # replaced by joined hosts
        found[role] = {**alloc, "nodes": [n for n in alloc["nodes"] if n not in lost]}
    for role in meshes.elastic & set(meshes.by_role):
        for host in meshes.by_role[role].hosts:
            for alloc in host.job.allocations.where().values() if host.job else ():
                joined = found.setdefault(role, {"job_id": "", "nodes": []})
                joined["job_id"] = ",".join(filter(None, [joined["job_id"], alloc["job_id"]]))
                joined["nodes"] = joined["nodes"] + alloc["nodes"]
    return found


# --- lost nodes ------------------------------------------------------------------

quarantine_after = 2
"""Procs lost on one node this often, and it is quarantined (`faults.quarantine_after`)."""
losses: dict[str, int] = {}
"""Node -> how often procs were lost there, in this run."""
quarantined: set[str] = set()
"""Nodes that no later allocation of this run may get (`--exclude`)."""


def begin_run(after: int = 2) -> None:
    """A new run in this process (a notebook runs several): its own quarantine,
    nodes quarantined after `after` losses (`faults.quarantine_after`)."""
    global quarantine_after
    quarantined.clear()
    losses.clear()
    quarantine_after = after


def note_lost(nodes: list[str]) -> list[str]:
    """Count a loss of procs on each of `nodes`; those that reach `quarantine_after`
    join `quarantined` (excluded from every later allocation). Returns
    the nodes quarantined now."""
    now = []
    for node in nodes:
        losses[node] = losses.get(node, 0) + 1
        log_fault(f"procs lost on SLURM node {node} ({losses[node]} time(s))")
        if losses[node] >= quarantine_after and node not in quarantined:
            quarantined.add(node)
            now.append(node)
            log_fault(
                f"quarantined SLURM node {node}: procs lost there {losses[node]} times; "
                "no later allocation of this run gets it (--exclude)"
            )
            print(
                f"SLURM: node {node} quarantined (procs lost there {losses[node]} times)",
                flush=True,
            )
    return now
