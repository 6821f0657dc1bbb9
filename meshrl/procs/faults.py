"""Fault injection for tests and drills, and the endpoints that make it real.

`faults.kill` lists procs to kill as `role:rank@step` (e.g.
`environment:0@5`): at the start of that RL step the controller tells that
proc to exit at once (`os._exit`), as a crash or an OOM kill would.
`faults.raise_in` lists endpoints to fail as `role.endpoint@step` (e.g.
`environment.score@7`): in that step the endpoint raises `InjectedError` on
every proc of the role, as a bug or a transient error would.
`faults.weights` breaks a weight sync: `corrupt@STEP` flips a byte of the
version the trainer publishes after that step, `unmerged@STEP` (LoRA) leaves
that version's adapters out of the published weights (the base weights where
the merged ones belong, as a merge that did not happen), `skip_pull:RANK@STEP`
makes policy replica RANK answer that version's pull without moving a byte.
The checksums (`meshrl.weights.publisher`) stop the run with the replica and the version.

What the run does about it is the `Supervisor`'s and the loop's
(`meshrl/loop/supervisor.py`, `Checkpointer.rewind`): a
lost policy, environment or reference proc is replaced within the step; a lost
rank of a DDP trainer or critic is replaced and takes a surviving rank's state
(`Supervisor.heal`); a trainer or critic with no such peer (one rank, FSDP2) sends
the run back to its newest checkpoint (`checkpoint.every` must be set); an exception is retried up to
`faults.retry_errors` times, then ends the run with its one-line error.
Every actor that can be drilled mixes in `Drillable`.
"""

from __future__ import annotations

import os
import re
import time
import zlib
from dataclasses import dataclass, field

from monarch.actor import endpoint

from meshrl.config import ConfigError
from meshrl.observe.telemetry import Observed

_KILL = re.compile(r"^([a-z_]+):(\d+)@(\d+)$")
_RAISE = re.compile(r"^([a-z_]+)\.([a-z_]+)@(\d+)$")
_WEIGHTS = re.compile(r"^(corrupt|unmerged|skip_pull:(\d+))@(\d+)$")
_SLOW = re.compile(r"^(policy|environment):(\d+)x(\d+(?:\.\d+)?)@(\d+)$")
_LATENCY = re.compile(r"^(\d+(?:\.\d+)?),(\d+(?:\.\d+)?)x(\d+(?:\.\d+)?)$")

_LENGTHS = re.compile(r"^(\d+),(\d+(?:\.\d+)?)x(\d+)$")


ROLES = ("policy", "environment", "reference", "trainer", "critic")
DRILLED_ENDPOINTS = {
    "policy": ("generate",),
    "environment": ("score",),
    "reference": ("logprobs",),
    "trainer": ("train_step",),
    "critic": ("values", "train_step"),
}
"""The endpoints `faults.raise_in` can fail; each calls `Drillable.drill` first."""


def base_role(name: str) -> str:
    """The role of a mesh: itself, or `trainer` for a player's `trainer_a`."""
    return name if name in ROLES else name.rsplit("_", 1)[0]


class InjectedError(RuntimeError):
    """Raised inside an endpoint by a `faults.raise_in` drill."""


@dataclass
class FaultsConfig:
    kill: list[str] = field(default_factory=list)
    """Procs to kill, as role:rank@step, e.g. ["environment:0@5", "policy:1@9"]."""
    raise_in: list[str] = field(default_factory=list)
    """Endpoints to fail, as role.endpoint@step, e.g. ["environment.score@7"]."""
    weights: list[str] = field(default_factory=list)
    """Weight syncs to break: "corrupt@STEP" (a byte of the version published
    after STEP flipped in the trainer's slot), "unmerged@STEP" (LoRA: that
    version published without its adapters merged) or "skip_pull:RANK@STEP"
    (policy replica RANK does not copy that version but claims it)."""
    slow: list[str] = field(default_factory=list)
    """Procs to slow down from a step on, as role:rank x factor @ step, e.g.
    ["policy:3x4@0"]: each generate (score) call of that proc then takes
    `factor` times as long (it sleeps the difference, as a slower device would)."""
    episode_latency: str = ""
    """Environment latency per scoring call, as "SECONDS,SHARExFACTOR", e.g.
    "0.02,0.05x20": a call sleeps 0.02 s, or 20 times that when one of its
    episodes is among the 5% drawn slow (by a hash of its tokens), as a
    heavy-tailed tool or sandbox would. Empty: none."""
    completion_lengths: str = ""
    """Each completion's exact length, as "SHORT,SHARExLONG", e.g. "64,0.1x1024":
    a row is 1 to SHORT tokens long, or SHORT to LONG tokens for the SHARE drawn
    long (by its sampling seed), as reasoning completions' heavy tail; no stop id
    is drawn (a benchmark's workload). Up to generation.max_new_tokens. Empty: none."""
    standby: dict[str, int] = field(default_factory=dict)
    """Spare procs to keep per elastic role, e.g. {policy: 1}: spawned with every
    actor loaded (a policy standby takes each published version), each replaces a
    lost proc at once; a new one is then spawned in the background."""
    detect_s: float = 0.5
    """How often meshrl checks that procs live: the elastic roles' pids on `local`
    and `process` jobs (a lost one is seen within this, not after Monarch's
    supervision, about 10 s), and on SLURM each node's worker, dialled (a node
    lost is seen within twice this, not after Monarch's channel to it gives up
    reconnecting, a minute). 0: Monarch's only."""
    quarantine_after: int = 2
    """SLURM: a node on which procs were lost this many times is quarantined:
    no later allocation of the run gets it (`--exclude`); named in faults.log
    and `meshrl status`."""
    max_recoveries: int = 10
    """Recoveries of lost procs allowed in a run before it gives up with the error."""
    retry_errors: int = 0
    """Times a call whose actor raised is made again before the run ends with the
    error (for transient errors and `raise_in` drills); 0: the first ends it."""
    max_nonfinite_steps: int = 3
    """Trainer steps in a row whose loss or gradient is NaN or infinite (each is
    skipped and counted) before the run stops; the newest checkpoint is kept."""

    def validate(self) -> None:
        if self.quarantine_after < 1:
            raise ConfigError("config key 'faults.quarantine_after': must be >= 1")
        for item in self.kill:
            match = _KILL.match(item)
            if not match:
                raise ConfigError(f"config key 'faults.kill': '{item}' is not role:rank@step")
            if base_role(match.group(1)) not in ROLES:
                raise ConfigError(
                    f"config key 'faults.kill': '{item}': the roles are {', '.join(ROLES)} "
                    "(or role_<player> where several models train: trainer_a)"
                )
        for item in self.raise_in:
            match = _RAISE.match(item)
            if not match:
                raise ConfigError(
                    f"config key 'faults.raise_in': '{item}' is not role.endpoint@step"
                )
            role, name = base_role(match.group(1)), match.group(2)
            if name not in DRILLED_ENDPOINTS.get(role, ()):
                known = ", ".join(f"{r}.{e}" for r, es in DRILLED_ENDPOINTS.items() for e in es)
                raise ConfigError(
                    f"config key 'faults.raise_in': '{item}': the endpoints are {known}"
                )
        for item in self.weights:
            if not _WEIGHTS.match(item):
                raise ConfigError(
                    f"config key 'faults.weights': '{item}' is not corrupt@step, "
                    "unmerged@step or skip_pull:rank@step"
                )
        for item in self.slow:
            if not _SLOW.match(item):
                raise ConfigError(
                    f"config key 'faults.slow': '{item}' is not role:rank x factor @ step "
                    "(policy:3x4@0; roles policy, environment)"
                )
        if self.completion_lengths and not _LENGTHS.match(self.completion_lengths):
            raise ConfigError(
                f"config key 'faults.completion_lengths': '{self.completion_lengths}' is not "
                "SHORT,SHARExLONG (e.g. 64,0.1x1024)"
            )
        if self.episode_latency and not _LATENCY.match(self.episode_latency):
            raise ConfigError(
                f"config key 'faults.episode_latency': '{self.episode_latency}' is not "
                "SECONDS,SHARExFACTOR (e.g. 0.02,0.05x20)"
            )
        for role, count in self.standby.items():
            if role not in ("policy", "environment"):
                raise ConfigError(
                    f"config key 'faults.standby.{role}': standbys are for policy, environment"
                )
            if not isinstance(count, int) or count < 0:
                raise ConfigError(f"config key 'faults.standby.{role}': must be an integer >= 0")
        if self.detect_s < 0:
            raise ConfigError("config key 'faults.detect_s': must be >= 0")
        for key in ("max_recoveries", "retry_errors"):
            if getattr(self, key) < 0:
                raise ConfigError(f"config key 'faults.{key}': must be >= 0")
        if self.max_nonfinite_steps < 1:
            raise ConfigError("config key 'faults.max_nonfinite_steps': must be >= 1")

    def kills_at(self, step: int) -> list[tuple[str, int]]:
        """(role, rank) of the procs to kill at the start of `step`."""
        found = []
        for item in self.kill:
            role, rank, at = _KILL.match(item).groups()
            if int(at) == step:
                found.append((role, int(rank)))
        return found

    def weight_drills_at(self, step: int) -> list[tuple[str, str, int]]:
        """(role, drill, rank) of the weight syncs to break after `step`."""
        found = []
        for item in self.weights:
            kind, rank, at = _WEIGHTS.match(item).groups()
            if int(at) == step:
                found.append(
                    ("trainer", kind, 0) if rank is None else ("policy", "skip_pull", int(rank))
                )
        return found

    def slow_at(self, step: int) -> list[tuple[str, int, float]]:
        """(role, rank, factor) of the procs to slow down from `step` on."""
        found = []
        for item in self.slow:
            role, rank, factor, at = _SLOW.match(item).groups()
            if int(at) == step:
                found.append((role, int(rank), float(factor)))
        return found

    def lengths(self) -> tuple[int, float, int] | None:
        """(short, share, long) of `completion_lengths`, or None."""
        if not self.completion_lengths:
            return None
        short, share, long = _LENGTHS.match(self.completion_lengths).groups()
        return int(short), float(share), int(long)

    def latency(self) -> tuple[float, float, float] | None:
        """(seconds, share, factor) of `episode_latency`, or None."""
        if not self.episode_latency:
            return None
        seconds, share, factor = _LATENCY.match(self.episode_latency).groups()
        return float(seconds), float(share), float(factor)

    def raises_at(self, step: int) -> list[tuple[str, str]]:
        """(role, endpoint) of the endpoints to fail during `step`."""
        found = []
        for item in self.raise_in:
            role, name, at = _RAISE.match(item).groups()
            if int(at) == step:
                found.append((role, name))
        return found


class Drillable(Observed):
    """Mixed into actors: lets a drill end this proc as a crash would, or make
    its next call of an endpoint raise."""

    _armed: frozenset = frozenset()
    _slow: float = 1.0
    _latency: tuple[float, float, float] | None = None

    @endpoint
    def exit_now(self, code: int = 17) -> None:
        os._exit(code)

    @endpoint
    def arm_error(self, endpoint_name: str) -> None:
        """The next call of `endpoint_name` raises `InjectedError`."""
        self._armed = self._armed | {endpoint_name}

    @endpoint
    def arm(self, name: str) -> None:
        """This proc's next `armed(name)` is true (a `faults.weights` drill)."""
        self._armed = self._armed | {f"drill:{name}"}

    @endpoint
    def slow_down(self, factor: float) -> None:
        """From now on every drilled call takes `factor` times as long (`drag`)."""
        self._slow = factor

    @endpoint
    def set_latency(self, latency: tuple[float, float, float] | None) -> None:
        """(seconds, share, factor) that `wait_latency` sleeps per call."""
        self._latency = latency

    def drag(self, started: float) -> None:
        """Last line of a drilled call begun at `started` (time.perf_counter):
        sleep so that it took `slow_down`'s factor times as long."""
        if self._slow > 1:
            time.sleep((self._slow - 1) * (time.perf_counter() - started))

    def wait_latency(self, items: list) -> None:
        """Sleep an environment's `episode_latency` for a call on `items`: the
        base time, or its factor when an item hashes into the slow share."""
        if self._latency is None or not items:
            return
        seconds, share, factor = self._latency
        slow = any(zlib.crc32(repr(item).encode()) % 10_000 < share * 10_000 for item in items)
        time.sleep(seconds * (factor if slow else 1.0))

    def armed(self, name: str) -> bool:
        """Whether a drill armed `name` (once)."""
        if f"drill:{name}" not in self._armed:
            return False
        self._armed = self._armed - {f"drill:{name}"}
        return True

    def drill(self, endpoint_name: str) -> None:
        """First line of a drillable endpoint: raise if a drill armed it."""
        if endpoint_name in self._armed:
            self._armed = self._armed - {endpoint_name}
            raise InjectedError(f"faults.raise_in: injected error in {endpoint_name}")
