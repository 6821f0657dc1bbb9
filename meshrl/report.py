"""`meshrl report RUN_DIR` (or `python -m meshrl.report RUN_DIR`): a finished or
running run at a glance, from its `metrics.jsonl`.

Prints a table of the key figures (first and last steps, min, max) and writes
PNG plots into the run directory: `report_reward.png`, `report_kl.png`,
`report_length.png` and `report_time.png` (each phase's seconds per step).
"""

from __future__ import annotations

import json
import os
import sys

ROWS = [
    "reward/mean",
    "eval/accuracy",
    "policy/kl_ref",
    "policy/approx_kl",
    "sampling/logprob_abs_diff",
    "completion/mean_length",
    "train/grad_norm",
    "value/explained_variance",
    "samples/dropped_total",
    "faults/recoveries",
    "time/step_s",
]
PHASES = ["generate", "score", "reference", "train", "weight_sync"]
PLOTS = {
    "report_reward.png": ["reward/mean", "eval/accuracy"],
    "report_kl.png": ["policy/kl_ref", "policy/approx_kl", "sampling/kl"],
    "report_length.png": ["completion/mean_length"],
}


def read_metrics(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl (is it a meshrl run directory?)")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _numbers(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pairs = [
        (r.get("step", i), float(r[key]))
        for i, r in enumerate(records)
        if isinstance(r.get(key), (int, float))
    ]
    return [s for s, _ in pairs], [v for _, v in pairs]


def table(records: list[dict]) -> str:
    """The key figures: mean of the first and the last (up to) 10 steps, min, max."""
    lines = [f"{'metric':<28}{'first':>10}{'last':>10}{'min':>10}{'max':>10}"]
    for key in ROWS + [f"time/{p}_s" for p in PHASES]:
        _, values = _numbers(records, key)
        if not values:
            continue
        k = min(10, max(1, len(values) // 2))
        first, last = sum(values[:k]) / k, sum(values[-k:]) / k
        lines.append(
            f"{key:<28}{first:>10.4g}{last:>10.4g}{min(values):>10.4g}{max(values):>10.4g}"
        )
    return "\n".join(lines)


def plots(records: list[dict], run_dir: str) -> list[str]:
    """Write the PNG plots that the run has metrics for; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for filename, keys in PLOTS.items():
        series = {k: _numbers(records, k) for k in keys}
        series = {k: v for k, v in series.items() if v[1]}
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key, (steps, values) in series.items():
            ax.plot(steps, values, lw=1, label=key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        written.append(os.path.join(run_dir, filename))
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)
    phases = {p: _numbers(records, f"time/{p}_s") for p in PHASES}
    phases = {p: v for p, v in phases.items() if v[1]}
    if phases:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        steps = next(iter(phases.values()))[0]
        ax.stackplot(steps, *[v for _, v in phases.values()], labels=list(phases))
        ax.set_xlabel("step")
        ax.set_ylabel("seconds")
        ax.legend(loc="upper right", fontsize=8)
        fig.tight_layout()
        written.append(os.path.join(run_dir, "report_time.png"))
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)
    return written


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: meshrl report RUN_DIR", file=sys.stderr)
        return 2
    try:
        records = read_metrics(args[0])
    except (OSError, json.JSONDecodeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"{args[0]}: {len(records)} steps")
    print(table(records))
    for path in plots(records, args[0]):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
