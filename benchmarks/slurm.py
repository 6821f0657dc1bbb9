"""SLURM against `local`, on a private SLURM cluster started here (tests/slurm_cluster.py):

- seconds from the command to the first step, GRPO on SLURM (trainer, 2 policy nodes,
  environment: 4 allocations) beside the same config on `local`, as a ratio;
- time to serve again after a policy node is lost (p50/p95 over --losses losses:
  `faults/time_to_serve_s`, from the moment the controller saw the loss);
- time from `scontrol requeue` of the trainer's job to the run's next step.

    python benchmarks/slurm.py [--losses 5]

Every setting it does not measure is pinned here (the shipped config's steps, eval,
threads and seeds are overridden), so a change to a shipped config does not move it.
Needs root (the cluster's daemons); prints what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.slurm_cluster import Cluster  # noqa: E402

CONFIG = os.path.join(REPO, "algorithms", "configs", "grpo_default.yaml")
PINNED = [
    "eval.every=0", "run.progress=false", "placement.threads_per_proc=1", "run.seed=0",
    "warm_start.steps=20", "prompts_per_step=16", "group_size=8", "placement.policy=1",
]  # fmt: skip


def lines(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def launch(env, root, name, *overrides):
    command = [sys.executable, "-m", "algorithms.grpo", "--config", CONFIG, *PINNED,
               f"run.dir={root}", f"run.name={name}", *overrides]  # fmt: skip
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )


def to_first_step(env, root, name, *overrides) -> float:
    began = time.monotonic()
    proc = launch(env, root, name, "steps=3", *overrides)
    while not lines(os.path.join(root, name)):
        if proc.poll() is not None:
            raise SystemExit(f"{name}: the run ended (exit {proc.returncode}) before a step")
        time.sleep(0.05)
    took = time.monotonic() - began
    proc.wait(timeout=300)
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--losses", type=int, default=5)
    args = parser.parse_args()
    slurm = ["job.kind=slurm", f"job.python_exe={sys.executable}", "job.hosts.policy=2"]
    with tempfile.TemporaryDirectory(prefix="meshrl-slurm-bench-") as root:
        cluster = Cluster(os.path.join(root, "cluster"), nodes=4 + args.losses + 2).start()
        env = cluster.env
        try:
            local = to_first_step(env, root, "local_first")
            on_slurm = to_first_step(env, root, "slurm_first", *slurm)
            print(
                f"command -> first step: slurm {on_slurm:.1f}s, local {local:.1f}s "
                f"(slurm/local {on_slurm / local:.2f}x)"
            )

            # Node losses: a policy node each few steps; quarantine at once.
            name = "losses"
            proc = launch(env, root, name, "steps=100000", "faults.quarantine_after=1",
                          "faults.max_recoveries=100", *slurm)  # fmt: skip
            seen = 0
            lost = []
            while len(lost) < args.losses:
                records = lines(os.path.join(root, name))
                recovered = max([r.get("faults/recoveries", 0) for r in records] or [0])
                if records and recovered == len(lost) and len(records) > seen + 3:
                    with open(os.path.join(root, name, "status.json")) as f:
                        nodes = json.load(f)["slurm"]["policy"]["nodes"]
                    if nodes:
                        cluster.lose_node(nodes[-1])
                        lost.append(nodes[-1])
                        seen = len(records)
                if proc.poll() is not None:
                    raise SystemExit(f"the loss run ended (exit {proc.returncode})")
                time.sleep(0.2)
            while max([r.get("faults/recoveries", 0) for r in lines(os.path.join(root, name))]
                      or [0]) < args.losses:  # fmt: skip
                time.sleep(0.2)
            serve = sorted({
                (r["faults/recoveries"], r["faults/time_to_serve_s"])
                for r in lines(os.path.join(root, name)) if "faults/time_to_serve_s" in r
            })  # fmt: skip
            times = [t for _, t in serve]
            p95 = sorted(times)[max(0, round(0.95 * len(times)) - 1)]
            print(
                f"policy node lost -> serving again: p50 {statistics.median(times):.1f}s, "
                f"p95 {p95:.1f}s over {len(times)} losses ({', '.join(lost)})"
            )

            # Requeue of the trainer's job -> the next step.
            with open(os.path.join(root, name, "status.json")) as f:
                job_id = json.load(f)["slurm"]["trainer"]["job_id"]
            recoveries = lines(os.path.join(root, name))[-1]["faults/recoveries"]
            requeued = time.monotonic()
            cluster.run("scontrol", "requeue", job_id)
            # The next step logged after the rewind carries one more recovery.
            while lines(os.path.join(root, name))[-1]["faults/recoveries"] == recoveries:
                if proc.poll() is not None:
                    raise SystemExit(f"the loss run ended (exit {proc.returncode})")
                time.sleep(0.1)
            took = time.monotonic() - requeued
            print(
                f"trainer job requeued -> the next step: {took:.1f}s (SLURM starts a "
                "requeued job after cred_expire, 5 s on this cluster, 120 s by default)"
            )
            proc.terminate()
            proc.wait(timeout=120)
        finally:
            cluster.stop()


if __name__ == "__main__":
    main()
