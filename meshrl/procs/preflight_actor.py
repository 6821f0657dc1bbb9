"""The preflight's actor: spawned on a role's procs before its actors, it runs one
host's checks (`meshrl.procs.health`: matmul, CUDA, run directory, versions), serves
and reads the RDMA buffer other hosts read, and joins the all-reduce among the
role's procs. Apart from `meshrl.procs.health` so that the checks themselves import
without Monarch (a GPU host without it can run them)."""

from __future__ import annotations

import math
import os
import socket
import time
from datetime import timedelta
from typing import Any

from monarch.actor import Actor, endpoint

from meshrl.procs import proc_pool
from meshrl.procs.health import Spec, cpu_cores, cuda_figures, disk_figures, matmul_rate, versions

READS = 3
"""RDMA reads a host's figure is the best of."""


class Preflight(Actor):
    """Spawned on a role's procs before its actors: the checks of one host (`check`,
    on its first proc), the RDMA buffer other hosts read (`buffer`, `read`) and
    the collective among the role's procs (`collective`)."""

    def __init__(self) -> None:
        self.data: Any = None

    @endpoint
    def check(self, spec: Spec) -> dict:
        """This host's figures and failures (each failure `check: why`)."""
        figures: dict[str, Any] = {
            "host": socket.gethostname(),
            "node": os.environ.get("SLURMD_NODENAME", ""),
            "tag": os.environ.get(proc_pool.HOST_TAG_ENV, ""),
            "pid": os.getpid(),
            "versions": versions(),
        }
        failures: list[str] = []
        started = time.perf_counter()
        figures["cpu_cores"] = cpu_cores()
        try:
            figures["matmul_gflops"] = round(matmul_rate(spec.dtype, spec.matmul_s), 3)
        except Exception as error:  # noqa: BLE001 - a broken device is this check's finding
            failures.append(f"device: matmul at {spec.dtype} failed: {error}")
        try:
            cuda, bad = cuda_figures(spec.expected_devices)
            figures.update(cuda)
            failures += bad
        except Exception as error:  # noqa: BLE001
            failures.append(f"device: {error}")
        if spec.run_dir:
            disk, bad = disk_figures(spec.run_dir, spec.need_bytes)
            figures.update(disk)
            failures += bad
        figures["check_s"] = round(time.perf_counter() - started, 3)
        return {"figures": figures, "failures": failures}

    @endpoint
    def buffer(self, nbytes: int) -> Any:
        """An RDMA buffer of `nbytes` in this proc, for another host to read."""
        import torch
        from monarch.rdma import RDMABuffer

        self.data = torch.ones(nbytes, dtype=torch.uint8)
        return RDMABuffer(self.data)

    @endpoint
    def read(self, buffer: Any, nbytes: int, reads: int = READS) -> dict:
        """Read another host's `buffer` into this proc `reads` times: GB/s of the
        fastest read (what the link can do; a moment's load on either end, another
        job's burst, spoils one read, not all), or the failure."""
        import torch

        into = torch.zeros(nbytes, dtype=torch.uint8)
        took = math.inf
        for _ in range(reads):
            into.zero_()
            started = time.perf_counter()
            try:
                buffer.read_into(into).get()
            except Exception as error:  # noqa: BLE001 - the finding
                return {"failure": f"rdma: reading another host's buffer failed: {error}"}
            took = min(took, time.perf_counter() - started)
            if int(into[-1]) != 1:
                return {"failure": "rdma: the buffer read back differs from what was written"}
        return {"rdma_gb_s": round(nbytes / 1e9 / max(took, 1e-9), 3)}

    @endpoint
    def collective(self, master: tuple[str, int], rank: int, world: int, nbytes: int) -> dict:
        """An all-reduce of `nbytes` among the role's `world` procs, the backend its
        training uses (NCCL on own GPUs, else gloo), in a group of its own (the
        default group is left to the role's actors): GB/s, or the failure."""
        import torch
        import torch.distributed as dist

        from meshrl.procs import parallel

        address, port = master
        try:
            if address.startswith(parallel.FILE_STORE):
                store: Any = dist.FileStore(address[len(parallel.FILE_STORE) :], world)
            else:
                store = parallel._STORES.pop(port, None) if rank == 0 else None
                if store is None:
                    store = dist.TCPStore(address, port, world, False, timedelta(seconds=30))
            local = address.startswith(parallel.FILE_STORE) or address == "127.0.0.1"
            if local and "GLOO_SOCKET_IFNAME" not in os.environ:
                os.environ["GLOO_SOCKET_IFNAME"] = "lo"
            prefixed = dist.PrefixStore("meshrl-preflight", store)
            cuda = torch.cuda.is_available() and world <= torch.cuda.device_count()
            if cuda:
                device = torch.device("cuda", rank % torch.cuda.device_count())
                group: Any = dist.ProcessGroupNCCL(prefixed, rank, world)
            else:
                device = torch.device("cpu")
                group = dist.ProcessGroupGloo(prefixed, rank, world, timedelta(seconds=30))
            tensor = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
            group.allreduce([tensor]).wait()  # warm: connections made
            started = time.perf_counter()
            for _ in range(3):
                group.allreduce([tensor]).wait()
            if cuda:
                torch.cuda.synchronize()
            took = (time.perf_counter() - started) / 3
            ok = float(tensor[0]) == float(world**4)
            del group
        except Exception as error:  # noqa: BLE001 - the finding
            return {"failure": f"collective: all-reduce among {world} procs failed: {error}"}
        if not ok:
            return {"failure": "collective: the all-reduce gave a wrong sum"}
        backend = "nccl" if cuda else "gloo"
        return {f"{backend}_gb_s": round(2 * nbytes / 1e9 / max(took, 1e-9), 3)}
