"""Hung procs and the preflight, measured: a GRPO run whose policy proc is stopped
with SIGSTOP `--hangs` times (each once the run has stepped again), timing each
hang to the run serving again (the console's `recovered policy` or `healed`
line), and the preflight's cost per host and per allocation from status.json.

    python benchmarks/hangs.py                       # local, 5 hangs, health.hang_s=3
    python benchmarks/hangs.py --hangs 5 --hang-s 10
    SLURM_CONF=... python benchmarks/hangs.py --kind slurm job.python_exe=$PWD/.venv/bin/python

Extra arguments are config overrides. Prints one JSON line: `hang_to_serving_s`
(each hang, p50, p95), `preflight_allocation_s` (each preflight's wall time:
every host of an allocation at once), `preflight_host_s` (each host's own
checks), the run's exit status and whether any sample was lost.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from meshrl.observe.status import alive_pid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hangs", type=int, default=5)
    parser.add_argument("--hang-s", type=float, default=3.0)
    parser.add_argument("--kind", default="local")
    parser.add_argument("--dir", default=None, help="run directory (default: a temporary one)")
    args, overrides = parser.parse_known_args()
    root = args.dir or tempfile.mkdtemp(prefix="meshrl-hangs-")
    run = os.path.join(root, "hangs")
    steps = 4 + 4 * args.hangs
    command = [
        sys.executable, "-m", "algorithms.grpo",
        "--config", os.path.join(REPO, "algorithms", "configs", "grpo_default.yaml"),
        f"steps={steps}", "eval.every=0", "warm_start.steps=2", "run.progress=false",
        f"run.dir={root}", "run.name=hangs", f"health.hang_s={args.hang_s}",
        f"job.kind={args.kind}", "faults.max_recoveries=100", *overrides,
    ]  # fmt: skip
    if args.kind == "slurm":
        command += ["job.partition=debug", "placement.threads_per_proc=1"]
    proc = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[tuple[float, str]] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append((time.monotonic(), line.rstrip()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def steps_done() -> int:
        with contextlib.suppress(OSError), open(os.path.join(run, "metrics.jsonl")) as f:
            return sum(1 for line in f if line.strip())
        return 0

    times: list[float] = []
    try:
        for i in range(args.hangs):
            while steps_done() < 2 + 4 * i and proc.poll() is None:
                time.sleep(0.1)
            pid = None
            while proc.poll() is None and pid is None:
                pid = alive_pid(run, "policy")
                try:  # (status.json may still name a proc replaced since)
                    seen, stopped = len(lines), time.monotonic()
                    os.kill(pid, signal.SIGSTOP) if pid else time.sleep(0.1)
                except ProcessLookupError:
                    pid = None
                    time.sleep(0.1)
            if pid is None:
                break
            while proc.poll() is None:
                served = [
                    t
                    for t, line in lines[seen:]
                    if line.startswith(("recovered policy", "healed policy"))
                ]
                if served:
                    times.append(served[0] - stopped)
                    break
                time.sleep(0.05)
        proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=60)
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=5)
    with open(os.path.join(run, "status.json")) as f:
        status = json.load(f)
    with open(os.path.join(run, "metrics.jsonl")) as f:
        last = [json.loads(line) for line in f if line.strip()][-1]
    preflight = status.get("preflight", {})
    print(
        json.dumps(
            {
                "kind": args.kind,
                "hang_s": args.hang_s,
                "hang_to_serving_s": [round(t, 2) for t in times],
                "p50": round(statistics.median(times), 2) if times else None,
                "p95": round(percentile(times, 0.95), 2) if times else None,
                "preflight_allocation_s": [r["s"] for r in preflight.get("runs", [])],
                "preflight_hosts": [r["hosts"] for r in preflight.get("runs", [])],
                "preflight_host_s": {
                    h: f.get("check_s") for h, f in preflight.get("hosts", {}).items()
                },
                "recoveries": last.get("faults/recoveries"),
                "samples_lost": last["samples/generated_total"]
                - last["samples/trained_total"]
                - last["samples/dropped_total"],
                "exit": proc.returncode,
            }
        )
    )


if __name__ == "__main__":
    main()
