"""SFT on real meshes: a conversation dataset trained on a model loaded by path whose
held-out NLL falls, then a GRPO run and an SFT run started from its final model and
from its checkpoint."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from algorithms.commands import main as cli_main
from algorithms.grpo import GRPO, GRPOConfig
from algorithms.sft import SFT, SFTConfig
from meshrl.config import ModelConfig, load_config
from meshrl.loop.export import model_source
from meshrl.model.models import load_model
from tests.conftest import DEFAULT_CONFIG
from tests.support.runs import QUIET, undocumented_metrics
from tests.support.sft import CONFIG, chat_tokenizer


def chat_model(path) -> str:
    """The embedded tiny Llama and the chat tokenizer, saved by `save_pretrained`."""
    load_model(ModelConfig()).save_pretrained(path)
    chat_tokenizer().save_pretrained(path)
    return str(path)


def reversal_conversations(path, count: int = 300) -> str:
    """Two-turn conversations: reverse the digits, then reverse them again."""
    rows = []
    for i in range(count):
        digits = f"{(i * 37) % 1000:03d}"
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"{digits}>"},
                    {"role": "assistant", "content": digits[::-1]},
                    {"role": "user", "content": "again>"},
                    {"role": "assistant", "content": digits},
                ]
            }
        )
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_sft_on_conversations_then_grpo_and_sft_from_its_output(tmp_path, no_stray_procs):
    model = chat_model(tmp_path / "model")
    cfg = load_config(
        SFTConfig,
        CONFIG,
        [
            f"model.path={model}",
            f"data.path={reversal_conversations(tmp_path / 'chats.jsonl')}",
            "steps=40",
            "eval.every=20",
            "placement.trainer=2",
            "checkpoint.every=20",
            f"run.dir={tmp_path}",
            "run.name=sft",
            *QUIET,
            "run.save_final=true",
        ],
    )
    records = SFT(cfg).run()
    assert [r["step"] for r in records] == list(range(40))
    assert not undocumented_metrics(records, "algorithms/sft.md")
    before = records[0]["eval/nll_before"]
    evals = [r["eval/nll"] for r in records if "eval/nll" in r]
    assert len(evals) == 2 and evals[-1] < 0.5 * before, (before, evals)
    # Only the assistant's tokens count: 2 turns of 3 digits + EOS + "|" a row.
    assert all(r["tokens/trained"] == 32 * 2 * 5 for r in records)

    # GRPO starts from the SFT run's directory: its final model, loaded by path.
    run_dir = tmp_path / "sft"
    final = load_file(run_dir / "final" / "model.safetensors")
    grpo_cfg = load_config(
        GRPOConfig,
        DEFAULT_CONFIG,
        [
            f"model.path={run_dir}",
            "warm_start.steps=0",
            f"run.dir={tmp_path}",
            "run.name=grpo",
            *QUIET,
        ],
    )
    grpo = GRPO(grpo_cfg)
    try:
        grpo.run(0)  # the meshes up, version 0 on every replica, no step
        (weights,) = [w for w in grpo.sup.call_all(grpo.trainer, "parameters") if w]
        assert weights.keys() == final.keys()
        assert all(torch.equal(weights[name], final[name]) for name in final)
        assert grpo.step()["reward/mean"] > 0.3  # the SFT model answers (measured: 0.48)
    finally:
        grpo.close()

    # `meshrl eval` on the SFT run: the sections it needs of another algorithm's config.
    code = cli_main(
        [
            "eval",
            str(run_dir),
            "--config",
            DEFAULT_CONFIG,
            "eval.sets.heldout.prompts=8",
            "eval.sets.heldout.k=2",
            f"run.dir={tmp_path}",
            "run.name=evaluated",
        ]
    )
    assert code == 0
    with open(tmp_path / "evaluated" / "eval.json") as f:
        figures = json.load(f)
    assert figures["model"] == str(run_dir / "final") and figures["eval/heldout/reward"] > 0.2
    assert 0 <= figures["eval/heldout/pass@1"] <= figures["eval/heldout/pass@2"] <= 1

    # A checkpoint exports once to an HF directory beside it: the step-20 weights.
    checkpoint = run_dir / "checkpoints" / "step_00000020"
    hf = model_source(str(checkpoint))
    assert hf == str(checkpoint / "hf") and model_source(hf) == hf
    saved = torch.load(checkpoint / "trainer.pt", weights_only=False)["model"]
    exported = load_file(os.path.join(hf, "model.safetensors"))
    assert all(torch.equal(saved[name], exported[name]) for name in exported)
