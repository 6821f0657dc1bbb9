"""One slow policy replica, for real: GRPO with 2 policy replicas, one of them
held to a tenth of a core from step `--at` on (the cgroup v1 CPU controller at
/sys/fs/cgroup/cpu, as a throttled host would be), with and without
`health.evict_slow`, against the same run with no throttle, in one run of this
script (root, on a host with that controller).

    python benchmarks/slow_proc.py                  # 30 steps, throttled from step 5
    python benchmarks/slow_proc.py --steps 20 --at 4 --quota 0.1

Prints one JSON line: for each run the mean step time before the throttle and
from it to the end (`step_s_before`, `step_s_after`), the step the slow replica
was evicted at (`evicted_at`, null when it was not), and whether its final
weights equal the unthrottled run's, bit for bit.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import statistics
import sys
import tempfile
from contextlib import redirect_stdout
from io import StringIO

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from algorithms.grpo import GRPO  # noqa: E402
from benchmarks.common import arguments  # noqa: E402
from benchmarks.pins import grpo_config  # noqa: E402

CGROUP = "/sys/fs/cgroup/cpu"


class Throttled(GRPO):
    """GRPO whose policy replica 1 is held to `quota` cores from step `at` on."""

    at, quota, group = 0, 0.1, None

    def after_step(self, step: int, metrics: dict) -> None:
        super().after_step(step, metrics)
        if step + 1 == self.at:  # from the next step on
            (pid,) = [
                p["pid"]
                for p in self.runtime.proc_status()
                if p.get("role") == "policy" and p.get("rank") == 1
            ]
            self.group = f"{CGROUP}/meshrl-slow-{pid}"
            os.makedirs(self.group, exist_ok=True)
            with open(f"{self.group}/cpu.cfs_quota_us", "w") as f:
                f.write(str(int(self.quota * 100_000)))  # of cpu.cfs_period_us = 100000
            with open(f"{self.group}/cgroup.procs", "w") as f:
                f.write(str(pid))

    def release(self) -> None:
        """Out of the cgroup (a proc still in it goes back to the root) and gone."""
        if self.group is None:
            return
        with contextlib.suppress(OSError), open(f"{self.group}/cgroup.procs") as f:
            left = f.read().split()
        for pid in left:
            with contextlib.suppress(OSError), open(f"{CGROUP}/cgroup.procs", "w") as f:
                f.write(pid)
        with contextlib.suppress(OSError):
            os.rmdir(self.group)


def run(run_dir: str, name: str, steps: int, at: int | None, quota: float, *extra: str):
    cfg = grpo_config(
        f"steps={steps}",
        "placement.policy=2",
        "health.slow_steps=3",
        f"run.dir={run_dir}",
        f"run.name={name}",
        *extra,
    )
    algo = Throttled(cfg) if at is not None else GRPO(cfg)
    algo.at, algo.quota = at or 0, quota
    out = StringIO()
    try:
        with redirect_stdout(out):
            history = algo.run()
    finally:
        if at is not None:
            algo.release()
    evicted = re.search(r"health: step (\d+): policy\[1\] slow: .*evicted", out.getvalue())
    return history, algo.run_dir, int(evicted[1]) if evicted else None


def final_weights(run_dir: str) -> dict:
    from safetensors.torch import load_file

    (path,) = glob.glob(f"{run_dir}/final/*.safetensors")
    return load_file(path)


def main() -> int:
    parser = arguments(__doc__, steps=30)
    parser.add_argument("--at", type=int, default=5, help="the first throttled step")
    parser.add_argument("--quota", type=float, default=0.1, help="cores the slow replica keeps")
    args = parser.parse_args()
    if not os.access(f"{CGROUP}/cgroup.procs", os.W_OK):
        print(f"error: needs write access to the cgroup v1 CPU controller ({CGROUP})")
        return 1
    run_dir = tempfile.mkdtemp(prefix="meshrl-slow-")
    runs = {
        "unthrottled": run(run_dir, "plain", args.steps, None, args.quota),
        "slow": run(run_dir, "slow", args.steps, args.at, args.quota),
        "slow_evicted": run(
            run_dir, "evicted", args.steps, args.at, args.quota, "health.evict_slow=true"
        ),
    }
    plain = final_weights(runs["unthrottled"][1])
    figures = {}
    for name, (history, where, evicted) in runs.items():
        times = [r["time/step_s"] for r in history]
        weights = final_weights(where)
        figures[name] = {
            "step_s_before": round(statistics.mean(times[1 : args.at]), 3),
            "step_s_after": round(statistics.mean(times[args.at :]), 3),
            "evicted_at": evicted,
            "final_params_equal_unthrottled": all(weights[k].equal(plain[k]) for k in plain),
        }
    print(json.dumps({**figures, "steps": args.steps, "throttled_from": args.at}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
