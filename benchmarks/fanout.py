"""Weight distribution to N replicas: the star (every replica reads the trainer)
against the relay tree (`weights.fanout`), in one run.

    python benchmarks/fanout.py                       # 1, 2, 4, 8, 16 replicas, 64 MB
    python benchmarks/fanout.py --replicas 1 2 4 --mb 32 --fanouts 1 2 4

Each replica runs on a `process` job host of its own, and the trainer on
another, so every byte moves over Monarch RDMA buffers (Monarch's TCP fallback
on this machine), never through shared memory. The controller drives
`meshrl.loop.weight_sync.WeightSync` as a run does: `publish` on the trainer, then
`pull` over the replicas (one level for the star, level by level for a tree),
timed from the controller: the median of `--repeats` syncs. Every replica's
bytes are checked against the trainer's after each sync.

Reported per N and way: `sync_s` (the pull: first byte requested to last
replica done), `trainer_egress_bytes` (bytes read from the trainer's proc) and
`max_hop_depth`. Then, for the relay at the default fanout, the goals of the
issue: egress <= fanout x model bytes, and sync_s <= 1.5 x max(1, log2 N) x the
N=1 time. Prints a table, then one JSON line: `fanout`, `model_bytes`, and
`star` and `relay` as lists of rows (`replicas`, `sync_s`,
`trainer_egress_bytes`, `max_hop_depth`), plus `by_fanout` (sync_s per fanout
at the largest N, which picks the default) and `goals`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from monarch.actor import Actor, endpoint  # noqa: E402

from meshrl.loop.state import LoopState  # noqa: E402
from meshrl.loop.supervisor import Supervisor  # noqa: E402
from meshrl.loop.weight_sync import WeightsConfig, WeightSync  # noqa: E402
from meshrl.procs.faults import FaultsConfig  # noqa: E402
from meshrl.procs.job import JobConfig  # noqa: E402
from meshrl.procs.mesh import RoleMeshes, wait  # noqa: E402
from meshrl.weights.publisher import WeightHandle, WeightPublisher  # noqa: E402
from meshrl.weights.receiver import Pulled, WeightReceiver  # noqa: E402

TENSOR_MB = 8
TIMEOUT_S = 600


def weights(total_mb: int) -> torch.nn.Module:
    module = torch.nn.Module()
    for i in range(max(1, total_mb // TENSOR_MB)):
        tensor = torch.zeros(TENSOR_MB * 1024 * 1024 // 4)
        module.register_parameter(f"w{i}", torch.nn.Parameter(tensor, requires_grad=False))
    return module


class Trainer(Actor):
    """The trainer's owning rank: publishes a new version (every byte new) each call."""

    def __init__(self, total_mb: int):
        self.model = weights(total_mb)
        self.publisher = WeightPublisher(self.model)
        self.version = -1

    @endpoint
    def publish(self, verify: bool = True, delta: bool = False) -> WeightHandle:
        self.version += 1
        with torch.no_grad():
            for p in self.model.parameters():
                p.fill_(float(self.version + 1))
        return self.publisher.publish(self.version, verify, delta)

    @endpoint
    def close(self) -> None:
        self.publisher.close()


class Replica(Actor):
    """A policy replica's weight side (`Policy.load_weights` without an engine)."""

    def __init__(self, total_mb: int):
        self.model = weights(total_mb)
        self.weights = WeightReceiver(self.model)

    @endpoint
    def load_weights(
        self, handle: WeightHandle, serve: bool = False, timeout_s: float | None = None
    ) -> Pulled:
        return self.weights.pull(handle, serve, None, timeout_s)

    @endpoint
    def host_id(self) -> str:
        return self.weights.host

    @endpoint
    def check(self, version: int) -> bool:
        return all(bool((p == float(version + 1)).all()) for p in self.model.parameters())

    @endpoint
    def close(self) -> None:
        self.weights.close()


class Replicas:
    """The first `size` procs of a mesh, as `WeightSync` sees a role."""

    def __init__(self, actors, size: int, name: str = "policy"):
        self.actors, self.size = actors, size
        self.name, self.respawns = name, 0

    def slice(self, **where):
        return self.actors.slice(**where)

    def __getattr__(self, endpoint: str):
        return getattr(self.actors.slice(procs=slice(0, self.size)), endpoint)


def measure(sync: WeightSync, trainer, replicas: Replicas, repeats: int) -> dict:
    times, egress, depth = [], set(), set()
    for _ in range(repeats + 1):  # the first: buffers registered, files mapped
        handle = sync.publish(trainer)
        started = time.perf_counter()
        sync.pull(replicas, handle)
        times.append(time.perf_counter() - started)
        checks = wait(replicas.check.call(handle.version), "check", TIMEOUT_S)
        assert all(ok for _, ok in checks.items()), "a replica's bytes differ from the trainer's"
        egress.add(sync.egress_bytes)
        depth.add(sync.depth)
    assert len(egress) == 1 and len(depth) == 1, (egress, depth)
    return {
        "replicas": replicas.size,
        "sync_s": round(statistics.median(times[1:]), 4),
        "trainer_egress_bytes": egress.pop(),
        "max_hop_depth": depth.pop(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--mb", type=int, default=64, help="model size in MB")
    parser.add_argument("--fanouts", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--save", help="also write the JSON line to this file")
    args = parser.parse_args()
    fanout = WeightsConfig().fanout
    largest = max(args.replicas)

    job = JobConfig(kind="process", hosts={"trainer": 1, "policy": largest})
    # One proc per host; the hosts share this machine's cores.
    with RoleMeshes({"trainer": 1, "policy": 1}, job, threads_per_proc=1) as meshes:
        trainer = Replicas(meshes.spawn("trainer", "trainer", Trainer, args.mb), 1, "trainer")
        actors = meshes.spawn("policy", "replica", Replica, args.mb)
        sup = Supervisor(None, FaultsConfig(), LoopState())
        sup.timeout_s = TIMEOUT_S
        model_bytes = args.mb // TENSOR_MB * TENSOR_MB * 1024 * 1024
        rows = {"star": [], "relay": []}
        # Every replica's files mapped and buffers registered before anything is timed.
        measure(WeightSync(sup, fanout=1), trainer, Replicas(actors, largest), 1)
        for n in args.replicas:
            for way, f in (("star", 0), ("relay", fanout)):
                sync = WeightSync(sup, fanout=f, relay_timeout_s=TIMEOUT_S)
                rows[way].append(measure(sync, trainer, Replicas(actors, n), args.repeats))
                print(f"{way:>5} N={n:<3} {rows[way][-1]}", flush=True)
        by_fanout = {}
        for f in args.fanouts:
            sync = WeightSync(sup, fanout=f, relay_timeout_s=TIMEOUT_S)
            by_fanout[f] = measure(sync, trainer, Replicas(actors, largest), args.repeats)
            print(f"fanout {f} N={largest}: {by_fanout[f]}", flush=True)
        wait(actors.close.call(), "close", 60)
        wait(trainer.close.call(), "close", 60)

    one = rows["relay"][0]["sync_s"] if args.replicas[0] == 1 else None
    goals = {
        "egress_within_fanout": all(
            r["trainer_egress_bytes"] <= fanout * (model_bytes + 128) for r in rows["relay"]
        ),
        "sync_within_log2": None
        if one is None
        else all(
            r["sync_s"] <= 1.5 * max(1.0, math.log2(r["replicas"])) * one for r in rows["relay"]
        ),
    }
    print(f"\nmodel {model_bytes / 2**20:.0f} MB, relay fanout {fanout} (weights.fanout default)")
    print(
        f"{'N':>4} {'star s':>8} {'relay s':>8} {'star/relay':>10} {'star egress':>12} "
        f"{'relay egress':>13} {'depth':>6}"
    )
    for star, relay in zip(rows["star"], rows["relay"], strict=True):
        print(
            f"{star['replicas']:>4} {star['sync_s']:>8.3f} {relay['sync_s']:>8.3f} "
            f"{star['sync_s'] / relay['sync_s']:>10.2f} "
            f"{star['trainer_egress_bytes'] / model_bytes:>11.1f}x "
            f"{relay['trainer_egress_bytes'] / model_bytes:>12.1f}x {relay['max_hop_depth']:>6}"
        )
    print(
        f"fanout at N={largest}: "
        + ", ".join(f"{f}: {r['sync_s']:.3f} s" for f, r in by_fanout.items())
    )
    print(f"goals: {goals}")
    line = json.dumps(
        {
            "fanout": fanout,
            "model_bytes": model_bytes,
            "star": rows["star"],
            "relay": rows["relay"],
            "by_fanout": {str(f): r["sync_s"] for f, r in by_fanout.items()},
            "goals": goals,
        }
    )
    print(line)
    save_line(line, args.save)
    return 0


def save_line(line: str, path: str | None) -> None:
    """The JSON line into `path` (for benchmarks/scale_model.py), if given."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    sys.exit(main())
