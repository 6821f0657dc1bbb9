"""Trainer layouts side by side, in one run: step time and peak memory of each
layout on the same model and batch, the pipeline bubble measured against its
closed form, and what a pipelined or expert-parallel trainer's weight sync
moves against gathering the model first.

    .venv/bin/python benchmarks/layouts.py            # under a minute on 2 cores
    .venv/bin/python benchmarks/layouts.py --steps 3 --repeats 2

Pinned: one torch thread a proc (`threads_per_proc=1`, and the bubble's ranks
`torch.set_num_threads(1)`); seed 0 for every trainer's weights and for the
batch; the model `ModelConfig.sized(--hidden, --layers, 256)` (Llama, float32:
128 wide, 4 layers by default, so an interleaved schedule has 2 stages a proc
at pp=2) and the same sizes with `arch=qwen3_moe` for the expert cells; the
batch: `--rows` rows (16) of a `--prompt` (32) token prompt shared by groups of
4 and `--completion` (96) completion tokens of varied lengths, GRPO's loss with
a KL term (kl_coef 0.01); `--microbatches` (4) pipeline micro-batches in the
trainer cells. glibc's malloc is left as it is: benchmarks/prefix_training.py's
`MALLOC_MMAP_THRESHOLD_=131072` makes the peak resident set tighter, but it
doubled the time of these small steps (every activation a fresh mapping), so
the peaks here may count freed heap glibc kept. `settings.loadavg_1m` (at the
start and at the end) says how busy the machine was: the timings are wall
times on shared cores.

1. `layouts`: a real `Trainer` per layout, each on a mesh of its own (its own
   procs): `one` (1 proc), `ddp2`, `pp2_gpipe`, `pp2_1f1b`, `pp2_interleaved`
   (2 procs, pp=2), `fsdp_pp4` (4 procs: dp 2 x pp 2, GPipe), and for
   qwen3_moe `moe_one` (1 proc) and `ep2` (2 procs, ep=2, DDP). Every cell
   trains on the same batch (data-parallel ranks their shard, a pipeline's
   stages the same rows, as tests/actors/test_pipeline_experts.py hands them
   out). `step_s`: median of `--steps` `train_step` calls (every proc at once,
   timed at the controller) after one untimed warm-up; `step_over_one` against
   its model's 1-proc cell, same run. `grad_norm`: of the first step, a check
   that the layouts computed the same step. `peak_rss_mb` per proc (rank
   order): the proc's resident-set high-water mark (`VmHWM` of
   /proc/<pid>/status, read by the controller from the pids `RoleMeshes`
   knows: the Trainer has no endpoint for it, and none is needed on one host),
   after the steps and before any publish; `base_rss_mb` the same read when the
   procs had started (interpreter, torch and the fork server's pages), before
   any actor. The model is a few MB: the peaks are mostly the trainer's
   interpreter, libraries and optimizer state, and differ little. 4 procs
   share 2 cores in `fsdp_pp4`: its step time counts that.

2. `bubble`: the idle share of a pipeline schedule at pp=2 and m micro-batches
   (2, 4, 8) of the same batch, measured outside the actors: 2 gloo ranks
   (torch.multiprocessing) each build the model from seed 0, cut it to their
   stages (`meshrl.procs.pipeline.prune`) and run a `Pipeline` over them,
   forward and backward with GRPO's loss, as the trainer does. Busy time: the
   wall time of each `PipelineStage.forward_one_chunk` and `backward_one_chunk`
   (the stage's forward and its backward, loss included, on this rank; each
   chunk's counted once, checked), plus the loss's forward on the last stage;
   the step's wall time: from a barrier
   to the last rank's end of `Pipeline.run`. `measured` = mean over the ranks
   of 1 - busy / step, median of `--repeats` steps after a warm-up, against
   `closed_form` = (pp - 1) / (m + pp - 1) for gpipe and 1f1b, and
   (pp - 1) / (v m + pp - 1) with v = 2 stages a rank for interleaved. What the
   closed form leaves out (send and receive, the schedule's Python, stages of
   unequal cost, smaller micro-batches running less efficiently) shows as the
   difference.

3. `reshard`: the PP2 trainer (`pp2_1f1b`, publishing in the parts of a TP2
   replica's procs) to a 1-proc replica and to a TP2 replica, and the EP2
   trainer to a 1-proc qwen3_moe replica. The replicas are a benchmark actor
   (as benchmarks/weight_sync.py's): a model of other weights (seed 1), split
   over its procs as a TP2 policy replica's (`data_parallel` "tp"), pulling
   with a plain `WeightReceiver`, which copies every piece: the `hf` engine's
   `Policy` on the trainer's host serves whole pieces in place from the
   published slot (zero-copy), so what it copies would undercount what a
   replica on another host reads. `sync_s`: publish on every trainer proc and
   the pull on every replica proc, timed at the controller, median of
   `--repeats` after a warm-up; `bytes_read_over_share`: the bytes the
   replica's procs took (`Pulled.bytes_moved`, summed over its procs) over
   their share of the model (the bytes of their parameters, both procs of
   TP2). The alternative, `gather_first`, on the same trainer in the same run:
   the gather `Trainer.parameters` does (every stage's and every expert
   block's tensors, all-gathered to every trainer proc: `full_parameters`,
   `gather_blocks`, `pipeline.gather_over`), then rank 0 publishes the whole
   model (in the same replica parts) and the replica pulls it:
   `gather_first_sync_s`, `gather_s` (the gather alone, in the actor, slowest
   rank), `gather_bytes` (bytes the trainer procs received in it) and
   `gather_first_bytes_over_share` ((gather bytes + the replica's) / share).
   After each way the replica's weights are checked equal to the trainer's.

Prints a line per cell to stderr, then one JSON line with `layouts`, `bubble`,
`reshard` and the settings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from monarch.actor import Actor, endpoint  # noqa: E402

from actors.trainer import Trainer  # noqa: E402
from benchmarks.common import arguments, grpo_batch, grpo_loss  # noqa: E402
from meshrl.config import ModelConfig, OptimConfig  # noqa: E402
from meshrl.weights.publisher import WeightHandle, WeightPublisher  # noqa: E402
from meshrl.weights.receiver import WeightReceiver  # noqa: E402

TIMEOUT = 300
PP = 2
BUBBLE_MICROBATCHES = (2, 4, 8)
BUBBLE_SCHEDULES = ("gpipe", "1f1b", "interleaved")
CLOSED_FORM = {
    "gpipe": "(pp-1)/(m+pp-1)",
    "1f1b": "(pp-1)/(m+pp-1)",
    "interleaved": "(pp-1)/(v*m+pp-1), v=2",
}
# name: (moe, procs, procs that take the same rows, Trainer's layout arguments)
LAYOUTS = {
    "one": (False, 1, 1, dict(sharding="ddp")),
    "ddp2": (False, 2, 1, dict(sharding="ddp")),
    "pp2_gpipe": (False, 2, 2, dict(sharding="pp", pp=2, pp_schedule="gpipe")),
    "pp2_1f1b": (False, 2, 2, dict(sharding="pp", pp=2, pp_schedule="1f1b", replica_tp=2)),
    "pp2_interleaved": (False, 2, 2, dict(sharding="pp", pp=2, pp_schedule="interleaved")),
    "fsdp_pp4": (False, 4, 2, dict(sharding="fsdp_pp", pp=2, pp_schedule="gpipe")),
    "moe_one": (True, 1, 1, dict(sharding="ddp")),
    "ep2": (True, 2, 1, dict(sharding="ddp", ep=2)),
}
# cell: (trainer, replica role, replica procs)
RESHARD = {
    "pp2_to_1proc": ("pp2_1f1b", "replica_one", 1),
    "pp2_to_tp2": ("pp2_1f1b", "replica_tp2", 2),
    "ep2_to_1proc": ("ep2", "replica_moe", 1),
}
GATHER_FIRST = (
    "Trainer.parameters' gather (full_parameters, gather_blocks, pipeline.gather_over: "
    "every stage's and expert block's tensors all-gathered to every trainer proc), then "
    "trainer rank 0 publishes the whole model in the replica's parts and the replica pulls it"
)


def model_config(args, moe: bool = False) -> ModelConfig:
    cfg = ModelConfig.sized(args.hidden, args.layers, 256)
    return dataclasses.replace(cfg, arch="qwen3_moe") if moe else cfg


def param_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# --- 2. the bubble, measured outside the actors -------------------------------------


def _bubble_worker(rank: int, port: int, args, out) -> None:
    from torch.distributed.pipelining import stage as pipelining_stage

    from meshrl.model.models import load_model, sequence_positions, token_logprobs
    from meshrl.procs.pipeline import Pipeline, prune

    torch.set_num_threads(1)
    dist.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank=rank, world_size=PP)
    busy = [0.0]
    calls: dict[str, int] = {}

    def timed(fn, what: str):
        def run(*a, **kw):
            calls[what] = calls.get(what, 0) + 1
            started = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                busy[0] += time.perf_counter() - started

        return run

    base = pipelining_stage._PipelineStageBase
    for what in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        setattr(base, what, timed(getattr(base, what), what))
    batch = grpo_batch(args.rows, 4, args.prompt, args.completion, ragged=True).shard(0, 1)
    T = batch.num_completion_tokens
    loss = grpo_loss()

    def loss_of_rows(logits, rows):
        piece = batch.rows(rows)
        logprobs = token_logprobs(logits[:, :-1], piece.input_ids[:, -T:], 1.0)
        return loss(logprobs, piece)[0]

    loss_of_rows = timed(loss_of_rows, "loss")
    cells = {}
    for kind in BUBBLE_SCHEDULES:
        virtual = 2 if kind == "interleaved" else 1
        for m in BUBBLE_MICROBATCHES:
            model = load_model(model_config(args), seed=0).train()
            stages, indices = prune(model, PP, rank, virtual, sequence_positions)
            pipeline = Pipeline(
                stages, indices, PP * virtual, torch.device("cpu"), dist.group.WORLD, kind, m
            )
            runs = []
            for _ in range(1 + args.repeats):  # the first builds the schedule: not kept
                dist.barrier()
                busy[0] = 0.0
                calls.clear()
                started = time.perf_counter()
                pipeline.run(batch.input_ids, batch.attention_mask, T + 1, loss_of_rows)
                runs.append((busy[0], time.perf_counter() - started))
                chunks = m * virtual  # every chunk's forward and backward timed, once
                assert calls["forward_one_chunk"] == calls["backward_one_chunk"] == chunks, calls
                model.zero_grad(set_to_none=True)
            cells[(kind, m)] = runs[1:]
    parts: list = [None] * PP
    dist.all_gather_object(parts, cells)
    if rank == 0:
        out.put(parts)
    dist.barrier()
    dist.destroy_process_group()


def bubble_cells(args) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_bubble_worker, args=(port, args, out), nprocs=PP, start_method="spawn")
    ranks = out.get()
    figures: dict = {}
    for kind in BUBBLE_SCHEDULES:
        v = 2 if kind == "interleaved" else 1
        figures[kind] = {}
        for m in BUBBLE_MICROBATCHES:
            runs = [r[(kind, m)] for r in ranks]  # [rank][repeat] -> (busy, wall)
            steps = [max(rank[i][1] for rank in runs) for i in range(args.repeats)]
            shares = [
                statistics.mean(1 - rank[i][0] / steps[i] for rank in runs)
                for i in range(args.repeats)
            ]
            closed = (PP - 1) / (v * m + PP - 1)
            measured = statistics.median(shares)
            figures[kind][f"m{m}"] = {
                "measured": round(measured, 4),
                "closed_form": round(closed, 4),
                "measured_over_closed_form": round(measured / closed, 3),
                "step_s": round(statistics.median(steps), 4),
                "busy_s_per_rank": [
                    round(statistics.median(b for b, _ in rank), 4) for rank in runs
                ],
            }
            print(f"bubble {kind} m={m}: {figures[kind][f'm{m}']}", file=sys.stderr, flush=True)
    return figures


# --- 1. and 3.: trainers on meshes, replicas ------------------------------------------


class Gathering(Trainer):
    """The real trainer, plus the gather-first way to publish: the model gathered
    as `Trainer.parameters` gathers it, published whole from rank 0."""

    @endpoint
    def publish_gathered(self) -> tuple[WeightHandle | None, float, int]:
        from meshrl.procs.expert_parallel import gather_blocks
        from meshrl.procs.parallel import full_parameters
        from meshrl.procs.pipeline import gather_over

        started = time.perf_counter()
        state = {name: t.detach().clone() for name, t in full_parameters(self.model)}
        local = param_bytes(state.values())
        state = gather_blocks(state, self._blocks)
        if self.pipeline is not None:
            state = gather_over(state, self.pipeline.group)
        gathered_s = time.perf_counter() - started
        received = param_bytes(state.values()) - local
        if self.rank != 0:
            return None, gathered_s, received
        self.whole = state
        if getattr(self, "gathered", None) is None:
            self.gathered = WeightPublisher(
                None, parameters=lambda: iter(self.whole.items()), split=self._split
            )
        return self.gathered.publish(self.version), gathered_s, received

    @endpoint
    def bump(self) -> None:
        """A new version of the same weights (nothing trains between syncs)."""
        self.version += 1

    @endpoint
    def close(self) -> None:
        for publisher in [*self.publishers, getattr(self, "gathered", None)]:
            if publisher is not None:
                publisher.close()


class Replica(Actor):
    """A replica's receivers: a 1-proc replica (the whole model), or one proc of a
    TP2 replica (`master` given: the blocks a TP2 policy replica's proc holds).
    Every piece is copied (no zero-copy views): `bytes_moved` is what it read."""

    def __init__(self, model_cfg: ModelConfig, tp: int = 1, master=None):
        from monarch.actor import current_rank

        from meshrl.model.models import load_model
        from meshrl.procs.parallel import Ranks, data_parallel

        self.model = load_model(model_cfg, seed=1)  # other weights than the trainer's
        if tp > 1:
            rank = current_rank().rank
            data_parallel(self.model, Ranks(torch.device("cpu"), rank, tp, master), "tp", tp)
        self.receivers: dict[str, WeightReceiver] = {}

    @endpoint
    def pull(self, handle: WeightHandle, way: str) -> tuple[int, int, bool]:
        """Bytes it took, its share (the bytes of its parameters), verified."""
        receiver = self.receivers.setdefault(way, WeightReceiver(self.model))
        pulled = receiver.pull(handle)
        share = param_bytes(getattr(p, "_local_tensor", p) for p in self.model.parameters())
        return pulled.bytes_moved, share, pulled.verified

    @endpoint
    def parameters(self) -> dict[str, torch.Tensor]:
        from meshrl.procs.parallel import full_parameters

        return {n: p.detach().clone() for n, p in full_parameters(self.model)}


def rss_mb(pid: int) -> float:
    """A process's resident-set high-water mark (VmHWM), MB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    raise ValueError(f"no VmHWM for pid {pid}")


def mesh_cells(args) -> tuple[dict, dict]:
    from meshrl.procs.mesh import RoleMeshes, call_all, call_each

    batch = grpo_batch(args.rows, 4, args.prompt, args.completion, ragged=True)
    roles = {name: procs for name, (_, procs, _, _) in LAYOUTS.items()}
    roles.update({role: procs for _, role, procs in RESHARD.values()})
    meshes = RoleMeshes(roles, threads_per_proc=1)
    layouts: dict = {}
    reshard: dict = {}
    trainers: dict = {}
    try:
        base = {name: [rss_mb(pid) for pid in meshes.pids[name]] for name in LAYOUTS}
        for name, (moe, procs, _, layout) in LAYOUTS.items():
            trainers[name] = meshes.spawn(
                name,
                f"trainer_{name}",
                Gathering if any(t == name for t, _, _ in RESHARD.values()) else Trainer,
                model_config(args, moe),
                OptimConfig(),
                grpo_loss(),
                100,
                master=meshes.rendezvous(name) if procs > 1 else ("127.0.0.1", 0),
                pp_microbatches=args.microbatches,
                **layout,
            )
        replicas = {
            role: meshes.spawn(
                role,
                "replica",
                Replica,
                model_config(args, moe=role == "replica_moe"),
                procs,
                meshes.rendezvous(role) if procs > 1 else None,
            )
            for _, role, procs in RESHARD.values()
        }
        for name, actors in trainers.items():  # every trainer built (a cheap endpoint)
            call_all(actors, "set_temperature", 1.0, what=f"{name}.init", timeout_s=TIMEOUT)

        # 1. step time and peak memory, one layout at a time
        for name, (_, procs, group, _) in LAYOUTS.items():
            shards = [(s,) for s in batch.shards(procs, group)]
            times, norm = [], None
            for i in range(1 + args.steps):
                started = time.perf_counter()
                metrics = call_each(trainers[name], "train_step", shards, name, TIMEOUT)
                times.append(time.perf_counter() - started)
                norm = metrics[0]["train/grad_norm"] if i == 0 else norm
            layouts[name] = {
                "procs": procs,
                "step_s": round(statistics.median(times[1:]), 4),
                "grad_norm": round(norm, 6),
                "peak_rss_mb": [rss_mb(pid) for pid in meshes.pids[name]],
                "base_rss_mb": base[name],
            }
            print(f"{name}: {layouts[name]}", file=sys.stderr, flush=True)
        for name, (moe, _, _, _) in LAYOUTS.items():
            one = layouts["moe_one" if moe else "one"]["step_s"]
            layouts[name]["step_over_one"] = round(layouts[name]["step_s"] / one, 3)

        # 3. reshard: direct against gather first
        for cell, (name, role, replica_procs) in RESHARD.items():
            trainer, replica = trainers[name], replicas[role]

            def pull(handle: WeightHandle, way: str, replica=replica) -> tuple[int, int, bool]:
                answers = call_all(replica, "pull", handle, way, what="pull", timeout_s=TIMEOUT)
                moved, share = sum(a[0] for a in answers), sum(a[1] for a in answers)
                return moved, share, all(a[2] for a in answers)

            def direct(trainer=trainer, pull=pull, cell=cell):
                call_all(trainer, "bump", what="bump", timeout_s=TIMEOUT)
                started = time.perf_counter()
                handles = call_all(trainer, "publish", what="publish", timeout_s=TIMEOUT)
                handle = WeightHandle.merge(handles)
                moved, share, verified = pull(handle, cell)
                return time.perf_counter() - started, moved, share, verified, len(handle.sources)

            def gathered(trainer=trainer, pull=pull, cell=cell):
                call_all(trainer, "bump", what="bump", timeout_s=TIMEOUT)
                started = time.perf_counter()
                answers = call_all(trainer, "publish_gathered", what="gather", timeout_s=TIMEOUT)
                moved, share, verified = pull(answers[0][0], f"{cell}_gathered")
                total = time.perf_counter() - started
                gather_s = max(a[1] for a in answers)
                return total, moved, share, verified, gather_s, sum(a[2] for a in answers)

            whole = call_all(trainer, "parameters", what="params", timeout_s=TIMEOUT)[0]
            ways = {}
            for way, sync in (("direct", direct), ("gathered", gathered)):
                runs = [sync() for _ in range(1 + args.repeats)][1:]  # warm-up: slots made
                ways[way] = runs
                got = call_all(replica, "parameters", what="params", timeout_s=TIMEOUT)[0]
                assert got.keys() == whole.keys(), (cell, way)
                assert all(torch.equal(got[k], whole[k]) for k in whole), (cell, way)
            d, g = ways["direct"], ways["gathered"]
            sync_s = statistics.median(r[0] for r in d)
            gather_sync_s = statistics.median(r[0] for r in g)
            share = d[0][2]
            gather_bytes = g[0][5]
            reshard[cell] = {
                "trainer": name,
                "replica_procs": replica_procs,
                "sources": d[0][4],
                "sync_s": round(sync_s, 4),
                "bytes_moved": d[0][1],
                "share_bytes": share,
                "bytes_read_over_share": round(d[0][1] / share, 4),
                "gather_first_sync_s": round(gather_sync_s, 4),
                "gather_s": round(statistics.median(r[4] for r in g), 4),
                "gather_bytes": gather_bytes,
                "gather_first_bytes_over_share": round((gather_bytes + g[0][1]) / share, 4),
                "sync_over_gather_first": round(sync_s / gather_sync_s, 3),
                "verified": all(r[3] for r in d + g),
                "equal_to_trainer": True,
            }
            print(f"{cell}: {reshard[cell]}", file=sys.stderr, flush=True)
    finally:
        for name in {t for t, _, _ in RESHARD.values() if t in trainers}:
            with contextlib.suppress(Exception):  # best effort: the procs stop next
                call_all(trainers[name], "close", what="close", timeout_s=60)
        meshes.stop()
    return layouts, reshard


def main() -> int:
    parser = arguments(__doc__, hidden=128, layers=4, rows=16, prompt=32, completion=96)
    parser.add_argument(
        "--microbatches", type=int, default=4, help="trainer cells' pp micro-batches"
    )
    parser.add_argument("--steps", type=int, default=5, help="timed train steps a layout")
    parser.add_argument("--repeats", type=int, default=5, help="timed syncs and bubble steps")
    args = parser.parse_args()
    started, load = time.perf_counter(), os.getloadavg()[0]
    bubble = bubble_cells(args)
    layouts, reshard = mesh_cells(args)
    from meshrl.model.models import load_model

    figures = {
        "layouts": layouts,
        "bubble": {"pp": PP, "closed_form": CLOSED_FORM, **bubble},
        "reshard": reshard,
        "gather_first": GATHER_FIRST,
        "settings": {
            "hidden": args.hidden,
            "layers": args.layers,
            "params": param_bytes(load_model(model_config(args)).parameters()) // 4,
            "moe_params": param_bytes(load_model(model_config(args, True)).parameters()) // 4,
            "rows": args.rows,
            "prompt_tokens": args.prompt,
            "completion_tokens": args.completion,
            "pp_microbatches": args.microbatches,
            "timed_steps": args.steps,
            "repeats": args.repeats,
            "threads_per_proc": 1,
            "cores": os.cpu_count(),
            "peak": "VmHWM of /proc/<pid>/status (the proc's ru_maxrss), glibc's default malloc",
            "loadavg_1m": [round(load, 2), round(os.getloadavg()[0], 2)],
            "wall_s": round(time.perf_counter() - started, 1),
        },
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
