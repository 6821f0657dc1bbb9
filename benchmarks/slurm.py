"""SLURM against `local`, on a private SLURM cluster started here (tests/support/slurm_cluster.py):

- seconds from the command to the first step, GRPO on SLURM (trainer, 2 policy nodes,
  environment: 4 allocations) beside the same config on `local`, as a ratio;
- a policy node lost, to the run's next step, seen by Monarch's supervision alone
  (`faults.detect_s=0`) and by meshrl's dial of the workers (the default), as a
  ratio; and `faults/time_to_serve_s` (from the moment the controller saw the loss);
- time from `scontrol requeue` of the trainer's job to the run's next step.

    python benchmarks/slurm.py [--losses 3]

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

from benchmarks.pins import UNMEASURED  # noqa: E402
from tests.support.slurm_cluster import Cluster  # noqa: E402

CONFIG = os.path.join(REPO, "algorithms", "configs", "grpo_default.yaml")
PINNED = [
    *UNMEASURED,
    "placement.threads_per_proc=1",
    "run.seed=0",
    "warm_start.steps=20",
    "prompts_per_step=16",
    "group_size=8",
    "placement.policy=1",
]


def lines(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def launch(env, root, name, *overrides):
    command = [
        sys.executable,
        "-m",
        "algorithms.grpo",
        "--config",
        CONFIG,
        *PINNED,
        f"run.dir={root}",
        f"run.name={name}",
        *overrides,
    ]
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


running: dict[str, subprocess.Popen] = {}


def recoveries(run_dir: str) -> int:
    """`faults/recoveries` of the run's newest step (0 before its first)."""
    records = lines(run_dir)
    return records[-1].get("faults/recoveries", 0) if records else 0


def lose_policy_nodes(cluster, root, name, losses, overrides):
    """Start a run, lose a policy node every few steps, `losses` times; per loss the
    seconds from the kill to the first step logged after its recovery, and
    `faults/time_to_serve_s` (from when the controller saw it); the nodes lost."""
    proc = running[name] = launch(cluster.env, root, name, *overrides)
    to_step, lost, seen = [], [], 0
    while len(lost) < losses:
        records = lines(os.path.join(root, name))
        if records and len(records) > seen + 3:
            with open(os.path.join(root, name, "status.json")) as f:
                nodes = json.load(f)["slurm"]["policy"]["nodes"]
            if nodes:
                killed = time.monotonic()
                cluster.lose_node(nodes[-1])
                lost.append(nodes[-1])
                while recoveries(os.path.join(root, name)) < len(lost):
                    if proc.poll() is not None:
                        raise SystemExit(f"the {name} run ended (exit {proc.returncode})")
                    time.sleep(0.1)
                count = len(lines(os.path.join(root, name)))
                while len(lines(os.path.join(root, name))) == count:  # its next step
                    time.sleep(0.05)
                to_step.append(time.monotonic() - killed)
                seen = len(lines(os.path.join(root, name)))
        if proc.poll() is not None:
            raise SystemExit(f"the {name} run ended (exit {proc.returncode})")
        time.sleep(0.2)
    serve = sorted(
        {
            (r["faults/recoveries"], r["faults/time_to_serve_s"])
            for r in lines(os.path.join(root, name))
            if "faults/time_to_serve_s" in r
        }
    )
    return to_step, [t for _, t in serve], lost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--losses", type=int, default=3, help="per detection, each way")
    args = parser.parse_args()
    slurm = ["job.kind=slurm", f"job.python_exe={sys.executable}", "job.hosts.policy=2"]
    with tempfile.TemporaryDirectory(prefix="meshrl-slurm-bench-") as root:
        cluster = Cluster(os.path.join(root, "cluster"), nodes=4 + 2 * args.losses + 2).start()
        env = cluster.env
        try:
            local = to_first_step(env, root, "local_first")
            on_slurm = to_first_step(env, root, "slurm_first", *slurm)
            print(
                f"command -> first step: slurm {on_slurm:.1f}s, local {local:.1f}s "
                f"(slurm/local {on_slurm / local:.2f}x)"
            )

            # Node losses: a policy node each few steps; quarantine at once. Once as
            # Monarch alone sees them (faults.detect_s=0), once with meshrl's dial of
            # the workers (the default), the same losses in each.
            figures = {}
            for label, detect in (("monarch", "0"), ("meshrl", "0.5")):
                name = f"losses_{label}"
                figures[label] = lose_policy_nodes(
                    cluster,
                    root,
                    name,
                    args.losses,
                    [
                        "steps=100000",
                        "faults.quarantine_after=1",
                        "faults.max_recoveries=100",
                        f"faults.detect_s={detect}",
                        *slurm,
                    ],
                )
                if label == "monarch":
                    running[name].terminate()
                    running[name].wait(timeout=120)
            for label, (to_step, serve, lost) in figures.items():
                print(
                    f"policy node lost, seen by {label}: to the next step p50 "
                    f"{statistics.median(to_step):.1f}s (max {max(to_step):.1f}s); serving "
                    f"again after the loss was seen p50 {statistics.median(serve):.1f}s, "
                    f"over {len(to_step)} losses ({', '.join(lost)})"
                )
            ratio = statistics.median(figures["monarch"][0]) / statistics.median(
                figures["meshrl"][0]
            )
            print(f"node loss to the next step: monarch/meshrl {ratio:.1f}x")
            name, proc = "losses_meshrl", running["losses_meshrl"]

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
            for left in running.values():
                if left.poll() is None:
                    left.kill()
                    left.wait()
            cluster.stop()


if __name__ == "__main__":
    main()
