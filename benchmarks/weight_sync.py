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
(`sync_over_actor_memcpy`) compare like with like. So is the floor of a checked
sync (`floor_s`): the trainer's copy with its sum (`fused_copy_s`) and the
replica's verifying read, back to back, with the kernel the sync uses (`fused`:
the compiled one of `meshrl.weights.native`, else torch's); `sync_over_floor`
is what the calls and the bookkeeping add.
Prints a table, then one JSON object whose keys are the sizes, each with
`sync_s`, `sync_over_memcpy` and `sync_over_gloo` (and the other timings).

    python benchmarks/weight_sync.py --reshard --sizes   # the resharding cells only

`--reshard` adds cells that move a real model (the embedded Llama,
`--reshard-width` wide and deep, float32) from a trainer of one layout to a
replica of another, each role on a `process` job host of its own (so over
Monarch RDMA buffers, its TCP fallback here): the trainer's owners publish their
blocks in the parts the replicas' procs hold and each replica proc reads its
parts straight from their owners (the reshard plan), against gathering the
model on the trainer's rank 0 (`full_tensor`, a collective) and the replica
reading it from there. Trainers: FSDP2 over 2 procs, TP over 2, FSDP2 x TP over
2 x 2; replicas: 1 proc, TP over 2. Each cell
(`reshard_<trainer>_to_<replica>`) has `sync_s` (publish and every replica
proc's pull, from the controller, best of `--repeats`), `gather_sync_s`
(gather, publish from rank 0, pull), their ratio, `bytes_read_over_share` (the
most any replica proc read over RDMA, over the bytes it holds) and the
replica's weights checked equal to the trainer's after each way.
"""

from __future__ import annotations

import argparse
import itertools
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
from meshrl.weights import native  # noqa: E402
from meshrl.weights.checksum import copy_sums  # noqa: E402
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
    def floor_s(self, total_mb: int, repeats: int) -> tuple[float, float, bool]:
        """The work a checked same-host sync cannot skip, measured here: one copy
        with its sum (the trainer's), and one read of the copy with its sum (the
        replica's), back to back; and the copy alone. With whether the compiled
        kernel ran (`meshrl.weights.native`)."""
        src = torch.ones(total_mb * 1024 * 1024, dtype=torch.uint8)
        dst = torch.empty_like(src)

        def both():
            copy_sums([(dst, src)])
            copy_sums([(dst, None)])

        copy = best(lambda: copy_sums([(dst, src)]), repeats)
        return best(both, repeats), copy, native.available()

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
            "floor": wait(holder.floor_s.call_one(total_mb, repeats), "floor", 300),
        }
        for mode in MODES:
            for verify in (True, False):
                figures[(mode, verify)] = fastest(mode=mode, verify=verify)
        for name, moving in (("full_ft", 1.0), ("few_changed", few)):
            for delta in (False, True):
                figures[(name, delta)] = fastest(mode="rdma", delta=delta, moving=moving)
        wait(holder.close.call_one(), "close", 60)
    return figures


# --- resharding: a trainer of one layout to replicas of another -----------------------

RESHARD_LAYOUTS = {"fsdp2": ("fsdp", 2, 1), "tp2": ("tp", 2, 2), "fsdp2xtp2": ("fsdp_tp", 4, 2)}
REPLICA_TP = 2  # the tensor-parallel replica's procs


def reshard_model(width: int):
    from meshrl.config import ModelConfig

    return ModelConfig.sized(width, max(2, width // 64), 64)


def _gathering_trainer():
    """The real trainer, plus its model gathered on rank 0 (`full_tensor` of every
    parameter, a collective) and published from there: the way to compare with.
    Rank 0 lays it out in the parts the tensor-parallel replicas' procs hold too."""
    from actors.trainer import Trainer
    from meshrl.procs.parallel import full_parameters
    from meshrl.procs.reshard import replica_parts

    class Gathering(Trainer):
        @endpoint
        def publish_gathered(self) -> tuple[WeightHandle | None, float]:
            started = time.perf_counter()
            whole = {name: t.detach().clone() for name, t in full_parameters(self.model)}
            gathered = time.perf_counter() - started
            if self.rank != 0:
                return None, gathered
            self.whole = whole
            if getattr(self, "gathered_publisher", None) is None:
                self.gathered_publisher = WeightPublisher(
                    None,
                    parameters=lambda: iter(self.whole.items()),
                    split=replica_parts(self.model, REPLICA_TP),
                )
            return self.gathered_publisher.publish(self.version), gathered

        @endpoint
        def bump(self) -> None:
            """A new version of the same weights (nothing trains here)."""
            self.version += 1

    return Gathering


class ReshardReplica(Actor):
    """A policy replica's receivers: of 1 proc (the whole model), or one proc of a
    tensor-parallel replica (`master` given: its blocks)."""

    def __init__(self, width: int, tp: int = 1, master: tuple[str, int] | None = None):
        from monarch.actor import current_rank

        from meshrl.model.models import load_model
        from meshrl.procs.parallel import Ranks, data_parallel

        self.model = load_model(reshard_model(width), seed=1)  # other weights than the trainer's
        if tp > 1:
            rank = current_rank().rank
            data_parallel(self.model, Ranks(torch.device("cpu"), rank, tp, master), "tp", tp)
        self.receivers = {}

    @endpoint
    def pull(self, handle: WeightHandle, way: str) -> tuple[float, int, int]:
        """Seconds, bytes read over RDMA, and this proc's share (the bytes it holds)."""
        receiver = self.receivers.setdefault(way, WeightReceiver(self.model))
        started = time.perf_counter()
        pulled = receiver.pull(handle)
        assert pulled.path == "rdma" and pulled.verified, (pulled.path, pulled.verified)
        share = sum(
            t.numel() * t.element_size()
            for _, t in (
                (n, getattr(p, "_local_tensor", p)) for n, p in self.model.named_parameters()
            )
        )
        return time.perf_counter() - started, pulled.rdma_bytes, share

    @endpoint
    def parameters(self) -> dict[str, torch.Tensor]:
        from meshrl.procs.parallel import full_parameters

        return {n: p.detach().clone() for n, p in full_parameters(self.model)}


def reshard_timings(width: int, repeats: int) -> dict:
    from algorithms.grpo import GRPO, GRPOConfig
    from meshrl.config import OptimConfig
    from meshrl.procs.job import JobConfig
    from meshrl.procs.mesh import call_all

    counts = {name: procs for name, (_, procs, _) in RESHARD_LAYOUTS.items()}
    targets = {"1proc": 1, f"tp{REPLICA_TP}": REPLICA_TP}
    roles = {**counts, **{f"replica_{t}": n for t, n in targets.items()}}
    job = JobConfig(kind="process", hosts=dict.fromkeys(roles, 1))
    cells = {}
    with RoleMeshes(roles, job, threads_per_proc=1) as meshes:
        replicas = {
            t: meshes.spawn(
                f"replica_{t}",
                "replica",
                ReshardReplica,
                width,
                n,
                meshes.rendezvous(f"replica_{t}") if n > 1 else None,
            )
            for t, n in targets.items()
        }
        trainers = {
            name: meshes.spawn(
                name,
                f"trainer_{name}",
                _gathering_trainer(),
                reshard_model(width),
                OptimConfig(),
                GRPO(GRPOConfig()).make_loss(),
                10,
                master=meshes.rendezvous(name),
                sharding=sharding,
                tp=tp,
                replica_tp=REPLICA_TP,
            )
            for name, (sharding, _, tp) in RESHARD_LAYOUTS.items()
        }

        def pull(replica, handle, way: str) -> tuple[int, int]:
            """Every proc of the replica pulls: the most any read, over its share."""
            answers = call_all(replica, "pull", handle, way, what="pull", timeout_s=TIMEOUT)
            return max(read / share for _, read, share in answers), len(answers)

        for (name, trainer), (target, replica) in itertools.product(
            trainers.items(), replicas.items()
        ):

            def direct(trainer=trainer, replica=replica, way=name):
                wait(trainer.bump.call(), "bump", TIMEOUT)
                started = time.perf_counter()
                handles = call_all(trainer, "publish", what="publish", timeout_s=TIMEOUT)
                handle = WeightHandle.merge(handles)
                over_share, _ = pull(replica, handle, way)
                return time.perf_counter() - started, over_share, len(handle.sources)

            def gathered(trainer=trainer, replica=replica, way=f"{name}_gathered"):
                wait(trainer.bump.call(), "bump", TIMEOUT)
                started = time.perf_counter()
                answers = call_all(trainer, "publish_gathered", what="gather", timeout_s=TIMEOUT)
                over_share, _ = pull(replica, answers[0][0], way)
                return time.perf_counter() - started, over_share, 1

            whole = call_all(trainer, "parameters", what="params", timeout_s=TIMEOUT)[0]
            ways = {}
            for way, sync in (("direct", direct), ("gathered", gathered)):
                sync()  # warm-up: slots made, buffers registered
                ways[way] = min((sync() for _ in range(repeats)), key=lambda t: t[0])
                got = call_all(replica, "parameters", what="params", timeout_s=TIMEOUT)[0]
                assert all(torch.equal(got[k], whole[k]) for k in whole), (name, target, way)
            (sync_s, over_share, sources), (gather_s, gather_over, _) = (
                ways["direct"],
                ways["gathered"],
            )
            cell = f"reshard_{name}_to_{target}"
            cells[cell] = {
                "sync_s": round(sync_s, 4),
                "gather_sync_s": round(gather_s, 4),
                "sync_over_gather": round(sync_s / gather_s, 3),
                "bytes_read_over_share": round(over_share, 4),
                "gather_bytes_read_over_share": round(gather_over, 4),
                "sources": sources,
                "replica_procs": targets[target],
            }
            print(f"{cell}: {cells[cell]}", flush=True)
    return cells


TIMEOUT = 600


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=[100, 500], help="MB")
    parser.add_argument("--reshard", action="store_true", help="add the resharding cells")
    parser.add_argument("--reshard-width", type=int, default=512)
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
            "floor_s": round(t["floor"][0], 5),
            "sync_over_floor": round(sync / t["floor"][0], 2),
            "fused_copy_s": round(t["floor"][1], 5),
            "fused": t["floor"][2],
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
    if args.reshard:
        figures.update(reshard_timings(args.reshard_width, args.repeats))
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
