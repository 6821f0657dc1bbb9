"""Profile steps across every proc: `run.profile_steps: [first, last]`.

While profiling is on, each meshrl actor endpoint (`@observed`) runs under
torch's profiler in the thread that runs it (a profiler started elsewhere in
the proc does not see that thread's ops), inside a `record_function` named
`<role>.<endpoint>`; the profiler's own start and stop around each call count
as the role `profiler`. At the end of the last step each proc writes one Chrome
trace (open it in Perfetto or chrome://tracing),
`<run dir>/profile/steps_<first>-<last>/<role>-<rank>.trace.json`, and the
controller merges every proc's endpoint intervals into `summary.json` beside
them: per step, its
wall time, each role's busy time (the union of its procs' endpoint intervals
within the step) and the time no role was busy (`between_s`: the controller's
own work and the messages between calls). Clocks are each host's wall clock.

A running run is profiled from any shell with `meshrl profile RUN_DIR
[--steps N]` (default 2): it leaves a request in the run directory, which the
controller takes at the start of its next step.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

_lock = threading.Lock()
active: ProcProfile | None = None  # this proc's, while profiling is on


class ProcProfile:
    """One proc's profile: its calls' torch profiles and endpoint intervals."""

    def __init__(self) -> None:
        self.profiles: list[Any] = []
        # (role, endpoint, start, end); role "profiler": the profiler's own start and stop
        self.intervals: list[tuple[str, str, float, float]] = []

    @contextlib.contextmanager
    def call(self, role: str, endpoint: str) -> Iterator[None]:
        import torch
        from torch.profiler import ProfilerActivity, profile, record_function

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        t0 = time.time()
        with profile(activities=activities) as prof:
            t1 = time.time()
            with record_function(f"{role}.{endpoint}"):
                yield
            t2 = time.time()
        t3 = time.time()
        with _lock:  # exported at the end, out of the profiled steps
            self.profiles.append(prof)
            self.intervals += [
                (role, endpoint, t1, t2),
                ("profiler", "start", t0, t1),
                ("profiler", "stop", t2, t3),
            ]

    def write(self, path: str) -> None:
        """One Chrome trace of every call, each export's `ts` (which counts from
        its own base) shifted onto the first's."""
        events: list[dict] = []
        base_ns = None
        for prof in self.profiles:
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                prof.export_chrome_trace(f.name)
                with open(f.name) as r:
                    trace = json.load(r)
            base = int(trace.get("baseTimeNanoseconds", 0))
            base_ns = base if base_ns is None else base_ns
            for event in trace.get("traceEvents", []):
                if event.get("ph") == "M" and events:
                    continue  # process and thread names: once is enough
                if "ts" in event:
                    event["ts"] = float(event["ts"]) + (base - base_ns) / 1000
                events.append(event)
        trace = {"traceEvents": events, "displayTimeUnit": "ms"}
        if base_ns is not None:
            trace["baseTimeNanoseconds"] = base_ns
        with open(path, "w") as f:
            json.dump(trace, f)


def start() -> None:
    """Profile this proc's endpoint calls from now on."""
    global active
    # Kineto logs each start and stop at every level below this one (read when
    # the profiler first starts in this proc).
    os.environ.setdefault("KINETO_LOG_LEVEL", "9")
    from torch.profiler import profile

    with profile():  # torch's profiler pays its first start once per proc (~1.5 s)
        pass
    active = ProcProfile()


def finish(path: str) -> list[tuple[str, str, float, float]]:
    """Stop, write this proc's trace to `path`, and return its endpoint intervals."""
    global active
    taken, active = active, None
    if taken is None:
        return []
    taken.write(path)
    return taken.intervals


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarize(windows: dict[int, tuple[float, float]], intervals: list[tuple]) -> dict:
    """Per step: its wall time, each role's busy time within it (`profiler`: the
    profiler's own), and the rest."""
    steps = []
    for step, (w0, w1) in sorted(windows.items()):
        clipped: dict[str, list] = {}
        for role, _endpoint, a, b in intervals:
            a, b = max(a, w0), min(b, w1)
            if b > a:
                clipped.setdefault(role, []).append((a, b))
        roles = {role: round(_union(spans), 6) for role, spans in sorted(clipped.items())}
        busy = _union([s for spans in clipped.values() for s in spans])
        between = (w1 - w0) - busy
        steps.append(
            {
                "step": step,
                "step_s": round(w1 - w0, 6),
                "roles": roles,
                "between_s": round(between, 6),
                "sum_s": round(sum(roles.values()) + between, 6),
            }
        )
    return {"steps": steps}


def table(summary: dict) -> str:
    roles = sorted({r for s in summary["steps"] for r in s["roles"]})
    head = ["step", "step_s", *roles, "between_s"]
    lines = ["  ".join(f"{h:>11}" for h in head)]
    for s in summary["steps"]:
        cells = [s["step"], s["step_s"], *(s["roles"].get(r, 0.0) for r in roles), s["between_s"]]
        lines.append(
            "  ".join(f"{c:>11.3f}" if isinstance(c, float) else f"{c:>11}" for c in cells)
        )
    return "\n".join(lines)


class Profiler:
    """The controller's side: turn profiling on in every proc for the steps
    `[first, last]`, and at the end gather the traces and write the summary."""

    def __init__(self, run_dir: str, steps: list[int], meshes: Any, wait: Any, timeout_s: float):
        """`meshes`: the run's `RoleMeshes`; `wait`: `wait` of `procs/mesh.py`."""
        self.first, self.last = steps
        self.wait = wait
        self.dir = os.path.join(run_dir, "profile", f"steps_{self.first}-{self.last}")
        self.meshes, self.timeout_s = meshes, timeout_s
        self.windows: dict[int, tuple[float, float]] = {}
        self.on = False

    def begin(self, step: int) -> None:
        if self.on or not self.first <= step <= self.last:
            return
        calls = [(r, w.profile_start.call()) for r, w in self.meshes.watches.items()]
        for role, call in calls:
            self.wait(call, f"{role}.watch.profile_start", self.timeout_s)
        self.on = True

    def end(self, step: int, start: float, end: float) -> None:
        if not self.on:
            return
        self.windows[step] = (start, end)
        if step >= self.last:
            self.finish()

    def finish(self) -> dict | None:
        """Gather every proc's trace and intervals; write and print the summary."""
        if not self.on:
            return None
        self.on = False
        os.makedirs(self.dir, exist_ok=True)
        calls = [(r, w.profile_dump.call(self.dir)) for r, w in self.meshes.watches.items()]
        intervals, traces = [], []
        for role, call in calls:
            for _, (path, spans) in self.wait(
                call, f"{role}.watch.profile_dump", self.timeout_s
            ).items():
                traces.append(os.path.relpath(path, self.dir))
                intervals.extend(tuple(s) for s in spans)
        summary = {**summarize(self.windows, intervals), "traces": sorted(traces)}
        with open(os.path.join(self.dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        print(f"profile of steps {self.first}-{self.last} (seconds):\n{table(summary)}", flush=True)
        return summary


REQUEST = "profile_request.json"


def take_request(run_dir: str, step: int) -> list[int] | None:
    """[step, last] if `meshrl profile` asked for the next steps (the request is
    consumed), else None."""
    path = os.path.join(run_dir, REQUEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            steps = int(json.load(f)["steps"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        print(f"ignoring {path}: {error}", flush=True)
        steps = 0
    with contextlib.suppress(OSError):
        os.unlink(path)
    return [step, step + steps - 1] if steps > 0 else None


def main(argv: list[str] | None = None) -> int:
    """`meshrl profile RUN_DIR [--steps N]`: profile a running run's next N steps."""
    import argparse
    import sys

    from meshrl.observe.status import read_running

    parser = argparse.ArgumentParser(prog="meshrl profile", description=main.__doc__)
    parser.add_argument("run_dir")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    if args.steps < 1:
        print("error: --steps must be >= 1", file=sys.stderr)
        return 2
    try:
        status = read_running(args.run_dir)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    with open(os.path.join(args.run_dir, REQUEST), "w") as f:
        json.dump({"steps": args.steps}, f)
    print(
        f"asked for {args.steps} steps of profile from step {status.get('step', -1) + 1} or so: "
        f"{args.run_dir}/profile/steps_<first>-<last>/ (its summary is printed by the run)"
    )
    return 0
