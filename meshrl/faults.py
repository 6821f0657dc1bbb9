"""Fault injection for tests and drills, and the endpoint that makes it real.

`faults.kill` lists procs to kill as `role:rank@step` (e.g.
`environment:0@5`): at the start of that RL step the controller tells that
proc to exit at once (`os._exit`), as a crash or an OOM kill would. What the
run does about it is the algorithm's recovery (see `algorithms/base.py`): a
policy or environment mesh is replaced within the step; a trainer mesh is
replaced and the run goes back to its newest checkpoint (`checkpoint.every`
must be set).
Every actor that can be drilled mixes in `Drillable`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from monarch.actor import endpoint

from meshrl.config import ConfigError

_KILL = re.compile(r"^([a-z_]+):(\d+)@(\d+)$")


@dataclass
class FaultsConfig:
    kill: list[str] = field(default_factory=list)
    """Procs to kill, as role:rank@step, e.g. ["environment:0@5", "policy:1@9"]."""
    max_recoveries: int = 10
    """Recoveries allowed in a run before it gives up with the error."""

    def validate(self, roles: tuple[str, ...] = ("policy", "environment", "trainer")) -> None:
        for item in self.kill:
            match = _KILL.match(item)
            if not match:
                raise ConfigError(f"config key 'faults.kill': '{item}' is not role:rank@step")
            if match.group(1) not in roles:
                raise ConfigError(
                    f"config key 'faults.kill': '{item}': in-job recovery covers {', '.join(roles)}"
                )
        if self.max_recoveries < 0:
            raise ConfigError("config key 'faults.max_recoveries': must be >= 0")

    def kills_at(self, step: int) -> list[tuple[str, int]]:
        """(role, rank) of the procs to kill at the start of `step`."""
        found = []
        for item in self.kill:
            role, rank, at = _KILL.match(item).groups()
            if int(at) == step:
                found.append((role, int(rank)))
        return found


class Drillable:
    """Mixed into actors: lets a drill end this proc as a crash would."""

    @endpoint
    def exit_now(self, code: int = 17) -> None:
        os._exit(code)
