"""Stragglers: 4 policy replicas, one of them 4x slower (a `faults.slow` drill),
and environment latency with a heavy tail (5% of episodes 20x slower,
`faults.episode_latency`), trained with today's static split and with work by
pull, against the same pull run without the slow replica, in one run of this
script.

    python benchmarks/stragglers.py              # 20 steps each
    python benchmarks/stragglers.py --steps 40

Prints one JSON line:
- `step_s_static`: mean step time, each step's batch split evenly over the replicas;
- `step_s_pull`: mean step time with `rollout.dispatch=pull` (`--overprovision`:
  `rollout.overprovision`; with `--staleness 1` late groups are kept a step);
- `step_s_no_straggler`: the pull run without the slow replica;
- `straggler_ratio`: step_s_pull / step_s_no_straggler (goal <= 1.3);
- `trainer_idle_fraction`: of the pull run's step time, the share the trainer
  waited for rollouts (`time/rollout_s` / `time/step_s`);
- `bias_ks`: the largest `rollout/bias_ks_latency` of the pull run after its
  first `--skip` steps: the KS distance between trained and completed
  groups' latency (goal <= 0.05).

Every variant runs the same steps of the same config in this process (its
first steps, while procs boot and the window fills, are left out of the
means: `--skip`). The replicas sleep to be slow, so the 2 cores of this
machine are not what is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.pins import run_grpo  # noqa: E402

SLOW = "faults.slow=[policy:3x4@0]"
LATENCY = "faults.episode_latency=0.02,0.05x20"


PINNED = (
    "placement.policy=4",
    "placement.environment=2",
    "placement.threads_per_proc=1",
    "rollout.groups_per_call=2",
    # Generation that costs more with more rows (the default model's calls are
    # mostly overhead on a CPU), as in tests/e2e/test_elastic.py.
    "model.hidden_size=256",
    "model.intermediate_size=1024",
    "generation.max_new_tokens=16",
    "generation.min_new_tokens=16",
    "warm_start.steps=0",
    LATENCY,
)
"""Every run's settings, before its own."""


def mean(history: list[dict], key: str, skip: int) -> float:
    values = [r[key] for r in history[skip:]]
    return sum(values) / len(values)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip", type=int, default=3, help="first steps left out of the means")
    parser.add_argument("--overprovision", type=float, default=0.0)
    parser.add_argument(
        "--staleness",
        type=int,
        default=0,
        help="max_staleness of every variant (>= 1: generation overlaps training, and "
        "over-provisioned groups that complete late are trained next step)",
    )
    args = parser.parse_args()
    run_dir = tempfile.mkdtemp(prefix="meshrl-stragglers-")
    pull = ("rollout.dispatch=pull", f"rollout.overprovision={args.overprovision}")
    staleness = f"max_staleness={args.staleness}"
    steps = (f"steps={args.steps}", *PINNED, staleness)
    static = run_grpo(run_dir, "static", *steps, SLOW)
    pulled = run_grpo(run_dir, "pull", *steps, SLOW, *pull)
    even = run_grpo(run_dir, "no_straggler", *steps, *pull)
    step_s = {
        name: mean(h, "time/step_s", args.skip)
        for name, h in (("static", static), ("pull", pulled), ("no_straggler", even))
    }
    figures = {
        "step_s_static": round(step_s["static"], 4),
        "step_s_pull": round(step_s["pull"], 4),
        "step_s_no_straggler": round(step_s["no_straggler"], 4),
        "straggler_ratio": round(step_s["pull"] / step_s["no_straggler"], 3),
        "pull_speedup_over_static": round(step_s["static"] / step_s["pull"], 3),
        "trainer_idle_fraction": round(
            mean(pulled, "time/rollout_s", args.skip) / step_s["pull"], 3
        ),
        "bias_ks": round(max(r["rollout/bias_ks_latency"] for r in pulled[args.skip :]), 4),
        "bias_ks_length": round(max(r["rollout/bias_ks_length"] for r in pulled[args.skip :]), 4),
        "late_groups_trained": sum(r["rollout/late_groups"] for r in pulled),
        "dropped_pull": pulled[-1]["samples/dropped_total"],
        "steps": args.steps,
        "skip": args.skip,
        "max_staleness": args.staleness,
        "overprovision": args.overprovision,
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
