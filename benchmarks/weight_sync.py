"""Weight sync: meshrl's versioned sync against the ways a framework could move
the same bytes, in one run, between two processes on this host.

    python benchmarks/weight_sync.py              # 100 MB and 500 MB
    python benchmarks/weight_sync.py --sizes 100

For each size, best of `--repeats`:
- memcpy:      one copy of the bytes inside one process (the floor);
- gloo:        a torch.distributed broadcast from one process to another;
- rdma:        a plain `RDMABuffer.read_into` per tensor, the tensors registered once;
- meshrl:      a trainer actor publishes a version and a replica actor pulls it
               (`meshrl.weights`: shared memory on one host), timed from the
               controller: both calls, end to end;
- meshrl_rdma: the same with the replica made to pull over RDMA (as from another host).
Both meshrl syncs run as a run does, checksummed (`weights.verify`, the
default), and again without checksums: `verify_overhead` and
`rdma_verify_overhead` are their ratios less one.
Prints a table, then one JSON object whose keys are the sizes, each with
`sync_s`, `sync_over_memcpy` and `sync_over_gloo` (and the other timings).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from monarch.actor import Actor, endpoint  # noqa: E402

from meshrl.mesh import RoleMeshes, wait  # noqa: E402
from meshrl.weights import WeightHandle, WeightPublisher, WeightReceiver  # noqa: E402

TENSOR_MB = 25  # the weights are a module of float32 tensors of this size


def weights(total_mb: int, fill: float = 0.0) -> torch.nn.Module:
    module = torch.nn.Module()
    n = total_mb // TENSOR_MB
    for i in range(n):
        tensor = torch.full((TENSOR_MB * 1024 * 1024 // 4,), fill)
        module.register_parameter(f"w{i}", torch.nn.Parameter(tensor, requires_grad=False))
    return module


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


# --- memcpy and gloo ------------------------------------------------------------------


def memcpy_s(total_mb: int, repeats: int) -> float:
    src = torch.ones(total_mb * 1024 * 1024 // 4)
    dst = torch.empty_like(src)
    return best(lambda: dst.copy_(src), repeats)


def _gloo_worker(rank: int, port: int, total_mb: int, repeats: int, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tensor = torch.ones(total_mb * 1024 * 1024 // 4) * (1 - rank)
    times = []
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        dist.broadcast(tensor, src=0)
        times.append(time.perf_counter() - started)
    if rank == 1:
        assert bool((tensor == 1).all())
        out.put(min(times))
    dist.destroy_process_group()


def gloo_s(total_mb: int, repeats: int) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(
        _gloo_worker, args=(port, total_mb, repeats, out), nprocs=2, start_method="spawn"
    )
    return out.get()


# --- Monarch: plain RDMA reads and meshrl's sync --------------------------------------


class Holder(Actor):
    """The trainer's side: the weights, registered once."""

    def __init__(self, total_mb: int):
        self.model = weights(total_mb, fill=1.0)
        self.version = 0
        self.publisher = None
        self.buffers = None

    @endpoint
    def tensor_buffers(self) -> list:
        from monarch.rdma import RDMABuffer

        if self.buffers is None:
            self.buffers = [RDMABuffer(p.data.view(torch.uint8)) for p in self.model.parameters()]
        return self.buffers

    @endpoint
    def publish(self, verify: bool) -> WeightHandle:
        if self.publisher is None:
            self.publisher = WeightPublisher(self.model)
        self.version += 1
        started = time.perf_counter()
        handle = self.publisher.publish(self.version, verify)
        self.publish_s = time.perf_counter() - started
        return handle

    @endpoint
    def last_publish_s(self) -> float:
        return self.publish_s

    @endpoint
    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()


class Reader(Actor):
    """The replica's side."""

    def __init__(self, total_mb: int):
        self.model = weights(total_mb)
        self.receivers = {
            True: WeightReceiver(self.model),
            False: WeightReceiver(self.model, shared_memory=False),
        }

    @endpoint
    def read_each(self, buffers: list) -> float:
        started = time.perf_counter()
        for buffer, param in zip(buffers, self.model.parameters(), strict=True):
            buffer.read_into(param.data.view(torch.uint8)).get()
        return time.perf_counter() - started

    @endpoint
    def pull(self, handle: WeightHandle, shared_memory: bool) -> tuple[str, float]:
        receiver = self.receivers[shared_memory]
        started = time.perf_counter()
        receiver.pull(handle)
        return receiver.path, time.perf_counter() - started

    @endpoint
    def check_and_clear(self) -> None:
        assert all(bool((p == 1).all()) for p in self.model.parameters())
        with torch.no_grad():
            for p in self.model.parameters():
                p.zero_()  # the next pull must move every byte again


def monarch_timings(total_mb: int, repeats: int) -> dict[str, float]:
    # Publish and pull never run at once here: each proc may use every core.
    with RoleMeshes({"trainer": 1, "policy": 1}, threads_per_proc=os.cpu_count()) as meshes:
        holder = meshes.spawn("trainer", "holder", Holder, total_mb)
        reader = meshes.spawn("policy", "reader", Reader, total_mb)
        buffers = wait(holder.tensor_buffers.call_one(), "buffers", 300)
        rdma = min(wait(reader.read_each.call_one(buffers), "read", 300) for _ in range(repeats))

        def sync(shared_memory: bool, verify: bool = True) -> tuple[str, float, float, float]:
            """One publish and pull timed from the controller (the data checked after):
            path, total, publish inside the trainer, pull inside the replica."""
            started = time.perf_counter()
            handle = wait(holder.publish.call_one(verify), "publish", 300)
            path, pull_s = wait(reader.pull.call_one(handle, shared_memory), "pull", 300)
            total = time.perf_counter() - started
            wait(reader.check_and_clear.call_one(), "check", 300)
            return path, total, wait(holder.last_publish_s.call_one(), "t", 60), pull_s

        # Warm-up: files mapped, buffers registered, both slots written.
        assert [sync(True)[0], sync(False)[0]] == ["shm", "rdma"]
        shm = min((sync(True) for _ in range(repeats)), key=lambda t: t[1])
        unverified = min(sync(True, verify=False)[1] for _ in range(repeats))
        over_rdma = min((sync(False) for _ in range(repeats)), key=lambda t: t[1])
        rdma_unverified = min(sync(False, verify=False)[1] for _ in range(repeats))
        wait(holder.close.call_one(), "close", 60)
    return {
        "rdma_s": rdma,
        "meshrl_s": shm[1],
        "meshrl_publish_s": shm[2],
        "meshrl_pull_s": shm[3],
        "meshrl_rdma_s": over_rdma[1],
        "meshrl_unverified_s": unverified,
        "meshrl_rdma_unverified_s": rdma_unverified,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 500], help="MB")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    figures = {}
    for total_mb in args.sizes:
        memcpy = memcpy_s(total_mb, args.repeats)
        gloo = gloo_s(total_mb, args.repeats)
        timings = monarch_timings(total_mb, args.repeats)
        sync = timings["meshrl_s"]
        figures[f"{total_mb}MB"] = {
            "sync_s": round(sync, 5),
            "sync_over_memcpy": round(sync / memcpy, 2),
            "sync_over_gloo": round(sync / gloo, 2),
            "memcpy_s": round(memcpy, 5),
            "gloo_s": round(gloo, 5),
            "rdma_per_tensor_s": round(timings["rdma_s"], 5),
            "sync_over_rdma_s": round(timings["meshrl_rdma_s"], 5),
            "publish_s": round(timings["meshrl_publish_s"], 5),
            "pull_s": round(timings["meshrl_pull_s"], 5),
            "sync_unverified_s": round(timings["meshrl_unverified_s"], 5),
            "verify_overhead": round(sync / timings["meshrl_unverified_s"] - 1, 3),
            "rdma_verify_overhead": round(
                timings["meshrl_rdma_s"] / timings["meshrl_rdma_unverified_s"] - 1, 3
            ),
        }
    print(
        f"{'size':>6} {'memcpy':>9} {'gloo':>9} {'rdma':>9} {'meshrl':>9} {'meshrl/rdma':>12}"
        f" {'÷memcpy':>8} {'÷gloo':>6}"
    )
    for size, f in figures.items():
        print(
            f"{size:>6} {f['memcpy_s'] * 1e3:>7.1f}ms {f['gloo_s'] * 1e3:>7.1f}ms "
            f"{f['rdma_per_tensor_s'] * 1e3:>7.1f}ms {f['sync_s'] * 1e3:>7.1f}ms "
            f"{f['sync_over_rdma_s'] * 1e3:>10.1f}ms {f['sync_over_memcpy']:>8.2f} "
            f"{f['sync_over_gloo']:>6.2f}"
        )
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
