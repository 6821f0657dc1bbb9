"""Runs every shipped config as it is and writes the results table into README.md
and docs/algorithms/README.md, between the `results:start` / `results:end`
markers, with the commit, the date and the machine. Figures in the docs come
from here, never typed by hand.

    make results                      # every config (about 10 minutes on 2 cores)
    python benchmarks/results.py --only grpo_default.yaml dpo.yaml   # some rows

A row: the algorithm and config, the steps, the headline metric's mean over the
first and the last 10 steps (DPO: held-out preference accuracy before training
and at the end), the mean step time and the wall time of the whole command
(spawn and warm-start included). `--only` re-runs some rows and keeps the others.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = [  # (algorithm, module, config)
    ("GRPO", "grpo", "grpo_default.yaml"),
    ("Dr. GRPO", "grpo", "dr_grpo.yaml"),
    ("GSPO", "grpo", "gspo.yaml"),
    ("DAPO", "dapo", "dapo.yaml"),
    ("RLOO", "rloo", "rloo.yaml"),
    ("REINFORCE++", "reinforce_pp", "reinforce_pp.yaml"),
    ("PPO", "ppo", "ppo.yaml"),
    ("GRPO, calculator tool", "grpo", "grpo_calculator.yaml"),
    ("GRPO, calculator disabled (ablation)", "grpo", "grpo_calculator_notool.yaml"),
    ("GRPO, code", "grpo", "grpo_code.yaml"),
    ("GRPO, vision (tiny LLaVA)", "grpo", "grpo_vision.yaml"),
    ("DPO", "dpo", "dpo.yaml"),
    ("On-policy distillation", "distill", "distill.yaml"),
    ("SFT", "sft", "sft.yaml"),
    ("Co-evolution (player A)", "coevolve", "coevolve.yaml"),
]
HELD_OUT = {  # module: (key, headline) of an evaluation before the first step and after
    "dpo": ("eval/accuracy", "held-out accuracy"),
    "distill": ("eval/heldout/reverse_kl", "held-out reverse KL"),
    "sft": ("eval/nll", "held-out NLL"),
    "coevolve": ("eval/a/win_rate_vs_random", "win rate vs random"),
}
TEACHER = "grpo_default.yaml"  # its final model is distill.yaml's teacher
PAGES = ("README.md", os.path.join("docs", "algorithms", "README.md"))
START, END = "<!-- results:start -->", "<!-- results:end -->"
HEADER = (
    "| algorithm | config | steps | headline | first 10 steps | last 10 steps | mean step | wall |"
)


def run_row(module: str, config: str, run_dir: str) -> dict:
    name = config.removesuffix(".yaml")
    command = [
        sys.executable,
        "-m",
        f"algorithms.{module}",
        "--config",
        os.path.join("algorithms", "configs", config),
        f"run.dir={run_dir}",
        f"run.name={name}",
        "run.progress=false",
        "run.samples_every=0",
        f"run.save_final={str(config == TEACHER).lower()}",
    ]
    if module == "distill":
        teacher = os.path.join(run_dir, TEACHER.removesuffix(".yaml"), "final")
        if not os.path.isdir(teacher):  # `--only distill.yaml`: train its teacher first
            run_row("grpo", TEACHER, run_dir)
        command.append(f"teacher.path={teacher}")
    started = time.monotonic()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    wall = time.monotonic() - started
    if done.returncode:
        raise SystemExit(f"{config} failed:\n{done.stderr[-2000:]}")
    with open(os.path.join(run_dir, name, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip() not in ("", "{}")]
    steps = [r for r in records if "step" in r]
    step_s = [r["time/step_s"] for r in steps if "time/step_s" in r]
    if module in HELD_OUT:
        key, headline = HELD_OUT[module]
        evals = [r[key] for r in steps if key in r]
        first, last = steps[0][f"{key}_before"], evals[-1]
    else:
        rewards = [r["reward/mean"] for r in steps]
        first, last, headline = mean(rewards[:10]), mean(rewards[-10:]), "reward/mean"
    return {
        "steps": len(steps),
        "headline": headline,
        "first": first,
        "last": last,
        "step_s": mean(step_s) if step_s else float("nan"),
        "wall_s": wall,
    }


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def row_line(algorithm: str, config: str, r: dict) -> str:
    return (
        f"| {algorithm} | `{config}` | {r['steps']} | {r['headline']} | {r['first']:.3f} "
        f"| {r['last']:.3f} | {r['step_s']:.3f} s | {r['wall_s']:.0f} s |"
    )


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    import torch

    return f"{platform.system()}, {os.cpu_count()} cores ({cpu}), torch {torch.__version__}"


def commit(changed: str = " with local changes") -> str:
    """The short commit, and `changed` after it when tracked files differ from it."""
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    )
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=REPO,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return (out.stdout.strip() or "unknown") + (changed if dirty else "")


def block(lines: list[str], total_s: float, only: list[str] | None = None) -> str:
    stamp = (
        f"Generated by `make results` ({total_s / 60:.1f} min) at commit {commit()} on "
        f"{time.strftime('%Y-%m-%d')}: {machine()}; seed 0, each shipped config as it is."
    )
    if only:  # say which rows this run made: the others come from earlier runs
        stamp += f" This run re-ran {', '.join(only)} (`--only`); the other rows are kept."
    return "\n".join([START, stamp, "", HEADER, "|---|---|---|---|---|---|---|---|", *lines, END])


def current_rows(text: str) -> dict[str, str]:
    """config -> its row line in a page's table (for `--only`)."""
    rows = {}
    for line in text.splitlines():
        match = re.match(r"\| [^|]+ \| `([^`]+)` \|", line)
        if match:
            rows[match.group(1)] = line
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="configs to re-run; the other rows are kept")
    args = parser.parse_args()
    with open(os.path.join(REPO, PAGES[0])) as f:
        kept = current_rows(f.read())
    started = time.monotonic()
    lines = []
    with tempfile.TemporaryDirectory() as run_dir:
        for algorithm, module, config in ROWS:
            if args.only and config not in args.only and config in kept:
                lines.append(kept[config])
                continue
            result = run_row(module, config, run_dir)
            lines.append(row_line(algorithm, config, result))
            print(lines[-1], flush=True)
    table = block(lines, time.monotonic() - started, args.only)
    for page in PAGES:
        path = os.path.join(REPO, page)
        with open(path) as f:
            text = f.read()
        if text.count(START) != 1 or text.count(END) != 1:
            raise SystemExit(f"{page}: needs one {START} ... {END} block")
        before, rest = text.split(START)
        with open(path, "w") as f:
            f.write(before + table + rest.split(END, 1)[1])
        print(f"wrote the table into {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
