"""In-job recovery, without procs: an exception raised in an actor is reported, not
recovered, and the `faults:` drill's keys are checked."""

import pytest

from algorithms.grpo import GRPOConfig
from meshrl.config import ConfigError, load_config
from meshrl.loop.state import LoopState
from meshrl.loop.supervisor import Supervisor
from meshrl.procs.faults import FaultsConfig
from meshrl.procs.mesh import RemoteCallError


@pytest.mark.unit
def test_an_exception_in_an_actor_is_not_recovered_but_reported():
    state = LoopState()
    sup = Supervisor(None, FaultsConfig(), state)  # no run: no mesh may be touched
    sup.on_respawn("environment")
    error = RemoteCallError("environment.score[0] failed: ValueError: bad", "environment.score[0]")
    with pytest.raises(RemoteCallError, match="ValueError: bad"):
        sup.recover("environment", error)
    assert state.recoveries == []


@pytest.mark.unit
def test_fault_drill_keys_are_checked():
    with pytest.raises(ConfigError, match="faults.kill"):
        load_config(GRPOConfig, None, ["faults.kill=[policy@3]"])
    with pytest.raises(ConfigError, match="the roles are"):
        load_config(GRPOConfig, None, ["faults.kill=[learner:0@3]"])
    with pytest.raises(ConfigError, match="is not role.endpoint@step"):
        load_config(GRPOConfig, None, ["faults.raise_in=[environment:0@3]"])
    with pytest.raises(ConfigError, match="the endpoints are .*environment.score"):
        load_config(GRPOConfig, None, ["faults.raise_in=[environment.reward@3]"])
    with pytest.raises(ConfigError, match="faults.max_nonfinite_steps"):
        load_config(GRPOConfig, None, ["faults.max_nonfinite_steps=0"])
    with pytest.raises(ConfigError, match="'faults.weights': 'skip_pull@3' is not corrupt@step"):
        load_config(GRPOConfig, None, ["faults.weights=[skip_pull@3]"])
