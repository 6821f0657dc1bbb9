"""Scaling elastic pools while a run goes: the config's schedule, `meshrl scale`
from any shell, and `algo.scale(policy=3)` from a notebook.

    pool:
      schedule: ["policy=3@20", "policy=1@40"]   # role=size@step

    meshrl scale RUN_DIR policy=3 environment=2

Every change happens between two steps (`Scaler.apply`, called as a step
begins). A new replica is spawned with every actor its role's others have and
pulls the current weight version before the loop gives it any work; the
batches generated ahead are collected before a replica leaves, so no sample is
lost or made twice. Sampling seeds are the controller's, one per sample
(`Collector.layout`), so the samples do not depend on the pool's size.
`meshrl scale` leaves `scale_request.json` in the run directory; the
controller takes it at its next step and shows each pool in `status.json`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from meshrl.config import ConfigError
from meshrl.procs.pool import ScaleError

REQUEST = "scale_request.json"
_ENTRY = re.compile(r"^([a-z_]+)=(-?\d+)@(\d+)$")
_SIZE = re.compile(r"^([a-z_]+)=(-?\d+)$")


@dataclass
class PoolConfig:
    """Elastic policy and environment pools (meshrl/loop/elastic.py, docs/launch.md)."""

    schedule: list[str] = field(default_factory=list)
    """Pool sizes to take at given steps, as `role=size@step`, e.g. ["policy=3@20",
    "policy=1@40"]: the role's pool grows or shrinks as that step begins, once
    (a rewind to a checkpoint undoes no change). A resumed run starts with the
    pools of its `placement` and takes the entries still to come."""

    def validate(self) -> None:
        for entry in self.schedule:
            match = _ENTRY.match(str(entry))
            if not match:
                raise ConfigError(
                    f"config key 'pool.schedule': '{entry}' is not role=size@step "
                    "(e.g. policy=3@20)"
                )
            if int(match[2]) < 1:
                raise ConfigError(
                    f"config key 'pool.schedule': scale: {match[1]}={match[2]}: a pool keeps "
                    "at least 1 proc"
                )

    def entries(self) -> list[tuple[str, int, int]]:
        """(role, size, step) of each entry, in step order."""
        parsed = [_ENTRY.match(str(e)) for e in self.schedule]
        return sorted(((m[1], int(m[2]), int(m[3])) for m in parsed), key=lambda e: e[2])


def check(
    role: str,
    size: int,
    pools: dict[str, tuple[int | None, str]],
    fixed: dict[str, str] | None = None,
) -> str | None:
    """Why `role` cannot have `size` procs (one line), or None. `pools`: the
    elastic roles, each with its job's limit and the reason for it (None: no
    limit known yet); `fixed`: the other roles, each with why it cannot scale."""
    names = ", ".join(pools) or "none"
    if role not in pools:
        if fixed and role in fixed:
            return f"scale: {role} cannot be scaled ({fixed[role]}); elastic roles: {names}"
        return f"scale: no role {role!r}; elastic roles: {names}"
    if size < 1:
        return f"scale: {role}={size}: a pool keeps at least 1 proc"
    limit, reason = pools[role]
    if limit is not None and size > limit:
        return f"scale: {role}={size}: past this job's limit of {limit} ({reason})"
    return None


def parse_sizes(items: list[str]) -> dict[str, int]:
    """`["policy=3", "environment=2"]` -> {"policy": 3, "environment": 2}."""
    sizes = {}
    for item in items:
        match = _SIZE.match(item)
        if not match:
            raise ScaleError(f"scale: '{item}' is not role=size (e.g. policy=3)")
        sizes[match[1]] = int(match[2])
    return sizes


class Scaler:
    """Pool sizes over a run: `apply(step)` takes the schedule's entries due, and a
    request left by `meshrl scale`, as each step begins; `scale(**sizes)` is
    the notebook's call. `settle()` collects work in flight before a replica
    leaves; `catch_up(role)` brings new replicas to the current version."""

    def __init__(
        self,
        run: Any,
        cfg: PoolConfig,
        settle: Callable[[], None],
        catch_up: Callable[[str], None],
        standby: dict[str, int] | None = None,
    ):
        self.run, self.cfg, self.settle, self.catch_up = run, cfg, settle, catch_up
        self.group = run.meshes.by_role  # role -> ProcGroup, for the elastic roles
        self.roles = list(run.elastic)  # in the order the algorithm named them
        self.limits = {r: (self.group[r].limit, self.group[r].limit_reason) for r in self.roles}
        self.fixed = run.fixed_roles()  # the others, each with why it cannot scale
        self.fired: set[tuple[str, int, int]] = set()
        for role, count in (standby or {}).items():  # spares, now that every actor is spawned
            if role in self.roles:
                self.group[role].standby = count
                self.group[role].fill_standbys()
        self.show()

    def size(self, role: str) -> int:
        return len(self.group[role])

    def apply(self, step: int) -> None:
        """The changes due as `step` begins: the schedule's, then a request's."""
        # Each entry once: a rewind to a checkpoint does not undo what came since.
        entries = [e for e in self.cfg.entries() if e[2] == step and e not in self.fired]
        self.fired.update(entries)
        due = {role: size for role, size, _ in entries}
        sizes = {**due, **take_request(self.run.dir)}
        if sizes:
            self.scale(**sizes)

    def scale(self, **sizes: int) -> None:
        """Grow or shrink pools now (between steps): `scale(policy=3)`."""
        for role, size in sizes.items():
            problem = check(role, size, self.limits, self.fixed)
            if problem:
                raise ScaleError(problem)
        for role, size in sizes.items():
            before = self.size(role)
            if size == before:
                continue
            started = time.monotonic()
            if size < before:
                self.settle()  # what the leaving replicas are generating is collected first
            new = self.run.scale(role, size)
            if new:
                self.catch_up(role)  # before the loop gives them work
            print(
                f"scaled {role}: {before} -> {size} procs in {time.monotonic() - started:.1f}s",
                flush=True,
            )
        self.show()

    def show(self) -> None:
        """The pools in `status.json` (what `meshrl scale` checks against)."""
        if self.run.status is not None:
            self.run.status.extra["pool"] = {
                role: {
                    "size": self.size(role),
                    "limit": self.limits[role][0],
                    "reason": self.limits[role][1],
                }
                for role in self.roles
            }
            self.run.status.extra["fixed_roles"] = self.fixed

    def metrics(self) -> dict[str, int]:
        """`pool/<role>_size` for each elastic role (both logged every step)."""
        return {f"pool/{role}_size": self.size(role) for role in self.roles}


def take_request(run_dir: str) -> dict[str, int]:
    """Sizes `meshrl scale` asked for (the request is consumed), else {}."""
    path = os.path.join(run_dir, REQUEST)
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            sizes = {str(k): int(v) for k, v in json.load(f).items()}
    except (OSError, ValueError, AttributeError, TypeError) as error:
        print(f"ignoring {path}: {error}", flush=True)
        sizes = {}
    with contextlib.suppress(OSError):
        os.unlink(path)
    return sizes


def main(argv: list[str] | None = None) -> int:
    """`meshrl scale RUN_DIR role=N ...`: resize a running run's elastic pools."""
    import argparse

    from meshrl.observe.status import read, read_running, run_state

    parser = argparse.ArgumentParser(prog="meshrl scale", description=main.__doc__)
    parser.add_argument("run_dir")
    parser.add_argument("sizes", nargs="+", metavar="role=N")
    parser.add_argument("--wait-s", type=float, default=120.0, help="how long to wait for it")
    args = parser.parse_args(argv)
    try:
        sizes = parse_sizes(args.sizes)
        status = read_running(args.run_dir)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    pools = status.get("pool", {})
    limits = {role: (p["limit"], p["reason"]) for role, p in pools.items()}
    for role, size in sizes.items():
        problem = check(role, size, limits, status.get("fixed_roles", {}))
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 1
    path = os.path.join(args.run_dir, REQUEST)
    with open(path + ".tmp", "w") as f:
        json.dump(sizes, f)
    os.replace(path + ".tmp", path)  # the controller never reads half a request
    deadline = time.monotonic() + args.wait_s
    while time.monotonic() < deadline:
        time.sleep(0.5)
        with contextlib.suppress(OSError, ValueError):
            status = read(args.run_dir)
        now = {role: p["size"] for role, p in status.get("pool", {}).items()}
        if all(now.get(role) == size for role, size in sizes.items()):
            print("scaled: " + " ".join(f"{r}={n}" for r, n in now.items()))
            return 0
        if run_state(status) != "running":
            print(f"error: the run in {args.run_dir} ended first", file=sys.stderr)
            return 1
    print(
        f"asked for {' '.join(args.sizes)}; not applied within {args.wait_s:g}s "
        "(the run applies it as its next step begins)",
        file=sys.stderr,
    )
    return 1
