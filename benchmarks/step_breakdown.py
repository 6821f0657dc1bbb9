"""Where a GRPO step's time goes: generate, score, reference, train, weight sync,
and what the controller itself spends between them.

    python benchmarks/step_breakdown.py                 # 100 steps of the default
    python benchmarks/step_breakdown.py --steps 30 model.hidden_size=256

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
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from algorithms.grpo import GRPO, GRPOConfig  # noqa: E402
from meshrl.config import load_config  # noqa: E402

PHASES = ["generate", "score", "reference", "train", "weight_sync"]
ENDPOINTS = {  # phase -> the endpoints (time/<role>/<name>_s) that do its work
    "generate": ["policy/generate"],
    "score": ["environment/score"],
    "reference": ["reference/logprobs"],
    "train": ["trainer/train_step"],
    "weight_sync": ["trainer/publish", "policy/load_weights"],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("overrides", nargs="*", help="config key=value")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = load_config(
            GRPOConfig,
            os.path.join(REPO, "algorithms", "configs", "grpo_default.yaml"),
            [
                f"steps={args.steps}",
                "kl_coef=0.01",
                "max_staleness=0",
                *args.overrides,
                f"run.dir={run_dir}",
                "run.name=breakdown",
                "run.progress=false",
                "run.save_final=false",
            ],
        )
        history = GRPO(cfg).run()[1:]

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
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
