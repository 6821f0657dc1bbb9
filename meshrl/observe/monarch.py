"""Monarch's own observability for a run: telemetry, the dashboard, mesh admin.

`run.telemetry: true` turns on Monarch's distributed telemetry for the run's
job (a `LocalJob` on this host for `job.kind: local`, the job itself for the
others); `run.dashboard: true` also serves Monarch's dashboard. Then:

- every actor, mesh and message of the run is in Monarch's SQL tables, under
  meshrl's names: each role's procs are the proc mesh named after the role
  (`policy`, `trainer`, ...), its actors the actor mesh of the same name, and
  each proc's `watch` beside them;
- each step's record goes into Monarch's `events` table as one line,
  `meshrl_step|<step>|<start_us>|<end_us>|<key>=<value>;...`, so one query joins
  steps with the actors and messages of their time window (`STEP_MESSAGES_SQL`);
- `meshrl status` and `algo.mesh_status()` take each actor's state (and a
  failure's reason) from Monarch, beside meshrl's own view (weight versions, the
  endpoint under way).

Monarch 0.7 accepts no user tables (its ingest route takes only its snapshot
tables), hence the step records ride on its `events` table.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from meshrl.config import ConfigError

STEPS_SQL = (
    "SELECT CAST(split_part(fields_json, '|', 2) AS BIGINT) AS step, "
    "CAST(split_part(fields_json, '|', 3) AS BIGINT) AS start_us, "
    "CAST(split_part(fields_json, '|', 4) AS BIGINT) AS end_us, "
    "split_part(fields_json, '|', 6) AS metrics "
    "FROM events WHERE fields_json LIKE '%meshrl_step|%'"
)
"""Each step logged so far: its number, wall-clock window and metrics."""

ACTORS_SQL = (
    "SELECT DISTINCT p.given_name AS role, a.rank AS rank, m.given_name AS actor, a.id AS id "
    "FROM actors a JOIN meshes m ON a.mesh_id = m.id JOIN meshes p ON m.parent_mesh_id = p.id "
    "WHERE p.class = 'Proc' AND m.class LIKE 'Python<%' AND m.given_name <> 'setup'"
)
"""Every Python actor by the proc mesh (meshrl: the role) and rank it runs on."""

STEP_MESSAGES_SQL = (
    f"WITH steps AS ({STEPS_SQL}), roles AS ({ACTORS_SQL}) "
    "SELECT s.step, r.role, r.actor, msg.endpoint, COUNT(*) AS messages "
    "FROM steps s JOIN messages msg ON msg.timestamp_us BETWEEN s.start_us AND s.end_us "
    "JOIN roles r ON msg.to_actor_id = r.id WHERE msg.endpoint IS NOT NULL "
    "GROUP BY s.step, r.role, r.actor, msg.endpoint ORDER BY s.step, r.role, msg.endpoint"
)
"""Messages each step sent to each role's actors, by endpoint."""

STATES_SQL = (
    f"WITH roles AS ({ACTORS_SQL}) SELECT r.role, r.rank, r.actor, e.new_status AS status, "
    "e.reason, e.timestamp_us FROM roles r JOIN actor_status_events e ON e.actor_id = r.id"
)


_used_in_process = False  # a job of this process had Monarch's telemetry (`Observe.enable`)


class Observe:
    """Monarch telemetry (and dashboard) for one run's job; `None` of it when off."""

    def __init__(
        self,
        telemetry: bool,
        dashboard: bool = False,
        port: int = 8265,
        host: str = "127.0.0.1",
        alive: Callable[[int], bool] | None = None,
    ):
        self.on = telemetry or dashboard
        self.dashboard = dashboard
        self.port, self.host = port, host
        self.front: Any = None
        self.telemetry_url: str | None = None
        self.dashboard_url: str | None = None
        self.admin_url: str | None = None
        self.client: Any = None
        self._sidecar_pid: int | None = None
        self.alive = alive
        """Whether a pid runs on this machine (a zombie does not): `close` waits with
        it for Monarch's sidecar to end. Handed in by the run (`alive` of
        `procs/proc_pool.py`: observe stands below procs); None: `close` does not wait."""

    @classmethod
    def of(cls, run: Any, alive: Callable[[int], bool]) -> Observe | None:
        """From a `run:` config section; None when telemetry is off."""
        if not (run.telemetry or run.dashboard):
            return None
        return cls(run.telemetry, run.dashboard, run.dashboard_port, run.dashboard_host, alive)

    def enable(self, job: Any, kind: str) -> None:
        """Ask `job` for telemetry, before its `state()`."""
        from monarch.job import MeshAdminConfig, TelemetryConfig

        if _used_in_process:
            # Monarch 0.7 points this process's telemetry sink at one job's socket
            # once, and spawns mesh admin here once, both for the process's life.
            raise ConfigError(
                "config key 'run.telemetry': Monarch runs telemetry for one job per "
                "process and this one had it already (restart the kernel, or run "
                "the script in a process of its own)"
            )

        # Mesh admin's default port is fixed (1729): a second run on this host
        # would collide, so on one machine it takes a free loopback port.
        admin = MeshAdminConfig(admin_addr="127.0.0.1:0") if kind in ("local", "process") else None
        # Monarch's public dashboard binds every interface with no authentication:
        # never asked for. Its loopback server (the telemetry URL) serves the same
        # app, and meshrl's front (`meshrl.observe.front`) serves that on run.dashboard_host.
        config = TelemetryConfig(include_dashboard=False, dashboard_port=0)
        job.enable_telemetry(config, mesh_admin_config=admin)

    def started(self, job: Any, state: Any, kind: str) -> None:
        """Take the URLs from the job's state; one line if Monarch could not start it."""
        self.telemetry_url = state.telemetry_url
        self.admin_url = getattr(state, "admin_url", None)
        global _used_in_process
        _used_in_process = True
        self.client = state.query_engine_client
        if self.telemetry_url is None or self.client is None:
            raise ConfigError(
                f"config key 'run.telemetry': Monarch could not start telemetry for "
                f"job.kind={kind} (Monarch's log says why)"
            )
        from monarch._src.job.job_sidecar import find_job_sidecar

        sidecar = find_job_sidecar(job.apply_id) if job.apply_id else None
        self._sidecar_pid = getattr(sidecar, "_pid", None)
        if self.dashboard:
            self.front = open_front(self.telemetry_url, self.host, self.port)
            self.dashboard_url = self.front.url
            print(f"meshrl: dashboard at {self.dashboard_url}", flush=True)

    def urls(self) -> dict[str, str | None]:
        return {
            "telemetry_url": self.telemetry_url,
            "dashboard_url": self.dashboard_url,
            "admin_url": self.admin_url,
        }

    def query(self, sql: str, timeout_s: float = 10.0) -> list[dict]:
        """Rows of a SQL query over Monarch's telemetry tables."""
        return self.client.query(sql, timeout=timeout_s)["rows"]

    def step(self, step: int, start: float, end: float, metrics: dict[str, Any]) -> None:
        """Put one step's record into Monarch's `events` table (see `STEPS_SQL`)."""
        from monarch._rust_bindings.monarch_hyperactor.telemetry import forward_to_tracing

        values = ";".join(
            f"{key}={value:.6g}"
            for key, value in metrics.items()
            if isinstance(value, int | float) and not isinstance(value, bool)
        )
        line = f"meshrl_step|{step}|{int(start * 1e6)}|{int(end * 1e6)}||{values}"
        forward_to_tracing(logging.LogRecord("meshrl", logging.INFO, "meshrl", 0, line, (), None))

    def alarm(self, step: int, name: str, line: str) -> None:
        """A run-health alarm as it trips (`meshrl.loop.health`), into the same
        `events` table: `meshrl_health|<step>|<name>|<line>`, beside the step records."""
        from monarch._rust_bindings.monarch_hyperactor.telemetry import forward_to_tracing

        text = f"meshrl_health|{step}|{name}|{line}"
        forward_to_tracing(
            logging.LogRecord("meshrl", logging.WARNING, "meshrl", 0, text, (), None)
        )

    def actor_states(self, timeout_s: float = 10.0) -> dict[tuple[str, int], dict[str, dict]]:
        """(role, rank) -> actor -> its latest Monarch status and the reason given."""
        return states_from_rows(self.query(STATES_SQL, timeout_s))

    def close(self) -> None:
        """After the job was killed: make sure its sidecar (dashboard, SQL) is gone."""
        if self.front is not None:
            self.front.close()
            self.front = None
        pid, self._sidecar_pid = self._sidecar_pid, None
        # Monarch's own stop waits 10 s, then kills it: it may still be exiting.
        deadline = time.monotonic() + 5.0
        while pid is not None and self.alive is not None and self.alive(pid):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                print(f"Monarch's telemetry sidecar (pid {pid}) outlived its job: killed")
                return
            time.sleep(0.1)


def states_from_rows(rows: list[dict]) -> dict[tuple[str, int], dict[str, dict]]:
    """The latest status event of each actor, by (role, rank) and actor name."""
    latest: dict[tuple[str, int, str], dict] = {}
    for row in rows:
        key = (row["role"], int(row["rank"]), row["actor"])
        if key not in latest or row["timestamp_us"] >= latest[key]["timestamp_us"]:
            latest[key] = row
    out: dict[tuple[str, int], dict[str, dict]] = {}
    for (role, rank, actor), row in latest.items():
        out.setdefault((role, rank), {})[actor] = {
            "status": str(row["status"]).lower(),
            "reason": row.get("reason"),
        }
    return out


def merge_states(procs: list[dict], states: dict[tuple[str, int], dict[str, dict]]) -> None:
    """Add Monarch's view to meshrl's status rows: each actor's `monarch` status,
    and a proc's `failure` when Monarch says one of its actors failed."""
    for proc in procs:
        actors = states.get((proc.get("role"), proc.get("rank")), {})
        proc["monarch"] = {name: state["status"] for name, state in actors.items()}
        failed = [f"{n}: {s['reason']}" for n, s in actors.items() if s["status"] == "failed"]
        if failed:
            proc["failure"] = "; ".join(failed)


def open_front(upstream: str, host: str, port: int) -> Any:
    """meshrl's dashboard front on `host`:`port`; a port in use falls back to a
    free one, saying so; an address this host does not have is one line."""
    from meshrl.observe.front import DashboardFront

    try:
        return DashboardFront(upstream, host, port)
    except OSError as error:
        if error.errno == errno.EADDRINUSE and port:
            print(f"meshrl: run.dashboard_port {port} is in use: taking a free port")
            return DashboardFront(upstream, host, 0)
        raise ConfigError(
            f"config key 'run.dashboard_host': cannot listen on {host}:{port} ({error.strerror})"
        ) from None
