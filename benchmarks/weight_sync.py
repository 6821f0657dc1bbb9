"""Weight sync: meshrl's versioned sync against the ways a framework could move
the same bytes, in one run, between two processes on this host.

    python benchmarks/weight_sync.py              # 100 MB and 500 MB
    python benchmarks/weight_sync.py --sizes 100

The weights are float32 tensors of `TENSOR_MB` each. For each size, best of
`--repeats`, each sync after an untimed step that gives the moving tensors new
values:
- memcpy:      one copy of the bytes inside one process (the floor);
- gloo:        a torch.distributed broadcast from one process to another;
- rdma:        a plain `RDMABuffer.read_into` per tensor, the tensors registered once;
- meshrl:      a trainer actor publishes a version and a replica actor pulls it
               as a policy replica on the trainer's host does (`zero_copy`: it then
               serves the published slot, no copy), timed from the controller,
               both calls end to end;
- meshrl_copy: the same with a replica that copies out of shared memory (the
               way before zero-copy, and a reference's or critic's way);
- meshrl_rdma: a replica made to pull over RDMA (as from another host).
Each with checksums (`weights.verify`, the default) and without
(`verify_overhead` and the others are their ratios less one). Delta sync
(`weights.delta`) over RDMA, against full pulls, when every tensor changes
(full fine-tuning) and when `--few` of them do (LoRA, a frozen rest): bytes and
time per sync.
The memcpy is also measured inside the trainer actor (`actor_memcpy_s`): an
actor's process shares the cores with Monarch's runtime, and the ratios to it
(`sync_over_actor_memcpy`) compare like with like.
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

from meshrl.procs.mesh import RoleMeshes, wait  # noqa: E402
from meshrl.weights.publisher import WeightHandle, WeightPublisher  # noqa: E402
from meshrl.weights.receiver import WeightReceiver  # noqa: E402

TENSOR_MB = 5  # the weights are a module of float32 tensors of this size


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
    def step(self, fraction: float) -> list[float]:
        """An optimizer step (not timed): the first `fraction` of the tensors get a
        new value. Returns every tensor's value."""
        self.version += 1
        params = list(self.model.parameters())
        moving = max(1, round(fraction * len(params)))
        with torch.no_grad():
            for p in params[:moving]:
                p.fill_(float(self.version))
        return [float(p[0]) for p in params]

    @endpoint
    def publish(self, verify: bool, delta: bool) -> WeightHandle:
        if self.publisher is None:
            self.publisher = WeightPublisher(self.model)
        started = time.perf_counter()
        handle = self.publisher.publish(self.version, verify, delta)
        self.publish_s = time.perf_counter() - started
        return handle

    @endpoint
    def memcpy_s(self, total_mb: int, repeats: int) -> float:
        """The floor measured where the publish runs: in this actor's process."""
        return memcpy_s(total_mb, repeats)

    @endpoint
    def last_publish_s(self) -> float:
        return self.publish_s

    @endpoint
    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()


MODES = ("view", "copy", "rdma")
"""How the replica pulls: served in place from shared memory (zero_copy), copied
out of shared memory, read over RDMA."""


class Reader(Actor):
    """The replica's side: a model per way of pulling (a view must not be copied
    into by another receiver)."""

    def __init__(self, total_mb: int):
        self.models = {mode: weights(total_mb) for mode in MODES}
        self.receivers = {
            "view": WeightReceiver(self.models["view"], zero_copy=True),
            "copy": WeightReceiver(self.models["copy"]),
            "rdma": WeightReceiver(self.models["rdma"], shared_memory=False),
        }

    @endpoint
    def read_each(self, buffers: list) -> float:
        started = time.perf_counter()
        for buffer, param in zip(buffers, self.models["rdma"].parameters(), strict=True):
            buffer.read_into(param.data.view(torch.uint8)).get()
        return time.perf_counter() - started

    @endpoint
    def pull(self, handle: WeightHandle, mode: str) -> tuple[str, float, int]:
        receiver = self.receivers[mode]
        started = time.perf_counter()
        pulled = receiver.pull(handle)
        return receiver.path, time.perf_counter() - started, pulled.bytes_moved

    @endpoint
    def check(self, mode: str, values: list[float]) -> None:
        params = self.models[mode].parameters()
        assert all(bool((p == v).all()) for p, v in zip(params, values, strict=True)), mode


def monarch_timings(total_mb: int, repeats: int, few: float) -> dict:
    # Publish and pull never run at once here: each proc may use every core.
    with RoleMeshes({"trainer": 1, "policy": 1}, threads_per_proc=os.cpu_count()) as meshes:
        holder = meshes.spawn("trainer", "holder", Holder, total_mb)
        reader = meshes.spawn("policy", "reader", Reader, total_mb)
        buffers = wait(holder.tensor_buffers.call_one(), "buffers", 300)
        rdma = min(wait(reader.read_each.call_one(buffers), "read", 300) for _ in range(repeats))

        def sync(mode: str, verify: bool = True, delta: bool = False, moving: float = 1.0):
            """One step (untimed), then a publish and pull timed from the controller,
            the data checked after: total, publish inside the trainer, pull inside
            the replica, bytes moved into the replica."""
            values = wait(holder.step.call_one(moving), "step", 300)
            started = time.perf_counter()
            handle = wait(holder.publish.call_one(verify, delta), "publish", 300)
            path, pull_s, moved = wait(reader.pull.call_one(handle, mode), "pull", 300)
            total = time.perf_counter() - started
            assert path == ("rdma" if mode == "rdma" else "shm"), (mode, path)
            wait(reader.check.call_one(mode, values), "check", 300)
            return total, wait(holder.last_publish_s.call_one(), "t", 60), pull_s, moved

        def fastest(runs: int = repeats, **kwargs) -> tuple:
            sync(**kwargs)  # warm-up: files mapped, buffers registered, a delta base held
            return min((sync(**kwargs) for _ in range(runs)), key=lambda t: t[0])

        figures = {
            "rdma_s": rdma,
            "actor_memcpy_s": wait(holder.memcpy_s.call_one(total_mb, repeats), "memcpy", 300),
        }
        for mode in MODES:
            for verify in (True, False):
                figures[(mode, verify)] = fastest(mode=mode, verify=verify)
        for name, moving in (("full_ft", 1.0), ("few_changed", few)):
            for delta in (False, True):
                figures[(name, delta)] = fastest(mode="rdma", delta=delta, moving=moving)
        wait(holder.close.call_one(), "close", 60)
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 500], help="MB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--few", type=float, default=0.1, help="share of the tensors a 'few changed' step moves"
    )
    args = parser.parse_args()

    figures = {}
    for total_mb in args.sizes:
        memcpy = memcpy_s(total_mb, args.repeats)
        gloo = gloo_s(total_mb, args.repeats)
        t = monarch_timings(total_mb, args.repeats, args.few)
        sync, unverified = t[("view", True)][0], t[("view", False)][0]
        copy, rdma_sync = t[("copy", True)][0], t[("rdma", True)][0]
        figures[f"{total_mb}MB"] = {
            "sync_s": round(sync, 5),
            "sync_over_memcpy": round(sync / memcpy, 2),
            "sync_over_gloo": round(sync / gloo, 2),
            "sync_unverified_s": round(unverified, 5),
            "sync_unverified_over_memcpy": round(unverified / memcpy, 2),
            "verify_overhead": round(sync / unverified - 1, 3),
            "publish_s": round(t[("view", True)][1], 5),
            "pull_s": round(t[("view", True)][2], 5),
            "pull_bytes": t[("view", True)][3],
            "copy_sync_s": round(copy, 5),
            "copy_sync_over_memcpy": round(copy / memcpy, 2),
            "copy_verify_overhead": round(copy / t[("copy", False)][0] - 1, 3),
            "memcpy_s": round(memcpy, 5),
            "actor_memcpy_s": round(t["actor_memcpy_s"], 5),
            "sync_over_actor_memcpy": round(sync / t["actor_memcpy_s"], 2),
            "sync_unverified_over_actor_memcpy": round(unverified / t["actor_memcpy_s"], 2),
            "gloo_s": round(gloo, 5),
            "rdma_per_tensor_s": round(t["rdma_s"], 5),
            "sync_over_rdma_s": round(rdma_sync, 5),
            "rdma_verify_overhead": round(rdma_sync / t[("rdma", False)][0] - 1, 3),
            "delta": {
                name: {
                    "full_bytes": t[(name, False)][3],
                    "full_s": round(t[(name, False)][0], 5),
                    "delta_bytes": t[(name, True)][3],
                    "delta_s": round(t[(name, True)][0], 5),
                    "delta_over_full_s": round(t[(name, True)][0] / t[(name, False)][0], 3),
                }
                for name in ("full_ft", "few_changed")
            },
        }
    print(
        f"{'size':>6} {'memcpy':>9} {'gloo':>9} {'rdma':>9} {'meshrl':>9} {'copying':>9}"
        f" {'meshrl/rdma':>12} {'÷memcpy':>8} {'÷gloo':>6}"
    )
    for size, f in figures.items():
        print(
            f"{size:>6} {f['memcpy_s'] * 1e3:>7.1f}ms {f['gloo_s'] * 1e3:>7.1f}ms "
            f"{f['rdma_per_tensor_s'] * 1e3:>7.1f}ms {f['sync_s'] * 1e3:>7.1f}ms "
            f"{f['copy_sync_s'] * 1e3:>7.1f}ms "
            f"{f['sync_over_rdma_s'] * 1e3:>10.1f}ms {f['sync_over_memcpy']:>8.2f} "
            f"{f['sync_over_gloo']:>6.2f}"
        )
        for name, d in f["delta"].items():
            print(
                f"{'':>6} delta over RDMA, {name}: {d['full_bytes'] / 1e6:.1f} MB in "
                f"{d['full_s'] * 1e3:.1f} ms full, {d['delta_bytes'] / 1e6:.1f} MB in "
                f"{d['delta_s'] * 1e3:.1f} ms delta"
            )
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
