"""What a GRPO step costs the controller as the replicas grow: GRPO's own loop
(`algorithms/grpo.py`, unchanged) driving N stand-in policy replicas and N
stand-in environments, in one run.

    python benchmarks/controller_scale.py                  # N = 1, 2, 4, 8, 16, 24
    python benchmarks/controller_scale.py --replicas 1 4 --steps 10

The stand-ins load no model: each endpoint sleeps a fixed compute time and
returns a payload of a real one's size (a replica: 64 completions of
`generation.max_new_tokens` tokens with log-probs; an environment: 64 rewards;
the trainer: its metrics and a weight handle). The batch grows with N (64
completions per replica), as a real run scales out. Everything else is the
real loop: prompts drawn and tokenized, generation sent per replica slice,
collection, scoring over the environment mesh, advantages, the trainer's
shards, the weight sync (a pull per replica), the metrics report and the
step log.

Per N, over the steps after the first two:
- `step_s`: the mean step;
- `compute_s`: what the stand-ins sleep in a step when the phases run one
  after another (the least a step can take);
- `overhead_s = step_s - compute_s`: the controller and the actor runtime;
- `controller_share = overhead_s / step_s` (the goal: <= 5% at the largest N);
- `controller_cpu_s`: CPU seconds of the controller process a step (its
  Python and Monarch's client threads), `loop_thread_cpu_s` of the loop's own
  thread, and `per_replica_ms` of the whole.
Each stand-in replica reports a host of its own, as on a cluster. Runs with
the star (`weights.fanout=0`: one call to the whole mesh) and with relays
(`weights.fanout=2`: log2 N levels of calls, one per replica). Prints a
table, then one JSON line. N stops at 24 here: 2N + 1 procs of about 300 MB
each share this machine's 24 GB and 2 cores (the stand-ins' own runtime
threads then compete with the controller's, so the shares measured here are
an upper bound). `--profile N` profiles the controller's Python instead.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import tempfile
import time
from itertools import pairwise

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from monarch.actor import Actor, current_rank, endpoint  # noqa: E402

import actors.environment  # noqa: E402
import actors.policy  # noqa: E402
import actors.trainer  # noqa: E402
from algorithms.grpo import GRPO  # noqa: E402
from benchmarks.pins import grpo_config  # noqa: E402
from meshrl.observe.telemetry import observed  # noqa: E402
from meshrl.procs.faults import Drillable  # noqa: E402
from meshrl.types import Completions  # noqa: E402
from meshrl.weights.publisher import WeightHandle, WeightSource, host_id  # noqa: E402
from meshrl.weights.receiver import Pulled  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fanout import save_line  # noqa: E402

GENERATE_S, SCORE_S, TRAIN_S, PULL_S = 0.5, 0.05, 0.3, 0.02
ROWS_PER_REPLICA = 64


class StandInPolicy(Drillable, Actor):
    role = "policy"

    def __init__(self, model_cfg, seed=0, policy_cfg=None, context=2048, shm_prefix=None):
        self.version = -1
        self.rank = current_rank().rank
        self.host = f"{host_id()}/standin-{self.rank}"  # as if on a machine of its own

    @endpoint
    @observed
    def generate(self, prompt_ids, generation, seeds=None, images=None) -> Completions:
        time.sleep(GENERATE_S)
        rows, width, tokens = len(prompt_ids), max(map(len, prompt_ids)), generation.max_new_tokens
        return Completions(
            prompt_ids=torch.ones(rows, width, dtype=torch.long),
            prompt_mask=torch.ones(rows, width),
            completion_ids=torch.randint(3, 12, (rows, tokens)),
            completion_mask=torch.ones(rows, tokens),
            logprobs=-torch.rand(rows, tokens),
            weight_version=self.version,
        )

    @endpoint
    def host_id(self) -> str:
        return self.host

    @endpoint
    @observed
    def load_weights(self, handle, serve=False, timeout_s=None) -> Pulled:
        time.sleep(PULL_S)
        self.version = handle.version
        relay = WeightHandle(handle.version, [standin_source(self.host)]) if serve else None
        return Pulled(self.version, "rdma", 0, relay)


class StandInEnvironment(Drillable, Actor):
    role = "environment"

    def __init__(self, *args):
        pass

    @endpoint
    @observed
    def score(self, prompts, completion_ids):
        time.sleep(SCORE_S)
        return [float(len(c) % 2) for c in completion_ids], {}


class StandInTrainer(Drillable, Actor):
    role = "trainer"

    def __init__(self, *args, **kwargs):
        self.version = 0

    @endpoint
    @observed
    def train_step(self, batch) -> dict[str, float]:
        time.sleep(TRAIN_S)
        self.version += 1
        return {"train/loss": 0.0, "loss/policy": 0.0, "train/lr": 1e-3}

    @endpoint
    @observed
    def publish(self, verify: bool = True, delta: bool = False) -> WeightHandle:
        return WeightHandle(self.version, [standin_source(f"{host_id()}/trainer")])

    @endpoint
    def set_temperature(self, temperature: float) -> None:
        pass


def standin_source(host: str) -> WeightSource:
    return WeightSource(host, [], [], [], [], 0)


class Timed(GRPO):
    """GRPO that notes the controller's CPU time at each step's end (and, with a
    `profiler`, profiles the controller from the third step on)."""

    def after_step(self, step, metrics):
        metrics["controller/cpu_s"] = time.process_time()
        metrics["controller/python_cpu_s"] = time.thread_time()  # the loop's own thread
        super().after_step(step, metrics)
        # The profiler hangs off a module: this class travels to the trainer by value
        # (the loss hook holds the algorithm), a module only by name.
        profiler = getattr(cProfile, "controller_profiler", None)
        if profiler is not None and step == 1:
            profiler.enable()


def measure(n: int, steps: int, relay: bool) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = grpo_config(
            f"steps={steps}",
            f"prompts_per_step={8 * n}",
            "group_size=8",
            "kl_coef=0",
            "warm_start.steps=0",
            f"placement.policy={n}",
            f"placement.environment={n}",
            "placement.threads_per_proc=1",
            f"weights.fanout={2 if relay else 0}",
            "weights.verify=false",  # the stand-ins hold no weights to check
            "trainer.recompute_old_logprobs=false",
            f"run.dir={run_dir}",
            "run.name=scale",
            "run.progress=false",
            "run.save_final=false",
        )
        history = Timed(cfg).run()[2:]
    steps_s = [r["time/step_s"] for r in history]
    cpu = [b["controller/cpu_s"] - a["controller/cpu_s"] for a, b in pairwise(history)]
    loop = [
        b["controller/python_cpu_s"] - a["controller/python_cpu_s"] for a, b in pairwise(history)
    ]
    step = sum(steps_s) / len(steps_s)
    depth = max(r["weights/max_hop_depth"] for r in history)
    compute = GENERATE_S + SCORE_S + TRAIN_S + PULL_S * depth
    cpu_s = sum(cpu) / len(cpu)
    return {
        "replicas": n,
        "step_s": round(step, 4),
        "compute_s": round(compute, 4),
        "overhead_s": round(step - compute, 4),
        "controller_share": round((step - compute) / step, 4),
        "controller_cpu_s": round(cpu_s, 4),
        "loop_thread_cpu_s": round(sum(loop) / len(loop), 4),
        "per_replica_ms": round(cpu_s / n * 1e3, 3),
        "max_hop_depth": history[-1]["weights/max_hop_depth"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4, 8, 16, 24])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument(
        "--profile", type=int, default=0, help="only profile the controller at this N (star)"
    )
    parser.add_argument("--save", help="also write the JSON line to this file")
    args = parser.parse_args()
    # GRPO's loop, unchanged, with the stand-ins in place of the real actors (its
    # run() imports each actor class from its module when it spawns the meshes).
    actors.policy.Policy = StandInPolicy
    actors.environment.Environment = StandInEnvironment
    actors.trainer.Trainer = StandInTrainer
    if args.profile:
        cProfile.controller_profiler = profiler = cProfile.Profile()
        measure(args.profile, args.steps, relay=False)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(45)
        return 0
    rows = {"star": [], "relay": []}
    for n in args.replicas:
        for way in rows:
            rows[way].append(measure(n, args.steps, way == "relay"))
            print(f"{way:>5} {rows[way][-1]}", flush=True)
    print(
        f"\n{'N':>4} {'way':>6} {'step s':>8} {'overhead s':>11} {'share':>7} "
        f"{'ctrl cpu s':>11} {'ms/replica':>11} {'depth':>6}"
    )
    for way, table in rows.items():
        for r in table:
            print(
                f"{r['replicas']:>4} {way:>6} {r['step_s']:>8.3f} {r['overhead_s']:>11.3f} "
                f"{r['controller_share']:>7.1%} {r['controller_cpu_s']:>11.3f} "
                f"{r['per_replica_ms']:>11.2f} {r['max_hop_depth']:>6}"
            )
    largest = {way: table[-1] for way, table in rows.items()}
    line = json.dumps(
        {
            "stand_in_compute_s": {
                "generate": GENERATE_S,
                "score": SCORE_S,
                "train": TRAIN_S,
                "pull": PULL_S,
            },
            "star": rows["star"],
            "relay": rows["relay"],
            "goal_share_at_largest": {w: r["controller_share"] <= 0.05 for w, r in largest.items()},
        }
    )
    print(line)
    save_line(line, args.save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
