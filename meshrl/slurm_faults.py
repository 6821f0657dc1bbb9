"""What a scheduler does to a run on SLURM, as the controller sees it: notices
(preemption, requeue, the time limit's warning) read from the jobs' comments
(`NoticeWatch`), nodes that lost procs counted and quarantined (`note_lost`),
and each role's job and live nodes for `meshrl status` (`where`)."""

from __future__ import annotations

import logging
import threading
from typing import Any

from meshrl.faultlog import log_fault

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


def where(meshes: Any) -> dict[str, dict]:
    """Each role's SLURM job id and live nodes, its joined hosts' included
    (`meshes`: the run's `RoleMeshes` on a SLURM job)."""
    allocations, found = meshes.job.allocations, {}
    for role, alloc in allocations.where().items():
        lost = set(losses) & set(allocations.dead_nodes(role))  # replaced by joined hosts
        found[role] = {**alloc, "nodes": [n for n in alloc["nodes"] if n not in lost]}
    for role in meshes.elastic & set(meshes.meshes):
        for host in meshes.meshes[role].hosts:
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


def note_lost(nodes: list[str]) -> list[str]:
    """Count a loss of procs on each of `nodes`; those that reach `quarantine_after`
    join `meshrl.job.quarantined` (excluded from every later allocation). Returns
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
