"""`meshrl report RUN_DIR` (or `python -m meshrl.observe.report RUN_DIR`): a finished or
running run at a glance, from its `metrics.jsonl`.

Prints a table of the key figures (first and last steps, min, max) and writes
PNG plots into the run directory: `report_reward.png`, `report_kl.png`,
`report_entropy.png`, `report_length.png`, `report_eval.png` (the held-out
sets' reward and pass@k, with `eval:`), `report_throughput.png` (completion
tokens per second of step time) and `report_time.png` (each phase's seconds per
step). The table also gives each role's endpoint times
(`time/<role>/<endpoint>_s`, the slowest proc's, recorded by the actors), and
the summaries of the run's profiles (`run.profile_steps`, `meshrl profile`).
"""

from __future__ import annotations

import glob
import json
import os
import sys

ROWS = [
    "reward/mean",
    "eval/accuracy",
    "policy/kl_ref",
    "policy/approx_kl",
    "policy/entropy",
    "sampling/logprob_abs_diff",
    "completion/mean_length",
    "train/grad_norm",
    "value/explained_variance",
    "samples/dropped_total",
    "faults/recoveries",
    "time/step_s",
    "throughput/tokens_per_s",
]
PHASES = ["generate", "score", "reference", "train", "weight_sync"]
PLOTS = {
    "report_reward.png": ["reward/mean", "eval/accuracy"],
    "report_kl.png": ["policy/kl_ref", "policy/approx_kl", "sampling/kl"],
    "report_entropy.png": ["policy/entropy"],
    "report_length.png": ["completion/mean_length"],
    "report_throughput.png": ["throughput/tokens_per_s"],
}


def read_metrics(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl (is it a meshrl run directory?)")
    with open(path) as f:
        return [with_throughput(json.loads(line)) for line in f if line.strip()]


def with_throughput(record: dict) -> dict:
    """`throughput/tokens_per_s`: the step's completion tokens over its wall time."""
    tokens, seconds = record.get("tokens/generated"), record.get("time/step_s")
    if isinstance(tokens, int | float) and isinstance(seconds, int | float) and seconds > 0:
        record["throughput/tokens_per_s"] = tokens / seconds
    return record


def _numbers(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pairs = [
        (r.get("step", i), float(r[key]))
        for i, r in enumerate(records)
        if isinstance(r.get(key), (int, float))
    ]
    return [s for s, _ in pairs], [v for _, v in pairs]


def held_out(records: list[dict]) -> list[str]:
    """The held-out evaluation's keys (`eval/<set>/reward`, `pass@1`, `pass@<k>`)."""
    return sorted({k for r in records for k in r if k.startswith("eval/") and k.count("/") == 2})


def table(records: list[dict]) -> str:
    """The key figures: mean of the first and the last (up to) 10 steps, min, max."""
    lines = [f"{'metric':<34}{'first':>10}{'last':>10}{'min':>10}{'max':>10}"]
    roles = sorted({k for r in records for k in r if k.count("/") == 2 and k.startswith("time/")})
    for key in ROWS + held_out(records) + [f"time/{p}_s" for p in PHASES] + roles:
        _, values = _numbers(records, key)
        if not values:
            continue
        k = min(10, max(1, len(values) // 2))
        first, last = sum(values[:k]) / k, sum(values[-k:]) / k
        lines.append(
            f"{key:<34}{first:>10.4g}{last:>10.4g}{min(values):>10.4g}{max(values):>10.4g}"
        )
    return "\n".join(lines)


def plots(records: list[dict], run_dir: str) -> list[str]:
    """Write the PNG plots that the run has metrics for; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    evaluated = {"report_eval.png": held_out(records)}
    for filename, keys in {**PLOTS, **evaluated}.items():
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


def show(run_dir: str, records: list[dict]) -> None:
    print(f"{run_dir}: {len(records)} steps")
    print(table(records))
    for path in plots(records, run_dir):
        print(f"wrote {path}")
    from meshrl.observe.profile import table as profile_table

    for path in sorted(glob.glob(os.path.join(run_dir, "profile", "steps_*", "summary.json"))):
        with open(path) as f:
            print(f"\n{os.path.dirname(path)} (seconds):\n{profile_table(json.load(f))}")


def main(argv: list[str] | None = None) -> int:
    from meshrl.observe.run_dir import run_dir_command

    return run_dir_command("report", argv, read_metrics, show)


if __name__ == "__main__":
    sys.exit(main())
