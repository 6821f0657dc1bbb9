"""In-job recovery: procs killed by the `faults:` drill are replaced and the run
finishes every step."""

import json

import pytest
from safetensors.torch import load_file

from algorithms.grpo import GRPO, GRPOConfig
from meshrl.config import ConfigError, load_config
from meshrl.mesh import RemoteCallError
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
    assert [r["samples/dropped_policy_lost"] for r in history] == [0, 0, 0, 0, batch, 0]
    assert [r.split(":")[0] for r in algo.recoveries] == ["environment", "policy"]
    # The replaced replicas serve the trainer's current version.
    assert all(r["weights/generated_with"] == r["weights/version"] - 1 for r in history)


def test_an_exception_in_an_actor_is_not_recovered_but_reported():
    algo = GRPO(load_config(GRPOConfig, None, []))
    error = RemoteCallError("environment.score[0] failed: ValueError: bad", "environment.score[0]")
    with pytest.raises(RemoteCallError, match="ValueError: bad"):
        algo.recover("environment", error)  # no mesh is touched: it would raise otherwise
    assert algo.recoveries == []


def test_fault_drill_keys_are_checked():
    with pytest.raises(ConfigError, match="faults.kill"):
        load_config(GRPOConfig, None, ["faults.kill=[policy@3]"])
    with pytest.raises(ConfigError, match="in-job recovery covers"):
        load_config(GRPOConfig, None, ["faults.kill=[reference:0@3]"])


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_killed_trainer_goes_back_to_the_checkpoint_and_ends_as_if_unharmed(
    tmp_path, no_stray_procs
):
    def config(name, *extra):
        return load_config(
            GRPOConfig,
            DEFAULT_CONFIG,
            [
                "steps=6",
                "warm_start.steps=2",
                "checkpoint.every=2",
                f"run.dir={tmp_path}",
                f"run.name={name}",
                "run.progress=false",
                *extra,
            ],
        )

    GRPO(config("straight")).run()
    algo = GRPO(config("drill", "faults.kill=[trainer:0@5]"))
    history = algo.run()
    assert [r["step"] for r in history] == list(range(6))
    assert [r.split(":")[0] for r in algo.recoveries] == ["trainer"]
    # Back to the checkpoint after 4 steps: step 4's training and step 5's samples were lost.
    batch = 16 * 8
    assert (
        history[4]["samples/dropped"] == history[4]["samples/dropped_trainer_rewind"] == 2 * batch
    )
    assert history[5]["faults/recoveries"] == 1

    straight = load_file(str(tmp_path / "straight" / "final" / "model.safetensors"))
    drill = load_file(str(tmp_path / "drill" / "final" / "model.safetensors"))
    assert all((straight[k] == drill[k]).all() for k in straight), "parameters differ"
    with open(tmp_path / "straight" / "metrics.jsonl") as f:
        expected = [json.loads(line) for line in f]
    plain = ("time/", "samples/", "faults/")
    for got, want in zip(history, expected, strict=True):
        assert {k: v for k, v in got.items() if not k.startswith(plain)} == {
            k: v for k, v in want.items() if not k.startswith(plain)
        }
