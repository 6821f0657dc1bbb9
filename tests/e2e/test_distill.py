"""On-policy distillation on real meshes: a student learns a teacher loaded by
path, and a teacher that does not share the student's vocabulary is refused."""

import os
import random

import pytest
import torch

from algorithms.distill import Distill, DistillConfig
from meshrl.config import ConfigError, ModelConfig, TaskConfig, load_config
from meshrl.envs import make_task
from meshrl.model.models import load_model
from meshrl.model.tokenizer import build_char_tokenizer
from meshrl.types import TrainBatch
from tests.conftest import REPO
from tests.support.runs import QUIET, undocumented_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CONFIG = os.path.join(REPO, "algorithms", "configs", "distill.yaml")


def save_teacher(path, steps: int = 150, extra_token: str = "") -> str:
    """A tiny Llama taught to reverse 3 digits by supervised steps here, then
    saved by `save_pretrained`: a teacher with a sharp, structured distribution."""
    torch.manual_seed(0)
    model = load_model(ModelConfig(hidden_size=32, num_layers=2, intermediate_size=64), seed=5)
    tokenizer = build_char_tokenizer()
    task, rng = make_task(TaskConfig()), random.Random(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        prompts = task.sample(64, rng)
        texts = [p.text + task.demonstration(p) for p in prompts]
        ids = torch.tensor([tokenizer(t).input_ids + [tokenizer.eos_token_id] for t in texts])
        logits = model(ids[:, :-1]).logits
        answer = slice(len(tokenizer(prompts[0].text).input_ids) - 1, None)  # the answer + EOS
        loss = torch.nn.functional.cross_entropy(
            logits[:, answer].flatten(0, 1), ids[:, 1:][:, answer].flatten()
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    if extra_token:  # a tokenizer of its own, the model sized to it
        tokenizer.add_tokens([extra_token])
        model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def distill_config(tmp_path, teacher: str, *overrides: str) -> DistillConfig:
    return load_config(
        DistillConfig,
        CONFIG,
        [
            f"teacher.path={teacher}",
            "steps=60",
            "warm_start.steps=20",  # the answer format first: the test is short
            "eval.every=30",
            "eval.sets.heldout.prompts=32",
            "placement.teacher=2",
            f"run.dir={tmp_path}",
            "run.name=distill",
            *QUIET,
            *overrides,
        ],
    )


def test_student_reverse_kl_to_a_teacher_falls(tmp_path, no_stray_procs):
    teacher = save_teacher(tmp_path / "teacher")
    records = Distill(distill_config(tmp_path, teacher)).run()
    assert [r["step"] for r in records] == list(range(60))
    assert not undocumented_metrics(records, "algorithms/distill.md")
    before = records[0]["eval/heldout/reverse_kl_before"]
    evals = [r["eval/heldout/reverse_kl"] for r in records if "eval/heldout/reverse_kl" in r]
    assert len(evals) == 2 and before > 1.0, (before, evals)
    assert "eval/heldout/reward_before" in records[0] and "eval/heldout/reward" in records[-1]
    assert evals[-1] < 0.6 * before, (before, evals)  # measured: 6.49 -> 2.47
    # The training figure is the same quantity, on the batch's own samples.
    assert records[-1]["distill/reverse_kl"] < 0.6 * records[0]["distill/reverse_kl"]


def test_a_teacher_with_another_vocabulary_is_refused(tmp_path):
    teacher = save_teacher(tmp_path / "teacher", steps=0, extra_token="<tool>")
    with pytest.raises(ConfigError, match="distillation needs a shared vocabulary"):
        Distill(distill_config(tmp_path, teacher))
    # Its held-out set is the run's `eval:` set now (one evaluation system).
    with pytest.raises(ConfigError, match="'eval_prompts' is now 'eval.sets.<name>.prompts'"):
        distill_config(tmp_path, teacher, "eval_prompts=8")


def test_token_advantages_are_the_teachers_log_ratio_with_a_baseline():
    cfg = load_config(DistillConfig, CONFIG, ["teacher.path=null", "group_size=2"])
    distill = Distill.__new__(Distill)
    distill.cfg = cfg
    batch = TrainBatch(
        torch.zeros(2, 5, dtype=torch.long),
        torch.ones(2, 5),
        torch.tensor([[1.0, 1, 1], [1, 1, 0]]),
        torch.tensor([[-1.0, -2, -3], [-1, -1, -9]]),  # the student's log-probs
    )
    batch.ref_logprobs = torch.tensor([[-1.0, -1, -1], [-3, -1, -5]])
    log_ratio = torch.tensor([[0.0, 1, 2], [-2, 0, 0]])
    cfg.baseline = False
    torch.testing.assert_close(distill.compute_advantages(torch.zeros(2), batch), log_ratio)
    # Minus the mean over the 4 other real tokens (leave-one-out: a token's own value
    # is not in its baseline); padding stays 0.
    cfg.baseline = True
    others = (log_ratio.sum() - log_ratio) / 4
    expected = (log_ratio - others) * batch.completion_mask
    assert expected[0, 0] == -0.25  # 0 - (1 + 2 - 2 + 0) / 4
    torch.testing.assert_close(distill.compute_advantages(torch.zeros(2), batch), expected)
    cfg.reward_weight = 0.5  # + half the group-normalized reward: +-0.5 / std
    rewarded = distill.compute_advantages(torch.tensor([1.0, 0.0]), batch)
    shift = (rewarded - expected)[batch.completion_mask.bool()]
    assert shift[:3].min() > 0 > shift[3:].max() and torch.allclose(shift[:3], shift[0])
