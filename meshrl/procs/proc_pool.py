"""Procs: what runs first in each (`setup_proc`), and procs kept across runs
in one process, so that each boots torch once.

`reuse_procs()` turns it on (the test suite does); `RoleMeshes` then takes a
matching idle proc mesh from the pool instead of spawning one, and gives its
healthy meshes back when it stops (see `ProcPool`).
"""

from __future__ import annotations

import atexit
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from meshrl.procs.zygote import PROC_COMM

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


def alive(pid: int) -> bool:
    """Whether process `pid` runs on this machine (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def monarch_pids(started_by: int | None = None) -> set[int]:
    """Pids of live Monarch processes on this machine: mesh procs (forked ones
    included; not their stand-ins, which end with them) and the subprocess hosts
    of a `process` job (for checking that nothing leaked). With `started_by`, only
    those that process started: its descendants, a forked proc counting as a child
    of its stand-in."""
    table: dict[int, tuple[int, str]] = {}  # pid -> (parent, comm), from one pass over /proc
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                head, tail = f.read().rsplit(")", 1)
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        state, parent = tail.split()[:2]
        comm = head.split("(", 1)[1]
        table[int(entry)] = (int(parent), comm)
        markers = (b"bootstrap_main", b"worker_loop_fo", b"_job_sidecar")
        forked = comm.startswith(PROC_COMM)
        if (forked or any(m in cmdline for m in markers)) and state != "Z":
            pids.add(int(entry))
    if started_by is None:
        return pids

    def up(pid: int) -> int:
        parent, comm = table.get(pid, (0, ""))
        stand_in = comm[len(PROC_COMM) :] if comm.startswith(PROC_COMM) else ""
        return int(stand_in) if stand_in.isdigit() else parent

    def mine(pid: int) -> bool:
        for _ in range(64):  # deeper than any process tree meshrl makes
            pid = up(pid)
            if pid == started_by:
                return True
            if pid <= 1:
                return False
        return False

    return {pid for pid in pids if mine(pid)}


lost: dict[str, float] = {}
"""`role[rank]` -> when meshrl saw that proc gone (`meshrl.procs.pool.Detector`), before
Monarch's supervision says so (about 10 s later): `meshrl.procs.mesh.wait` fails a
call to it at once."""


def is_lost(what: str) -> bool:
    """Whether a call named `what` (`policy.generate[1]`, `policy.load_weights`)
    waits on a proc seen gone."""
    role, _, rest = what.partition(".")
    rank = rest[rest.rfind("[") :] if rest.endswith("]") else None
    if rank is not None:
        return f"{role}{rank}" in lost
    return any(key.startswith(f"{role}[") for key in lost)


DEVICE_OFFSET_ENV = "MESHRL_DEVICE_OFFSET"
HOST_TAG_ENV = "MESHRL_HOST_TAG"
CORES_ENV = "MESHRL_CORES"
RDMA_CHUNK_MB = 64


def local_cores() -> int:
    """The cores a run's procs on this machine share: `MESHRL_CORES` where set
    (say, two runs side by side on one workstation, each given half), else the
    cores this process may run on (its CPU affinity: `taskset`, a container's
    cpuset), which `os.cpu_count()` would overstate."""
    given = os.environ.get(CORES_ENV)
    if given is None:
        if hasattr(os, "sched_getaffinity"):  # not on macOS
            return len(os.sched_getaffinity(0))
        return os.cpu_count() or 1
    if not given.isdigit() or int(given) < 1:
        raise ValueError(f"environment variable {CORES_ENV}={given!r}: a whole number >= 1")
    return int(given)


def host_process() -> int:
    """The pid of the process that spawned this proc (its host): its parent, or
    for a fork of the fork server (named `meshrl@STAND_IN`) its stand-in's parent.
    (Not `MESHRL_PROC_STAND_IN`: a fresh proc may inherit that from a forked run.)"""
    with open("/proc/self/comm") as f:
        comm = f.read().strip()
    if comm.startswith(PROC_COMM) and comm[len(PROC_COMM) :].isdigit():
        with open(f"/proc/{comm[len(PROC_COMM) :]}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    return os.getppid()


def setup_proc(
    num_threads: int | None, procs_per_host: int, device_offset: int, host_tag: bool = False
) -> None:
    """Runs first in every spawned proc: its share of the cores, and where its
    role's GPUs start (proc i of the mesh takes GPU offset + i; see
    `meshrl.model.models.device_for_this_proc`). `num_threads` None: this host's
    cores over the procs it runs (a host of its own, as under SLURM).
    `host_tag`: this proc's "host" is its parent (a `process` job's subprocess
    host, a SLURM node's worker: several may share a machine), so weights move
    between such hosts as between machines: over RDMA, not through this
    machine's shared memory (`meshrl.weights.publisher.host_id`)."""
    if host_tag:
        os.environ[HOST_TAG_ENV] = f"process-host-{host_process()}"
    from meshrl.procs.stacks import install_stack_dump

    install_stack_dump()  # its stacks on demand, when it hangs (`meshrl.procs.stacks`)
    # RDMA registration of CUDA memory wants expandable segments; the allocator
    # reads this at its first CUDA allocation, which comes later.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import monarch
    import torch

    # Large RDMA chunks: a replica's one RDMAAction of weight reads ran about twice
    # as fast with 64 MB chunks as with the default over the TCP fallback.
    monarch.configure(rdma_max_chunk_size_mb=RDMA_CHUNK_MB)

    if num_threads is None:
        num_threads = max(1, local_cores() // procs_per_host)
    torch.set_num_threads(num_threads)
    os.environ["OMP_NUM_THREADS"] = str(num_threads)
    os.environ[DEVICE_OFFSET_ENV] = str(device_offset)
