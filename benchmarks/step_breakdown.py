"""Where a GRPO step's time goes: generate, score, reference, train, weight sync,
and what the controller itself spends between them.

    python benchmarks/step_breakdown.py                 # 100 steps of the default
    python benchmarks/step_breakdown.py --steps 30 model.hidden_size=256
    python benchmarks/step_breakdown.py --eval          # what held-out evaluation costs

Runs the default GRPO config (with a reference: kl_coef 0.01) synchronously
(`max_staleness=0`, so the phases do not overlap) and averages each phase over
the steps after the first. Controller overhead is the step's time minus its
phases: prompt sampling and tokenizing, batch building, advantages, metrics.
Each phase is also split into the endpoint's own time, measured inside the
actor (`time/<role>/<endpoint>_s`), and the rest: the actor runtime's round
trip and the pickling of what travels (`<phase>_runtime_s`), which a single
process like TRL's does not pay. Prints a table, then one JSON object with
`controller_overhead_fraction` and each phase's mean seconds, share and
runtime part.

`--telemetry` instead runs the same config with Monarch's telemetry off, on
(`run.telemetry=true`), and on with its dashboard (`run.dashboard=true`), each
variant in a fresh process (the telemetry sink a process installs stays for its
life), in `--rounds` interleaved rounds, and prints the mean step of each and
the two overheads as fractions of the first.

`--profile` runs it with `run.profile_steps` on two steps in the middle and
prints, beside the phases above, where those steps' time went per role as the
profiler measured it in every proc (`meshrl.observe.profile`).

`--eval` instead runs the same config three times in one go: without
evaluation, with a held-out set (64 prompts x 4 samples every 10 steps) on the
policy replicas between steps, and with it on an eval mesh of its own. It
prints the mean wall time a step (the step plus its evaluation work) of each,
and the two overheads as fractions of the first. Every variant runs one torch
thread a proc, so that the eval mesh's extra proc does not change how the
cores are shared.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from algorithms.grpo import GRPO  # noqa: E402
from benchmarks.common import arguments  # noqa: E402
from benchmarks.pins import grpo_config  # noqa: E402

PHASES = ["generate", "score", "reference", "train", "weight_sync"]
ENDPOINTS = {  # phase -> the endpoints (time/<role>/<name>_s) that do its work
    "generate": ["policy/generate"],
    "score": ["environment/score"],
    "reference": ["reference/logprobs"],
    "train": ["trainer/train_step"],
    "weight_sync": ["trainer/publish", "policy/load_weights"],
}


EVAL = ["eval.every=10", "eval.sets.heldout.prompts=64", "eval.sets.heldout.k=4"]


def settings(steps: int, overrides: list[str], run_dir: str, name: str) -> list[str]:
    """The benchmark's keys around `overrides`: a run of `steps` named `name`."""
    return [
        f"steps={steps}",
        "kl_coef=0.01",
        "max_staleness=0",
        *overrides,
        f"run.dir={run_dir}",
        f"run.name={name}",
        "run.progress=false",
        "run.save_final=false",
    ]


def run(steps: int, overrides: list[str]) -> list[dict]:
    """The records of a GRPO run of the default config, the first step left out."""
    with tempfile.TemporaryDirectory() as run_dir:
        # `UNMEASURED` first: the variants' evaluation keys come after, in `overrides`
        cfg = grpo_config(*settings(steps, overrides, run_dir, "breakdown"))
        return GRPO(cfg).run()[1:]


def against_first(means: dict[str, float], **extra) -> dict:
    """Variant -> mean seconds a step (the baseline first) as one JSON line's
    figures: `step_s` of each, and `overhead` of each other as a fraction of
    the baseline's."""
    base = next(iter(means.values()))
    return {
        "step_s": {name: round(mean, 5) for name, mean in means.items()},
        "overhead": {name: round(mean / base - 1, 4) for name, mean in list(means.items())[1:]},
        **extra,
    }


def evaluation_cost(steps: int, overrides: list[str]) -> int:
    """Mean wall time a step (`time/step_s` + `time/eval_s`) without evaluation,
    with it on the replicas, and with it on an eval mesh: one JSON line."""
    variants = {"none": [], "replicas": EVAL, "mesh": [*EVAL, "eval.mesh=true"]}
    means = {}
    for name, extra in variants.items():
        # One torch thread a proc in every variant: else the eval mesh's extra proc
        # changes how the cores are shared, and so every phase's speed.
        history = run(steps, ["placement.threads_per_proc=1", *overrides, *extra])
        total = sum(r["time/step_s"] + r.get("time/eval_s", 0.0) for r in history)
        means[name] = total / len(history)
        print(f"{name:<10}{means[name] * 1e3:>9.2f} ms a step", flush=True)
    print(json.dumps(against_first(means, steps_averaged=steps - 1)))
    return 0


TELEMETRY = {"off": [], "telemetry": ["run.telemetry=true"], "dashboard": ["run.dashboard=true"]}


def run_process(steps: int, overrides: list[str], run_dir: str, name: str) -> list[dict]:
    """The records of a GRPO run in its own process, the first step left out."""
    import subprocess

    command = [
        sys.executable,
        "-m",
        "algorithms.grpo",
        "--config",
        os.path.join(REPO, "algorithms", "configs", "grpo_default.yaml"),
        *settings(steps, overrides, run_dir, name),
        "run.dashboard_port=0",
    ]
    subprocess.run(command, cwd=REPO, check=True, capture_output=True, timeout=3600)
    with open(os.path.join(run_dir, name, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f][1:]


def telemetry_cost(steps: int, rounds: int, overrides: list[str]) -> int:
    """Mean step with telemetry off, on, and with the dashboard: one JSON line."""
    steps_s: dict[str, list[float]] = {name: [] for name in TELEMETRY}
    with tempfile.TemporaryDirectory() as run_dir:
        for r in range(rounds):
            for name, extra in TELEMETRY.items():
                history = run_process(steps, [*overrides, *extra], run_dir, f"{name}-{r}")
                steps_s[name] += [rec["time/step_s"] for rec in history]
                mean = sum(steps_s[name]) / len(steps_s[name])
                print(f"round {r} {name:<10}{mean * 1e3:>9.2f} ms a step so far", flush=True)
    means = {name: sum(v) / len(v) for name, v in steps_s.items()}  # ("off" first)
    print(json.dumps(against_first(means, steps_averaged_each=len(steps_s["off"]))))
    return 0


def profiled_roles(steps: int, overrides: list[str]) -> dict:
    """Two steps in the middle, profiled in every proc: their per-role summary."""
    from meshrl.observe.profile import table

    middle = max(1, steps // 2)
    with tempfile.TemporaryDirectory() as run_dir:
        run_process(steps, [*overrides, f"run.profile_steps=[{middle},{middle + 1}]"], run_dir, "p")
        pattern = os.path.join(run_dir, "p", "profile", "steps_*", "summary.json")
        with open(glob.glob(pattern)[0]) as f:
            summary = json.load(f)
    print(f"\nprofiled steps, seconds per role (meshrl.observe.profile):\n{table(summary)}")
    return summary


def main() -> int:
    parser = arguments(__doc__, steps=100)
    parser.add_argument("--eval", action="store_true", help="what held-out evaluation costs")
    parser.add_argument("--telemetry", action="store_true", help="what Monarch telemetry costs")
    parser.add_argument("--rounds", type=int, default=2, help="with --telemetry")
    parser.add_argument("--profile", action="store_true", help="also profile two steps")
    parser.add_argument("overrides", nargs="*", help="config key=value")
    args = parser.parse_args()
    if args.eval:
        return evaluation_cost(args.steps, args.overrides)
    if args.telemetry:
        return telemetry_cost(args.steps, args.rounds, args.overrides)
    history = run(args.steps, args.overrides)

    def mean(key: str) -> float:
        return sum(r.get(key, 0.0) for r in history) / len(history)

    step = mean("time/step_s")
    phases = {p: mean(f"time/{p}_s") for p in PHASES}
    inside = {p: sum(mean(f"time/{e}_s") for e in ENDPOINTS[p]) for p in PHASES}
    overhead = step - sum(phases.values())
    figures = {
        "controller_overhead_fraction": round(overhead / step, 4),
        "step_s": round(step, 5),
        "controller_overhead_s": round(overhead, 5),
        **{f"{p}_s": round(v, 5) for p, v in phases.items()},
        **{f"{p}_fraction": round(v / step, 4) for p, v in phases.items()},
        **{f"{p}_runtime_s": round(phases[p] - inside[p], 5) for p in PHASES if phases[p]},
        "steps_averaged": len(history),
    }
    print(f"\n{'phase':<22}{'mean ms':>9}{'share':>8}{'in actor ms':>13}{'runtime ms':>12}")
    for name, seconds in phases.items():
        print(
            f"{name:<22}{seconds * 1e3:>9.2f}{seconds / step:>8.1%}"
            f"{inside[name] * 1e3:>13.2f}{(seconds - inside[name]) * 1e3:>12.2f}"
        )
    print(f"{'controller overhead':<22}{overhead * 1e3:>9.2f}{overhead / step:>8.1%}")
    print(f"{'step':<22}{step * 1e3:>9.2f}")
    if args.profile:
        steps = profiled_roles(args.steps, args.overrides)["steps"]
        for role in sorted({r for s in steps for r in s["roles"]}):
            figures[f"profiled_{role}_s"] = round(
                sum(s["roles"].get(role, 0.0) for s in steps) / len(steps), 5
            )
        figures["profiled_between_s"] = round(sum(s["between_s"] for s in steps) / len(steps), 5)
        figures["profiled_step_s"] = round(sum(s["step_s"] for s in steps) / len(steps), 5)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
