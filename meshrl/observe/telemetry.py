"""Metrics recorded inside actors, and what each actor is doing (the mesh status).

Any code that runs in a meshrl actor's process, a loss function on the trainer
included, records a metric with a reduction:

    from meshrl.observe.telemetry import record
    record("policy/prompt_tokens", n, reduce="sum")

Values add up in the process until the controller collects them at the end of
each step, from every proc of every mesh, and reduces them across the mesh:
`mean` is the mean of every value recorded (not a mean of per-proc means),
`sum`, `min` and `max` what they say. The step's record in `metrics.jsonl` (and
each sink) then holds the key once. Generation sent ahead for a later step
(`max_staleness > 0`) is waited for before a step is recorded, so its values land
in that step's record in every run (a pull queue's groups, `rollout.dispatch:
pull`, land in the step under way when they end).

Actors mix in `Observed` and mark endpoints with `@observed`: each call's
duration is recorded as `time/<role>/<endpoint>_s`, and the proc's `Watch`
actor (one per proc, spawned by `RoleMeshes`) reports the endpoint under way,
the weight version and the last activity, also while the other actors compute
or hang (`Algorithm.mesh_status()`, `meshrl status RUN_DIR`).
"""

from __future__ import annotations

import functools
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from monarch.actor import Actor, current_rank, endpoint

from meshrl.observe import profile

REDUCTIONS = ("mean", "sum", "min", "max")

_lock = threading.Lock()
_pending: dict[str, list] = {}  # key -> [reduce, value (sum, min or max), count]


def record(key: str, value: float, reduce: str = "mean") -> None:
    """Record `value` under `key` in this process, reduced with `reduce` over
    everything recorded under `key` in this step on every proc."""
    if reduce not in REDUCTIONS:
        raise ValueError(f"metric '{key}': reduce '{reduce}' is not one of {', '.join(REDUCTIONS)}")
    with _lock:
        _merge(_pending, key, reduce, float(value), 1)


def _merge(table: dict[str, list], key: str, reduce: str, value: float, count: int) -> None:
    """Fold a partial reduction (`value` over `count` records) into `table[key]`."""
    entry = table.get(key)
    if entry is None:
        table[key] = [reduce, value, count]
        return
    if entry[0] != reduce:
        raise ValueError(f"metric '{key}' is recorded with reduce '{reduce}' and '{entry[0]}'")
    if reduce == "min":
        entry[1] = min(entry[1], value)
    elif reduce == "max":
        entry[1] = max(entry[1], value)
    else:
        entry[1] += value  # sum; mean keeps the sum (and the count beside it)
    entry[2] += count


def drain() -> dict[str, tuple[str, float, int]]:
    """What this process recorded since the last drain, as partial reductions."""
    global _pending
    with _lock:
        taken, _pending = _pending, {}
    return {key: (reduce, value, count) for key, (reduce, value, count) in taken.items()}


def reduce_partials(parts: list[dict[str, tuple[str, float, int]]]) -> dict[str, float]:
    """Every proc's `drain()` -> one value per key."""
    merged: dict[str, list] = {}
    for part in parts:
        for key, (reduce, value, count) in part.items():
            _merge(merged, key, reduce, value, count)
    return {
        key: value / count if reduce == "mean" else value
        for key, (reduce, value, count) in merged.items()
    }


_actors: dict[int, dict[str, Any]] = {}  # id(actor) -> what `Watch` reports of it
_calls: dict[str, list] = {}  # `role/endpoint` -> [calls, seconds] since the last report


def drain_calls() -> dict[str, tuple[int, float]]:
    """This proc's endpoint calls since the last drain: `role/endpoint` -> (calls,
    seconds). Kept per proc, where the metrics are reduced over the mesh: the
    controller compares each proc's times with its role's (`meshrl.loop.health`)."""
    global _calls
    with _lock:
        taken, _calls = _calls, {}
    return {key: (n, seconds) for key, (n, seconds) in taken.items()}


def observed(fn: Callable) -> Callable:
    """Time an actor endpoint (`time/<role>/<name>_s`, max over the mesh: the
    slowest proc bounds the step) and show it as under way in the mesh status
    while it runs. Put it under `@endpoint`; the actor mixes in `Observed`."""
    name = fn.__name__

    @functools.wraps(fn)
    def wrapper(self: Observed, *args: Any, **kwargs: Any) -> Any:
        entry = _register(self)
        started = time.time()
        entry["endpoint"], entry["since"] = name, started
        try:
            if profile.active is None:
                return fn(self, *args, **kwargs)
            with profile.active.call(self.role, name):  # `run.profile_steps`
                return fn(self, *args, **kwargs)
        finally:
            ended = time.time()
            entry.update(endpoint=None, since=None, last_active=ended, calls=entry["calls"] + 1)
            entry["version"] = self.weight_version()
            record(f"time/{self.role}/{name}_s", ended - started, "max")
            with _lock:
                calls = _calls.setdefault(f"{self.role}/{name}", [0, 0.0])
                calls[0] += 1
                calls[1] += ended - started

    return wrapper


def _register(actor: Observed) -> dict[str, Any]:
    entry = _actors.get(id(actor))
    if entry is None:
        entry = _actors[id(actor)] = {
            "actor": actor.role,
            "endpoint": None,
            "since": None,
            "last_active": None,
            "calls": 0,
            "version": actor.weight_version(),
        }
    return entry


class Observed:
    """Mixin for meshrl's actors: `role` names them in metrics and in the status,
    where each shows from the end of its `__init__`."""

    role = "actor"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None:
            return

        @functools.wraps(init)
        def registered(self: Observed, *args: Any, **kw: Any) -> None:
            init(self, *args, **kw)
            _register(self)

        cls.__init__ = registered

    def weight_version(self) -> int | None:
        """The weight version this actor computes with: its `WeightReceiver`'s
        (replicas, reference, critic), else its own `version` (the trainer), else
        None (no weights)."""
        weights = getattr(self, "weights", None)
        return weights.version if weights is not None else getattr(self, "version", None)


RANK_ENV = "MESHRL_RANK"


def proc_rank() -> int:
    """This proc's rank in its role: Monarch's, or for a member of an elastic
    role (a mesh of one proc each, `procs/pool.py`) the rank its Watch was given."""
    given = os.environ.get(RANK_ENV)
    return int(given) if given is not None else current_rank().rank


class Watch(Actor):
    """One per proc, beside the role's actors (`RoleMeshes` spawns it). Being an
    actor of its own, it answers while the others compute or hang."""

    def __init__(self, role: str):
        self.role = role
        # A new Watch starts a run in this proc (a pooled proc may have served one
        # before): the actors and metrics of earlier runs are not this one's.
        _actors.clear()
        drain()
        drain_calls()
        os.environ.pop(RANK_ENV, None)

    @endpoint
    def set_rank(self, rank: int) -> None:
        """This proc is rank `rank` of an elastic role (before its actors start)."""
        os.environ[RANK_ENV] = str(rank)

    def _status(self) -> dict[str, Any]:
        now = time.time()
        actors = []
        for entry in list(_actors.values()):
            since = entry.get("since")
            actors.append(
                {
                    "actor": entry["actor"],
                    "version": entry.get("version"),
                    "endpoint": entry.get("endpoint"),
                    "busy_s": round(now - since, 3) if since else 0.0,
                    "last_active": entry.get("last_active"),
                    "calls": entry["calls"],
                }
            )
        return {
            "role": self.role,
            "rank": proc_rank(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "heartbeat": now,
            "actors": actors,
        }

    @endpoint
    def status(self) -> dict[str, Any]:
        """This proc: host, pid, the time now, and each meshrl actor in it (weight
        version, the endpoint under way and for how long, last activity)."""
        return self._status()

    @endpoint
    def profile_start(self) -> None:
        """Profile this proc's endpoint calls from now on (`meshrl.observe.profile`)."""
        profile.start()

    @endpoint
    def profile_dump(self, directory: str) -> tuple[str, list]:
        """Stop profiling; write this proc's trace into `directory`; its path and
        the proc's endpoint intervals."""
        path = os.path.join(directory, f"{self.role}-{proc_rank()}.trace.json")
        return path, profile.finish(path)

    @endpoint
    def report(self) -> tuple[dict[str, tuple[str, float, int]], dict[str, Any]]:
        """The metrics recorded in this proc since the last report, and `status`
        with this proc's endpoint calls since then (`calls`: `drain_calls`)."""
        return drain(), {**self._status(), "calls": drain_calls()}
