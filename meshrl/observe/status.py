"""The mesh at a glance: every proc of every role, its actors, their weight
versions and last activity, and which procs are dead or hang.

A run keeps `<run dir>/status.json` current: after every step, and every
`run.status_every_s` seconds from a thread that asks each proc's `Watch`
actor (which answers while the proc's other actors compute or hang). Read it:

    meshrl status RUN_DIR          # from any shell, while the run goes or after
    algo.mesh_status()             # in a notebook: asks every proc now
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
from typing import Any

from meshrl.observe.monarch import merge_states

logger = logging.getLogger(__name__)

STATUS_FILE = "status.json"


def rows(procs: list[dict], now: float) -> list[dict[str, Any]]:
    """One row per actor (or per proc without actors): what the table shows."""
    out = []
    for proc in sorted(procs, key=lambda p: (p.get("role", ""), p.get("rank", 0))):
        base = {
            "mesh": f"{proc.get('role')}[{proc.get('rank')}]",
            "host": proc.get("host", "?"),
            "pid": proc.get("pid", "?"),
            "heartbeat": _ago(proc.get("heartbeat"), now),
        }
        monarch = proc.get("monarch") or {}
        state = proc.get("state", "alive")
        if state != "alive":
            if proc.get("failure"):  # Monarch's reason, when its telemetry is on
                state = f"{state}: {proc['failure']}"
            out.append({**base, "actor": "-", "state": state, "version": "-", "last": "-"})
            continue
        for actor in proc.get("actors") or [{}]:
            busy = actor.get("endpoint")
            out.append(
                {
                    **base,
                    "actor": actor.get("actor", "-"),
                    "state": f"busy {busy} {actor.get('busy_s', 0):.1f}s" if busy else "idle",
                    "monarch": monarch.get(actor.get("actor"), "-"),
                    "version": "-" if actor.get("version") is None else actor["version"],
                    "last": _ago(actor.get("last_active"), now),
                }
            )
    return out


def _ago(stamp: float | None, now: float) -> str:
    return "-" if not stamp else f"{max(0.0, now - stamp):.1f}s ago"


def table(procs: list[dict], now: float | None = None) -> str:
    now = time.time() if now is None else now
    columns = ["mesh", "actor", "state", "version", "last", "heartbeat", "host", "pid"]
    if any(p.get("monarch") for p in procs):  # Monarch's telemetry is on
        columns.insert(3, "monarch")
    titles = {"last": "last call", "heartbeat": "answered"}
    body = [[str(r.get(c, "-")) for c in columns] for r in rows(procs, now)]
    head = [titles.get(c, c) for c in columns]
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=False)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in [head, *body]
    )


class StatusFile:
    """`<run dir>/status.json`, written after each step (`write`) and every
    `every_s` seconds by a thread asking the procs (`start`/`stop`)."""

    def __init__(self, run_dir: str, ask: Any, every_s: float):
        self.path = os.path.join(run_dir, STATUS_FILE)
        self.ask = ask  # () -> procs, e.g. RoleMeshes.status
        self.every_s = every_s
        self.step: int | None = None
        self.extra: dict[str, Any] = {}  # e.g. Monarch's dashboard and telemetry URLs
        self.scheduler: Any = None  # () -> {"slurm": {role: {job_id, nodes}}, "quarantined": [...]}
        self.procs: list[dict] = []  # the last view, kept when the run ends
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._unwritable = False  # said once until a write works again

    def write(self, procs: list[dict], step: int | None = None) -> None:
        with self._lock:
            if step is not None:
                self.step = step
            self.procs = procs
            record = {
                "written": time.time(),
                "controller_pid": os.getpid(),
                "step": self.step,
                **self.extra,
                **(self.scheduler() if self.scheduler is not None else {}),
                "procs": procs,
            }
            try:
                # Readable by its owner only: it holds the dashboard's token.
                fd = os.open(self.path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    json.dump(record, f)
                os.replace(self.path + ".tmp", self.path)
            except OSError as error:  # a view: the run goes on, the old status.json stays
                with contextlib.suppress(OSError):
                    os.remove(self.path + ".tmp")
                if not self._unwritable:
                    logger.warning("cannot write %s: %s", self.path, error.strerror or error)
                self._unwritable = True
                return
            self._unwritable = False

    def start(self) -> None:
        if self.every_s > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="meshrl-status", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                procs = self.ask()
            except Exception as error:  # noqa: BLE001 - a view; the run goes on without it
                logger.debug("status: %s", error)
                continue
            if not self._stop.is_set():
                self.write(procs)

    def stop(self) -> None:
        """Stop the thread and mark the run ended (its controller may live on: a
        notebook kernel, a test)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self.extra["ended"] = time.time()
        try:
            self.write(self.procs)
        except OSError as error:  # a view; the run's end goes on
            logger.debug("status: %s", error)


def read(run_dir: str) -> dict:
    path = os.path.join(run_dir, STATUS_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{run_dir} has no {STATUS_FILE} (is it a meshrl run directory?)")
    with open(path) as f:
        return json.load(f)


def alive_pid(run_dir: str, role: str) -> int | None:
    """The pid of a live proc of `role` as the run's status.json lists it; None while
    there is none (or no readable status.json yet): what a drill stops or kills."""
    with contextlib.suppress(OSError, ValueError):
        procs = read(str(run_dir)).get("procs", [])
        return next(
            (
                p["pid"]
                for p in procs
                if p.get("role") == role and p.get("state", "alive") == "alive"
            ),
            None,
        )
    return None


def read_running(run_dir: str) -> dict:
    """The `status.json` of a run still going; ValueError (one line) when there is
    none, or the run has finished (for commands that talk to a live run)."""
    try:
        status = read(run_dir)
    except OSError as error:
        raise ValueError(str(error)) from None
    if run_state(status) != "running":
        raise ValueError(f"the run in {run_dir} has finished")
    return status


def run_state(status: dict) -> str:
    """`running` or `exited`: the run whose `status.json` this is."""
    return "exited" if status.get("ended") else controller_state(status.get("controller_pid", 0))


def controller_state(pid: int) -> str:
    """`running` or `exited`: the run's controller process, by its pid."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "exited"
    except PermissionError:
        pass
    return "running"


def show(run_dir: str, status: dict) -> None:
    now = time.time()
    pid = status.get("controller_pid", 0)
    print(
        f"{run_dir}: step {status.get('step')}, written {now - status['written']:.1f}s ago "
        f"by controller pid {pid} ({run_state(status) if pid else '?'})"
    )
    for key in ("dashboard_url", "telemetry_url"):
        if status.get(key):
            print(f"{key.split('_')[0]}: {status[key]}")
    if status.get("endpoint_url"):  # its token stays in the file, never on a screen
        where = os.path.join(run_dir, STATUS_FILE)
        print(f"policy endpoint: {status['endpoint_url']} (its token: endpoint_token in {where})")
    for role, where in status.get("slurm", {}).items():
        print(f"SLURM {role}: job {where['job_id']} on {','.join(where['nodes']) or '-'}")
    if status.get("quarantined"):
        print(f"SLURM quarantined nodes: {', '.join(status['quarantined'])}")
    print(preflight_lines(status), end="")
    print(health_lines(status.get("health")), end="")
    procs = status["procs"]
    if status.get("telemetry_url") and pid and run_state(status) == "running":
        try:  # each actor's state now, from Monarch's telemetry
            merge_states(procs, live_states(status["telemetry_url"]))
        except (OSError, ValueError, KeyError) as error:
            print(f"(Monarch's telemetry did not answer: {error})")
    print(table(procs, now))


FIGURES = (
    "cpu_cores",
    "matmul_gflops",
    "gloo_gb_s",
    "nccl_gb_s",
    "rdma_gb_s",
    "disk_mb_s",
    "free_gb",
    "check_s",
)
"""A host's preflight figures, in the order they are shown."""


def brief(figures: dict) -> str:
    """A host's preflight figures in one line (`FIGURES`)."""
    return ", ".join(f"{k} {figures[k]:g}" for k in FIGURES if k in figures) or "no figures"


def preflight_lines(status: dict) -> str:
    """The preflight's view (`meshrl.procs.health_checks`): each host checked, with
    its role and figures, each one quarantined with its finding, and how long the
    checks took; nothing when there was none."""
    preflight = status.get("preflight") or {}
    runs = preflight.get("runs", [])
    if not preflight.get("hosts") and not runs:
        return ""
    took = sum(run["s"] for run in runs)
    lines = [
        f"preflight: {len(runs)} check(s) of {sum(r['hosts'] for r in runs)} host(s), {took:.2f}s"
    ]
    for host, figures in sorted(preflight.get("hosts", {}).items()):
        role = f" ({figures['role']})" if figures.get("role") else ""
        lines.append(f"  {host}{role}: {brief(figures)}")
    for host, line in sorted((status.get("preflight_quarantined") or {}).items()):
        lines.append(f"  quarantined {host}: {line}")
    return "".join(line + "\n" for line in lines)


def health_lines(health: dict | None) -> str:
    """The run-health view (`meshrl.loop.health`): each alarm that holds at the
    step last logged, the slow procs, the evicted ones; nothing when all is well."""
    if not health:
        return ""
    lines = [f"health at step {health['step']}: {line}" for line in health["alarms"].values()]
    if health.get("slow"):
        lines.append(f"slow procs: {', '.join(health['slow'])}")
    if health.get("evicted"):
        lines.append(f"evicted (slow): {', '.join(health['evicted'])}")
    return "".join(line + "\n" for line in lines)


def live_states(telemetry_url: str, timeout_s: float = 10.0) -> dict:
    """Each actor's state from a running run's Monarch telemetry (its SQL API)."""
    import urllib.request

    from meshrl.observe.monarch import STATES_SQL, states_from_rows

    request = urllib.request.Request(
        f"{telemetry_url}/api/query",
        data=json.dumps({"sql": STATES_SQL}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return states_from_rows(json.loads(response.read())["rows"])


def main(argv: list[str] | None = None) -> int:
    from meshrl.observe.run_dir import run_dir_command

    return run_dir_command("status", argv, read, show)


if __name__ == "__main__":
    sys.exit(main())
