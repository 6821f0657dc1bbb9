"""The sandbox's cost: start latency and runs per second of a trivial program,
beside a bare interpreter start, in one run.

    python benchmarks/sandbox.py            # 200 runs each
    python benchmarks/sandbox.py --runs 50

Measured, interleaved run by run so that both sides see the same machine:
- bare:     `python -I -c pass` with the interpreter the sandbox uses;
- sandbox:  `run_python("pass")` with everything this machine allows
            (Landlock, seccomp, namespaces, a uid of its own, limits, the hook);
- sandbox_no_namespaces: the same without `unshare` (the path of an
            unprivileged user where user namespaces are off).
Then runs per second with 2 threads starting programs at once (the code task
runs its programs side by side). Prints a table, then one JSON line whose
`overhead_p50` is sandbox p50 / bare p50 (goal: <= 2).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from meshrl.envs.sandbox import probe, run_python  # noqa: E402


def _quantiles(times: list[float]) -> dict:
    ordered = sorted(times)
    return {
        "p50_s": round(statistics.median(ordered), 5),
        "p95_s": round(ordered[int(0.95 * (len(ordered) - 1))], 5),
        "runs_per_s": round(len(ordered) / sum(ordered), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    full, no_ns = probe(), probe(frozenset({"namespaces"}))
    bare_cmd = [full.python, "-I", "-c", "pass"]
    cases = {
        "bare": lambda: subprocess.run(bare_cmd, check=True),
        "sandbox": lambda: run_python("pass", isolation=full),
        "sandbox_no_namespaces": lambda: run_python("pass", isolation=no_ns),
    }
    for case in cases.values():  # warm the page cache and the probes
        case()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.runs):
        for name, case in cases.items():
            started = time.perf_counter()
            result = case()
            times[name].append(time.perf_counter() - started)
            assert name == "bare" or result.ok, result
    report = {name: _quantiles(values) for name, values in times.items()}
    for name in ("bare", "sandbox"):
        with ThreadPoolExecutor(2) as pool:
            started = time.perf_counter()
            case = cases[name]
            list(pool.map(lambda _, case=case: case(), range(args.runs)))
            report[name]["runs_per_s_2_threads"] = round(
                args.runs / (time.perf_counter() - started), 1
            )
    print(f"{'':24s} {'p50 ms':>8s} {'p95 ms':>8s} {'runs/s':>8s} {'runs/s, 2 threads':>18s}")
    for name, row in report.items():
        print(
            f"{name:24s} {row['p50_s'] * 1e3:8.1f} {row['p95_s'] * 1e3:8.1f} "
            f"{row['runs_per_s']:8.1f} {row.get('runs_per_s_2_threads', float('nan')):18.1f}"
        )
    report["overhead_p50"] = round(report["sandbox"]["p50_s"] / report["bare"]["p50_s"], 2)
    report["overhead_p95"] = round(report["sandbox"]["p95_s"] / report["bare"]["p95_s"], 2)
    report["isolation"] = list(full.in_force)
    report["python"] = full.python
    report["runs"] = args.runs
    print(json.dumps(report))


if __name__ == "__main__":
    main()
