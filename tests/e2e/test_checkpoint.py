"""Checkpoints: a resumed run ends bitwise equal to an uninterrupted one."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from algorithms.grpo import GRPO, GRPOConfig
from algorithms.ppo import PPO, PPOConfig
from meshrl.config import load_config
from meshrl.loop import checkpoint, export
from tests.conftest import REPO
from tests.support.runs import LOOK_BACK, StopAt


class StopAtStep(StopAt, GRPO):
    """Simulates a run killed after `stop_at` steps (its checkpoint is written)."""

    stop_at = 3


class PPOStopAtStep(StopAt, PPO):
    stop_at = 2


class Counting:
    """Mixed in before an algorithm: counts the steps this session ran (a resumed
    run must not redo any)."""

    steps_run = 0

    def after_step(self, step, metrics):
        type(self).steps_run += 1
        super().after_step(step, metrics)


class CountingGRPO(Counting, GRPO):
    pass


class CountingPPO(Counting, PPO):
    pass


def configure(schema, config, tmp_path, name, *overrides):
    return load_config(
        schema,
        os.path.join(REPO, "algorithms", "configs", config),
        [
            f"run.dir={tmp_path}",
            f"run.name={name}",
            "run.progress=false",
            "warm_start.steps=2",
            *overrides,
        ],
    )


def grpo_case(*overrides, config="grpo_default.yaml"):
    """A GRPO case of `test_resumed_run_equals_uninterrupted_run`: 6 steps, the
    interrupted run stopped after step 3's checkpoint."""
    return (CountingGRPO, StopAtStep, GRPOConfig, config, ["steps=6", *overrides], 3)


def metrics(path):
    with open(path) as f:
        records = [json.loads(line) for line in f]
    return [
        {k: v for k, v in r.items() if not k.startswith("time/") and k not in LOOK_BACK}
        for r in records
    ]


@pytest.mark.e2e
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "algorithm, interrupted, schema, config, overrides, stop",
    [
        # With a reference, and generation one version ahead: the batch under way
        # at the checkpoint is saved and trained on after the resume.
        grpo_case("kl_coef=0.01", "max_staleness=1"),
        (CountingPPO, PPOStopAtStep, PPOConfig, "ppo.yaml", ["steps=4", "prompts_per_step=16"], 2),
        grpo_case("placement.trainer=2", "placement.sharding=fsdp"),
        # Tensor parallelism in the trainer (DCP shards of column and row blocks,
        # exported whole) and in the policy replica (a leader and a follower, each
        # pulling its parts of the weights).
        grpo_case("placement.trainer=2", "placement.sharding=tp", "placement.policy_tp=2"),
        # Pipeline stages in the trainer (each stage's DCP shards, the optimizer's
        # state flattened per parameter), exported whole.
        grpo_case("placement.trainer=2", "placement.sharding=pp"),
        # Images in every batch (the tiny LLaVA), with a reference: the resumed
        # batches carry their pixels and the final weights are the same bits.
        grpo_case(
            "kl_coef=0.01", "max_staleness=1", "warm_start.steps=2", config="grpo_vision.yaml"
        ),
    ],
    ids=[
        "grpo_reference_one_version_ahead",
        "ppo_with_critic",
        "grpo_fsdp_sharded",
        "grpo_tp_sharded",
        "grpo_pp_sharded",
        "grpo_vision",
    ],
)
def test_resumed_run_equals_uninterrupted_run(
    algorithm, interrupted, schema, config, overrides, stop, tmp_path, no_stray_procs
):
    every = [f"checkpoint.every={stop}", "checkpoint.keep=1"]
    algorithm(configure(schema, config, tmp_path, "straight", *overrides, *every)).run()
    # Generation one version ahead, 10x slower in the cut run: a step is still
    # recorded with what the generation sent ahead of it records (not only when that
    # generation happens to end before the step's report).
    if "max_staleness=1" in overrides and "vision" not in config:
        every.append("faults.slow=[policy:0x10@1]")

    with pytest.raises(KeyboardInterrupt):
        interrupted(configure(schema, config, tmp_path, "cut", *overrides, *every)).run()
    assert checkpoint.step_of(checkpoint.latest(str(tmp_path / "cut"))) == stop

    resumed = configure(
        schema, config, tmp_path, "cut", *overrides, *every, "checkpoint.resume=auto"
    )
    algorithm(resumed).run()

    straight = load_file(str(tmp_path / "straight" / "final" / "model.safetensors"))
    cut = load_file(str(tmp_path / "cut" / "final" / "model.safetensors"))
    assert straight.keys() == cut.keys()
    assert all((straight[k] == cut[k]).all() for k in straight), "parameters differ"
    assert metrics(tmp_path / "cut" / "metrics.jsonl") == metrics(
        tmp_path / "straight" / "metrics.jsonl"
    )
    if "placement.policy_tp=2" in overrides:
        # The replica's parts in place: it samples what the trainer scores (a part in
        # the wrong place would move the log-probs by far more).
        diffs = [
            r["sampling/logprob_abs_diff"] for r in metrics(tmp_path / "cut" / "metrics.jsonl")
        ]
        assert len(diffs) == 6 and max(diffs) < 1e-4, diffs

    # `meshrl export RUN_DIR OUT`: its newest checkpoint (the last step's; FSDP
    # shards gathered in this process) as an HF directory, equal to the final model.
    assert export.main([str(tmp_path / "straight"), str(tmp_path / "exported")]) == 0
    auto = AutoModelForImageTextToText if "vision" in config else AutoModelForCausalLM
    exported = auto.from_pretrained(tmp_path / "exported").state_dict()
    final = auto.from_pretrained(tmp_path / "straight" / "final").state_dict()
    assert exported.keys() == final.keys() and len(final) >= len(straight)
    assert all(torch.equal(t, final[k]) for k, t in exported.items())
