"""Procs kept across runs in one process, so that each boots torch once.

`reuse_procs()` turns it on (the test suite does); `RoleMeshes` then takes a
matching idle proc mesh from the pool instead of spawning one, and gives its
healthy meshes back when it stops (see `ProcPool`).
"""

from __future__ import annotations

import atexit
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

logger = logging.getLogger(__name__)


class ProcPool:
    """Proc meshes kept for reuse by later `RoleMeshes` on this host.

    A proc spends about 5 s of CPU importing torch and transformers before its
    first actor runs; a test suite or a notebook that runs many short runs pays
    it once per pooled proc instead of once per run. `RoleMeshes.stop()` stops
    the actors of a healthy mesh (of one proc, or of several whose actors formed
    no torch.distributed group) and gives the mesh back here; a later
    `RoleMeshes` wanting as many procs with the same threads and device offset
    takes it and spawns fresh actors on it. A mesh whose proc died, or whose actors would not
    stop, is never pooled. Enable with `reuse_procs()`; `close()` stops them."""

    def __init__(self) -> None:
        self.free: dict[tuple, list[tuple[Any, set[int]]]] = {}

    def take(self, key: tuple) -> Any | None:
        meshes = self.free.get(key)
        return meshes.pop()[0] if meshes else None

    def give(self, key: tuple, mesh: Any, pids: set[int]) -> None:
        self.free.setdefault(key, []).append((mesh, pids))

    def pids(self) -> set[int]:
        """Pids of the pooled procs (alive, waiting for a run)."""
        return {pid for meshes in self.free.values() for _, pids in meshes for pid in pids}

    def close(self, timeout_s: float = 20.0) -> None:
        meshes = [mesh for entries in self.free.values() for mesh, _ in entries]
        self.free = {}

        def stop(mesh: Any) -> None:  # side by side, as in `RoleMeshes.stop`
            try:
                mesh.stop().get(timeout=timeout_s)
            except BaseException as error:  # noqa: BLE001 - best effort, keep stopping the rest
                logger.warning("could not stop a pooled proc mesh: %s", error)

        if meshes:
            with ThreadPoolExecutor(len(meshes), thread_name_prefix="meshrl-pool") as pool:
                list(pool.map(stop, meshes))


pool: ProcPool | None = None
"""The pool `RoleMeshes` takes procs from and gives them back to; None: no reuse."""


def reuse_procs(enabled: bool = True) -> ProcPool | None:
    """Keep the single-proc meshes of finished local runs for later runs in this
    process (see `ProcPool`); `enabled=False` stops the pooled procs."""
    global pool
    if not enabled:
        if pool is not None:
            pool.close()
        pool = None
        return None
    if pool is None:
        pool = ProcPool()
        atexit.register(reuse_procs, False)
    return pool


def pooled_pids() -> set[int]:
    """Pids of procs waiting in the pool (none when reuse is off)."""
    return pool.pids() if pool is not None else set()
