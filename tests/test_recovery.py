"""In-job recovery: procs killed by the `faults:` drill are replaced and the run
finishes every step."""

import pytest

from algorithms.grpo import GRPO, GRPOConfig
from meshrl.config import ConfigError, load_config
from tests.conftest import DEFAULT_CONFIG


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_killed_environment_and_policy_procs_are_replaced(tmp_path, no_stray_procs):
    cfg = load_config(
        GRPOConfig,
        DEFAULT_CONFIG,
        [
            "steps=6",
            "warm_start.steps=2",
            "placement.policy=2",
            "placement.environment=2",
            "faults.kill=[environment:1@2,policy:0@4]",
            f"run.dir={tmp_path}",
            "run.name=drill",
            "run.progress=false",
            "run.save_final=false",
        ],
    )
    algo = GRPO(cfg)
    history = algo.run()
    assert [r["step"] for r in history] == list(range(6))  # every step completed
    assert [r["faults/recoveries"] for r in history] == [0, 0, 1, 1, 2, 2]
    batch = cfg.prompts_per_step * cfg.group_size
    # A lost scoring is redone on the same completions; a lost generation is redone
    # and its samples counted as dropped.
    assert [r["samples/dropped"] for r in history] == [0, 0, 0, 0, batch, 0]
    assert [r.split(":")[0] for r in algo.recoveries] == ["environment", "policy"]
    # The replaced replicas serve the trainer's current version.
    assert all(r["weights/generated_with"] == r["weights/version"] - 1 for r in history)


def test_fault_drill_keys_are_checked():
    with pytest.raises(ConfigError, match="faults.kill"):
        load_config(GRPOConfig, None, ["faults.kill=[policy@3]"])
    with pytest.raises(ConfigError, match="in-job recovery covers"):
        load_config(GRPOConfig, None, ["faults.kill=[trainer:0@3]"])
