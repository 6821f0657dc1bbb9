"""Starting runs and reading what they log: the helpers that test files of more than one
tier share (the quiet overrides, the shipped configs, the documented metrics, GRPO from
the command line and from Python)."""

import json
import os
import re
import subprocess
import sys

from algorithms.grpo import GRPO, GRPOConfig
from meshrl.config import load_config
from meshrl.procs import zygote
from tests.conftest import DEFAULT_CONFIG, REPO

CONFIGS = os.path.join(REPO, "algorithms", "configs")
QUIET = ["run.progress=false", "run.save_final=false"]


SHARED_PAGES = ("observability.md", "reliability.md", "environments.md")
LOOK_BACK = ("health/entropy_ratio", "health/reward_flat_steps")
"""Health figures that look back over the run's records (the first step's entropy,
the steps of flat reward): a run resumed into a new directory has none of those
records, so they start afresh there (docs/observability.md)."""


def undocumented_metrics(records: list[dict], page: str) -> list[str]:
    """Keys logged in `records` that no metrics table names: the algorithm's page,
    grpo.md (the on-policy loop's shared table), or the shared pages. A table's
    `<name>` matches one path segment (`time/<role>/<endpoint>_s`)."""
    pages = {page, "algorithms/grpo.md"}
    patterns = []
    for name in sorted(pages) + list(SHARED_PAGES):
        with open(os.path.join(REPO, "docs", name)) as f:
            for line in f:
                if line.startswith("| `"):
                    for key in re.findall(r"`([^`]+)`", line.split("|")[1]):
                        parts = re.split(r"(<[^>]+>)", key)
                        regex = "".join(
                            "[^/]+" if p.startswith("<") else re.escape(p) for p in parts
                        )
                        patterns.append(re.compile(f"^{regex}$"))
    logged = {key for record in records for key in record}
    return sorted(k for k in logged if not any(p.match(k) for p in patterns))


def grpo_command(run_dir, name, *overrides, fresh=False):
    """The CLI a user types, writing to `run_dir/name`: a fresh Python with
    `fresh`, else a fork of the suite's server (`zygote.python_m`)."""
    python_m = (lambda *args: [sys.executable, "-m", *args]) if fresh else zygote.python_m
    return python_m(
        "algorithms.grpo",
        "--config",
        DEFAULT_CONFIG,
        *overrides,
        f"run.dir={run_dir}",
        f"run.name={name}",
        "run.progress=false",
    )


def run_grpo(run_dir, name, *overrides, timeout=300, fresh=False):
    return subprocess.run(
        grpo_command(run_dir, name, *overrides, fresh=fresh),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def grpo(tmp_path, config, *overrides):
    """GRPO from Python on the shipped `config` (a file name in algorithms/configs), 2
    small steps unless `overrides` say otherwise: the algorithm and its records."""
    cfg = load_config(
        GRPOConfig,
        f"{REPO}/algorithms/configs/{config}",
        [
            "steps=2",
            "prompts_per_step=4",
            "group_size=2",
            *overrides,
            f"run.dir={tmp_path}",
            "run.name=run",
            "run.progress=false",
            "run.save_final=false",
            "run.samples_every=1",
        ],
    )
    algo = GRPO(cfg)
    return algo, algo.run()


def configure(tmp_path, name, *overrides, schema=GRPOConfig, path=DEFAULT_CONFIG):
    """A quiet run named `name` under `tmp_path` with `overrides`."""
    return load_config(
        schema,
        path,
        [*overrides, f"run.dir={tmp_path}", f"run.name={name}", "run.progress=false"],
    )


class StopAt:
    """Mixed in before an algorithm: a run killed as step `stop_at` ends (the
    checkpoints written before it kept), as by Ctrl-C."""

    stop_at: int

    def after_step(self, step, metrics):
        if step == self.stop_at:
            raise KeyboardInterrupt
        super().after_step(step, metrics)
