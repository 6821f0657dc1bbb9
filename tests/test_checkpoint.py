"""Checkpoints: atomic, the last K kept, and a resumed run that ends bitwise
equal to an uninterrupted one."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from algorithms.grpo import GRPO, GRPOConfig
from algorithms.ppo import PPO, PPOConfig
from meshrl.config import ConfigError, load_config
from meshrl.loop import checkpoint, export
from tests.conftest import REPO


@pytest.mark.unit
def test_commit_is_atomic_and_keeps_the_last_k(tmp_path):
    run = str(tmp_path)
    for step in (2, 4, 6):
        partial = checkpoint.begin(run, step)
        (tmp_path / "checkpoints" / os.path.basename(partial) / "trainer.pt").write_text("x")
        checkpoint.commit(partial, keep=2)
    assert [checkpoint.step_of(p) for p in checkpoint.complete(checkpoint.root(run))] == [4, 6]
    # A crash while writing step 8: its partial directory is never taken as a checkpoint.
    checkpoint.begin(run, 8)
    assert checkpoint.step_of(checkpoint.latest(run)) == 6
    assert checkpoint.latest(str(tmp_path / "none")) is None
    with pytest.raises(ConfigError, match="checkpoint.resume"):
        load_config(GRPOConfig, None, [f"checkpoint.resume={tmp_path}/checkpoints/step_00000008"])


class StopAtStep(GRPO):
    """Simulates a run killed after `stop_at` steps (its checkpoint is written)."""

    stop_at = 3

    def after_step(self, step, metrics):
        if step == self.stop_at:
            raise KeyboardInterrupt
        super().after_step(step, metrics)


class PPOStopAtStep(PPO):
    stop_at = 2

    def after_step(self, step, metrics):
        if step == self.stop_at:
            raise KeyboardInterrupt
        super().after_step(step, metrics)


class CountingGRPO(GRPO):
    """Counts the steps this session ran (a resumed run must not redo any)."""

    steps_run = 0

    def after_step(self, step, metrics):
        type(self).steps_run += 1
        super().after_step(step, metrics)


class CountingPPO(PPO):
    steps_run = 0

    def after_step(self, step, metrics):
        type(self).steps_run += 1
        super().after_step(step, metrics)


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


@pytest.mark.unit
def test_export_names_what_is_missing_in_one_line(tmp_path, capsys):
    assert export.main([str(tmp_path), str(tmp_path / "out")]) == 1
    assert "neither a run directory nor a checkpoint" in capsys.readouterr().err
    (tmp_path / "config.yaml").write_text("steps: 3\n")
    assert export.main([str(tmp_path), str(tmp_path / "out")]) == 1
    assert "has no complete checkpoint (set checkpoint.every" in capsys.readouterr().err
    # A run without checkpoints whose final model is saved: that is the HF directory.
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "config.json").write_text("{}")
    assert export.main([str(tmp_path), str(tmp_path / "out")]) == 1
    assert f"already an HF directory: {tmp_path / 'final'}" in capsys.readouterr().err
    assert export.main([str(tmp_path)]) == 2
    assert not (tmp_path / "out").exists()


def metrics(path):
    with open(path) as f:
        records = [json.loads(line) for line in f]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in records]


@pytest.mark.e2e
@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "algorithm, interrupted, schema, config, overrides, stop",
    [
        # With a reference, and generation one version ahead: the batch under way
        # at the checkpoint is saved and trained on after the resume.
        (
            CountingGRPO,
            StopAtStep,
            GRPOConfig,
            "grpo_default.yaml",
            ["steps=6", "kl_coef=0.01", "max_staleness=1"],
            3,
        ),
        (CountingPPO, PPOStopAtStep, PPOConfig, "ppo.yaml", ["steps=4", "prompts_per_step=16"], 2),
        (
            CountingGRPO,
            StopAtStep,
            GRPOConfig,
            "grpo_default.yaml",
            ["steps=6", "placement.trainer=2", "placement.sharding=fsdp"],
            3,
        ),
        # Images in every batch (the tiny LLaVA), with a reference: the resumed
        # batches carry their pixels and the final weights are the same bits.
        (
            CountingGRPO,
            StopAtStep,
            GRPOConfig,
            "grpo_vision.yaml",
            ["steps=6", "kl_coef=0.01", "max_staleness=1", "warm_start.steps=2"],
            3,
        ),
    ],
    ids=["grpo_reference_one_version_ahead", "ppo_with_critic", "grpo_fsdp_sharded", "grpo_vision"],
)
def test_resumed_run_equals_uninterrupted_run(
    algorithm, interrupted, schema, config, overrides, stop, tmp_path, no_stray_procs
):
    every = [f"checkpoint.every={stop}", "checkpoint.keep=1"]
    algorithm(configure(schema, config, tmp_path, "straight", *overrides, *every)).run()

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

    # `meshrl export RUN_DIR OUT`: its newest checkpoint (the last step's; FSDP
    # shards gathered in this process) as an HF directory, equal to the final model.
    assert export.main([str(tmp_path / "straight"), str(tmp_path / "exported")]) == 0
    auto = AutoModelForImageTextToText if "vision" in config else AutoModelForCausalLM
    exported = auto.from_pretrained(tmp_path / "exported").state_dict()
    final = auto.from_pretrained(tmp_path / "straight" / "final").state_dict()
    assert exported.keys() == final.keys() and len(final) >= len(straight)
    assert all(torch.equal(t, final[k]) for k, t in exported.items())
