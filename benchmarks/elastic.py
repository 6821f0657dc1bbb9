"""Elastic policy pool: GRPO grows from 1 to 3 policy replicas at step 20 and
shrinks back to 1 at step 40 (`pool.schedule`), against a fixed pool of one
replica with the same seed, in one run of this script.

    python benchmarks/elastic.py                 # 60 steps
    python benchmarks/elastic.py --steps 30 --grow 10 --shrink 20

Prints one JSON line:
- `tokens_per_s`: completion tokens per second of step time, for each phase
  (before the growth, while grown, after the shrink; the first 2 steps left
  out) of the elastic run, and the same step ranges of the fixed run;
- `scale_s`: the seconds each change took (spawn, load, pull; not in step time);
- `lost`: samples generated but neither trained nor dropped (must be 0);
- `duplicated`: samples trained beyond one batch per step (must be 0);
- `final_params_equal_fixed_pool`: whether the elastic run's final weights
  equal the fixed run's, bit for bit (each sample's seed is the controller's,
  and with work by pull every generate call has the same rows at any pool
  size); `max_param_diff` and `first_step_rewards_differ` say how far apart.

On a machine with fewer cores than replicas, more replicas do not generate
faster: the figures say what this machine gives, not what a GPU host would.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import tempfile
from contextlib import redirect_stdout
from io import StringIO

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from algorithms.grpo import GRPO  # noqa: E402
from benchmarks.pins import grpo_config  # noqa: E402

SKIP = 2


def run(
    run_dir: str, name: str, steps: int, schedule: list[str]
) -> tuple[list[dict], str, str, int]:
    cfg = grpo_config(
        f"steps={steps}",
        "job.max_procs.policy=3",
        # Work by pull, two groups a call: every generate call has the same rows
        # whatever the pool's size, so the sampler's numerics are the same too (a
        # static split gives each replica a part of another shape).
        "rollout.dispatch=pull",
        "rollout.groups_per_call=2",
        f"pool.schedule=[{','.join(schedule)}]",
        f"run.dir={run_dir}",
        f"run.name={name}",
        "run.progress=false",
    )
    out = StringIO()
    algo = GRPO(cfg)
    with redirect_stdout(out):
        history = algo.run()
    return history, algo.run_dir, out.getvalue(), cfg.prompts_per_step * cfg.group_size


def tokens_per_s(history: list[dict], first: int, last: int) -> float:
    first = max(first, SKIP)  # the first steps warm the procs up
    rows = [r for r in history if first <= r["step"] < last]
    return round(sum(r["tokens/generated"] for r in rows) / sum(r["time/step_s"] for r in rows), 1)


def final_weights(run_dir: str) -> dict:
    from safetensors.torch import load_file

    (path,) = glob.glob(f"{run_dir}/final/*.safetensors")
    return load_file(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--grow", type=int, default=20, help="the step the pool grows to 3")
    parser.add_argument("--shrink", type=int, default=40, help="the step it shrinks to 1")
    args = parser.parse_args()
    run_dir = tempfile.mkdtemp(prefix="meshrl-elastic-")
    schedule = [f"policy=3@{args.grow}", f"policy=1@{args.shrink}"]
    elastic, elastic_dir, out, batch = run(run_dir, "elastic", args.steps, schedule)
    fixed, fixed_dir, _, _ = run(run_dir, "fixed", args.steps, [])
    phases = {
        f"steps_0-{args.grow - 1}_1_replica": (0, args.grow),
        f"steps_{args.grow}-{args.shrink - 1}_3_replicas": (args.grow, args.shrink),
        f"steps_{args.shrink}-{args.steps - 1}_1_replica": (args.shrink, args.steps),
    }
    last = elastic[-1]
    dropped = last["samples/dropped_total"]
    a, b = final_weights(elastic_dir), final_weights(fixed_dir)
    figures = {
        "tokens_per_s": {name: tokens_per_s(elastic, *span) for name, span in phases.items()},
        "tokens_per_s_fixed_pool": {
            name: tokens_per_s(fixed, *span) for name, span in phases.items()
        },
        "scale_s": [float(s) for s in re.findall(r"procs in ([\d.]+)s", out)],
        "pool_sizes": sorted({r["pool/policy_size"] for r in elastic}),
        "lost": last["samples/generated_total"] - last["samples/trained_total"] - dropped,
        "duplicated": last["samples/trained_total"] - batch * args.steps,
        "dropped": dropped,
        "final_params_equal_fixed_pool": a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a),
        "max_param_diff": max((a[k] - b[k]).abs().max().item() for k in a),
        "first_step_rewards_differ": next(
            (
                x["step"]
                for x, y in zip(elastic, fixed, strict=True)
                if x["reward/mean"] != y["reward/mean"]
            ),
            None,
        ),
        "steps": args.steps,
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
