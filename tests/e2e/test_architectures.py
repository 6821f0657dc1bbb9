"""The architecture matrix: GRPO on a tiny model of each mainstream HF family
(`model.arch`), checked end to end: verified weight sync, the sampler's
log-probs against the trainer's, the HF export against the trainer's weights,
exact resume, and the export loaded back by path."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from algorithms.grpo import GRPO, GRPOConfig
from meshrl.config import ModelConfig, load_config
from meshrl.model.architectures import ARCHITECTURES
from meshrl.model.models import load_model
from tests.conftest import DEFAULT_CONFIG
from tests.support.runs import LOOK_BACK

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

FAMILY = {  # the HF class each exports as
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}


def run(tmp_path, name, *overrides):
    cfg = load_config(
        GRPOConfig,
        DEFAULT_CONFIG,
        [
            "steps=3",
            "warm_start.steps=0",
            "eval.every=0",
            "trainer.recompute_old_logprobs=true",  # the sampler/trainer gap is logged
            "checkpoint.every=1",
            "checkpoint.keep=3",
            *overrides,
            f"run.dir={tmp_path}",
            f"run.name={name}",
            "run.progress=false",
        ],
    )
    GRPO(cfg).run()
    with open(tmp_path / name / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def without_times(row):
    return {
        k: v
        for k, v in row.items()
        if not k.startswith(("time/", "timing/")) and k not in LOOK_BACK
    }


def test_every_listed_architecture_is_in_the_matrix():
    assert set(FAMILY) == set(ARCHITECTURES)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_grpo_on_each_architecture_syncs_exports_and_resumes_exactly(arch, tmp_path):
    # MoE: the sampler's routes ride in every batch and the trainer replays them
    # (tests/unit/test_routing.py measures the mismatch replay removes).
    moe = ["trainer.routing_replay=true"] if arch == "qwen3_moe" else []
    rows = run(tmp_path, "straight", f"model.arch={arch}", *moe)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows:
        # Every replica's parameters matched the trainer's checksums: bitwise equal.
        assert row["weights/verified_replicas"] == 1, row
        assert row["sampling/sampler_logprob_max_abs_diff"] < 1e-4, row
        if moe:
            assert row["routing/tokens"] > 0 and row["routing/ran_mismatch"] == 0, row

    # final/ is an HF directory of the family's own class, equal to the trainer's
    # last state, key for key, and giving the same logits.
    final = tmp_path / "straight" / "final"
    exported = AutoModelForCausalLM.from_pretrained(final).eval()
    assert type(exported).__name__ == FAMILY[arch]
    trainer_state = torch.load(
        tmp_path / "straight" / "checkpoints" / "step_00000003" / "trainer.pt", weights_only=False
    )["model"]
    trainer_model = load_model(ModelConfig(arch=arch)).eval()
    trainer_model.load_state_dict(trainer_state, strict=True)
    # (transformers writes a family's own checkpoint layout, e.g. one tensor per MoE
    # expert, and loads it back into its fused modules: compare what loads.)
    loaded = exported.state_dict()
    assert loaded.keys() == trainer_state.keys()
    for key, tensor in loaded.items():
        assert torch.equal(tensor, trainer_state[key]), key
    saved = load_file(final / "model.safetensors")
    ids = torch.tensor([[1, 20, 21, 22, 30, 40, 50, 60, 70, 80, 90, 25]])
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, trainer_model(ids).logits)

    # Resumed from (a copy of) the step-2 checkpoint: the same last step and weights.
    name = "step_00000002"
    shutil.copytree(
        tmp_path / "straight" / "checkpoints" / name, tmp_path / "resumed" / "checkpoints" / name
    )
    resumed = run(tmp_path, "resumed", f"model.arch={arch}", "checkpoint.resume=auto", *moe)
    assert without_times(resumed[-1]) == without_times(rows[-1])
    again = load_file(tmp_path / "resumed" / "final" / "model.safetensors")
    assert again.keys() == saved.keys()
    assert all(torch.equal(again[k], saved[k]) for k in saved)

    # The export loaded by path (model.path) on every role trains on.
    by_path = run(tmp_path, "by_path", f"model.path={final}", "steps=1", "checkpoint.every=0")
    assert by_path[0]["weights/verified_replicas"] == 1
    assert by_path[0]["sampling/sampler_logprob_max_abs_diff"] < 1e-4
    assert os.path.isfile(tmp_path / "by_path" / "final" / "model.safetensors")
