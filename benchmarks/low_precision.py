"""Low precision end to end: the default task (grpo_default.yaml, its warm start
included) trained in four cells in one run of this script, each from the same
seed:

- `fp32`:  float32 trainer, float32 replicas (the baseline);
- `bf16`:  float32 trainer, bfloat16 replicas (`policy.precision=bf16`);
- `fp8`:   float32 trainer, FP8 replicas (`policy.precision=fp8`: decoder
           weights float8_e4m3fn with 128 x 128 block scales, dequantized to
           bfloat16 per layer on a CPU);
- `mixed`: bf16-mixed trainer (`trainer.precision=bf16-mixed`), bfloat16 replicas.

Every cell but fp32 recomputes the old log-probs on the trainer and corrects
the mismatch (`trainer.correction`, `--correction`, TIS by default).

    python benchmarks/low_precision.py                 # 60 steps a cell
    python benchmarks/low_precision.py --steps 400     # the issue's length
    python benchmarks/low_precision.py --conversion 4096

Prints one JSON line: per cell `reward` (mean reward of the last 10 steps) and
`reward_delta` (against fp32's, same run), the mismatch figures averaged over
the steps (`k3_kl`, `abs_dlogp`, `ratio_off_band`; `max_abs_dlogp` their max),
`bytes_per_sync` (the bytes of one version a replica takes, in its precision)
and `bytes_ratio` against fp32's, `sync_s` (the step's weight sync, publish and
pull, mean) and `step_s` (mean step time); `goals` says which of the issue's
goals held (reward within 0.05 of fp32's for bf16 and mixed, 0.08 for fp8;
bytes <= 0.51x for bf16, <= 0.27x for fp8). Everything not measured is pinned
(`benchmarks.pins`).

`--conversion N` instead times, on one thread, what the trainer's side of a
publish costs per precision for one N x N float32 matrix (4096: an 8B Llama's
attention projection): a plain copy (what an fp32 publish's copy does), the
cast to bfloat16, and the FP8 quantization (block maxima, then one division a
weight), each the median of 9; one JSON line with each against the copy.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.common import arguments  # noqa: E402
from benchmarks.pins import run_grpo  # noqa: E402

CELLS = {
    "fp32": ("trainer.precision=fp32", "policy.precision=fp32"),
    "bf16": ("trainer.precision=fp32", "policy.precision=bf16"),
    "fp8": ("trainer.precision=fp32", "policy.precision=fp8"),
    "mixed": ("trainer.precision=bf16-mixed", "policy.precision=bf16"),
}
REWARD_GOAL = {"bf16": 0.05, "fp8": 0.08, "mixed": 0.05}
BYTES_GOAL = {"bf16": 0.51, "fp8": 0.27, "mixed": 0.51}
MISMATCH = {
    "k3_kl": "sampling/k3_kl",
    "abs_dlogp": "sampling/sampler_logprob_abs_diff",
    "ratio_off_band": "sampling/ratio_off_band",
}


def mean(values: list[float]) -> float:
    return sum(values) / max(len(values), 1)


def cell(history: list[dict]) -> dict:
    """One cell's figures from its step history."""
    figures = {"reward": round(mean([r["reward/mean"] for r in history[-10:]]), 4)}
    for name, key in MISMATCH.items():
        figures[name] = round(mean([r.get(key, 0.0) for r in history]), 6)
    figures["max_abs_dlogp"] = round(
        max([r.get("sampling/sampler_logprob_max_abs_diff", 0.0) for r in history] or [0.0]), 5
    )
    figures["bytes_per_sync"] = round(mean([r.get("weights/replica_bytes", 0) for r in history]))
    figures["sync_s"] = round(mean([r.get("time/weight_sync_s", 0.0) for r in history[1:]]), 5)
    figures["step_s"] = round(mean([r["time/step_s"] for r in history[1:]]), 4)
    return figures


def conversion(size: int) -> int:
    """The `--conversion` line: each precision's conversion against a copy."""
    import statistics
    import time

    import torch

    from meshrl.weights.precision import quantize_blocks

    torch.set_num_threads(1)
    weight = torch.randn(size, size, generator=torch.Generator().manual_seed(0))
    out = {"fp32": torch.empty_like(weight), "bf16": torch.empty_like(weight, dtype=torch.bfloat16)}
    ways = {
        "copy_fp32": lambda: out["fp32"].copy_(weight),
        "cast_bf16": lambda: out["bf16"].copy_(weight),
        "quantize_fp8": lambda: quantize_blocks(weight),
    }
    seconds = {}
    for name, way in ways.items():
        way()
        times = []
        for _ in range(9):
            started = time.perf_counter()
            way()
            times.append(time.perf_counter() - started)
        seconds[name] = statistics.median(times)
    base = seconds["copy_fp32"]
    figures = {
        "size": size,
        "seconds": {name: round(s, 5) for name, s in seconds.items()},
        "against_copy": {name: round(s / base, 2) for name, s in seconds.items()},
    }
    print(json.dumps(figures))
    return 0


def main() -> int:
    parser = arguments(__doc__, steps=60, correction="tis", conversion=0)
    parser.add_argument("--only", nargs="*", default=list(CELLS), choices=list(CELLS))
    args = parser.parse_args()
    if args.conversion:
        return conversion(args.conversion)
    run_dir = tempfile.mkdtemp(prefix="meshrl-low-precision-")
    cells = {}
    for name in args.only:
        correction = "none" if name == "fp32" else args.correction
        history = run_grpo(
            run_dir,
            name,
            f"steps={args.steps}",
            f"trainer.correction={correction}",
            *CELLS[name],
        )
        cells[name] = cell(history)
        print(f"{name}: {cells[name]}", file=sys.stderr, flush=True)
    base = cells.get("fp32")
    goals = {}
    if base is not None:
        for name, figures in cells.items():
            if name == "fp32":
                continue
            figures["reward_delta"] = round(figures["reward"] - base["reward"], 4)
            figures["bytes_ratio"] = round(figures["bytes_per_sync"] / base["bytes_per_sync"], 4)
            goals[name] = {
                "reward": abs(figures["reward_delta"]) <= REWARD_GOAL[name],
                "bytes": figures["bytes_ratio"] <= BYTES_GOAL[name],
            }
    print(
        json.dumps(
            {
                "cells": cells,
                "goals": goals,
                "steps": args.steps,
                "correction": args.correction,
                "config": "grpo_default.yaml",
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
