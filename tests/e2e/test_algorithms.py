"""Every shipped algorithm end to end on real meshes: each runs from Python with more
procs per role, and a one-hook GRPO subclass is used. (That each learns its task from
its shipped config: tests/learning/test_algorithms.py.)"""

import math
import os

import pytest
import torch

from algorithms.dapo import DAPO, DAPOConfig
from algorithms.dpo import DPO, DPOConfig
from algorithms.grpo import GRPO, GRPOConfig
from algorithms.ppo import PPO, PPOConfig
from algorithms.reinforce_pp import ReinforcePP, ReinforcePPConfig
from algorithms.rloo import RLOO
from meshrl.config import load_config
from tests.conftest import REPO
from tests.support.runs import CONFIGS, QUIET, undocumented_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]


# From Python, with more procs per role than the CLI runs use.
CALCULATOR = [
    "task.name=calculator",
    f"task.dataset={REPO}/meshrl/envs/data/calculator.jsonl",
    "task.max_turns=3",
    "model.max_positions=512",
    "generation.max_new_tokens=8",
]
PYTHON_RUNS = [
    (GRPO, GRPOConfig, "gspo", ["placement.trainer=2", "minibatches=2"]),
    # With a held-out set evaluated every step: 6 prompts x 3 samples over 2 replicas.
    (
        RLOO,
        GRPOConfig,
        "rloo",
        [
            "placement.policy=2",
            "eval.every=1",
            "eval.sets.heldout.prompts=6",
            "eval.sets.heldout.k=3",
        ],
    ),
    # A bf16-mixed trainer publishing bf16 to its replicas and fp32 to the reference.
    (
        ReinforcePP,
        ReinforcePPConfig,
        "reinforce_pp",
        ["placement.reference=2", "trainer.precision=bf16-mixed", "policy.precision=bf16"],
    ),
    # With the held-out set on an eval mesh of its own, every step; fp8 replicas split
    # with tensor parallelism (each a leader and a follower).
    (
        DAPO,
        DAPOConfig,
        "dapo",
        [
            "placement.environment=2",
            "policy.precision=fp8",
            "placement.policy_tp=2",
            "eval.every=1",
            "eval.mesh=true",
            "eval.sets.heldout.prompts=4",
            "eval.sets.heldout.k=2",
        ],
    ),
    # PPO on the multi-turn calculator: GAE over the model's tokens, the tool's masked;
    # a held-out set of whole episodes evaluated after the last step.
    (
        PPO,
        PPOConfig,
        "ppo",
        [
            "placement.critic=2",
            "placement.trainer=2",
            *CALCULATOR,
            "eval.every=3",
            "eval.sets.tools.prompts=4",
            "eval.sets.tools.k=2",
        ],
    ),
    # 3 reference procs for 64 rows: blocks of 22, 21, 21.
    (
        DPO,
        DPOConfig,
        "dpo",
        [
            "placement.trainer=2",
            "placement.reference=3",
            "eval.every=2",
            "warm_start.steps=1",
            "trainer.precision=bf16-mixed",  # and no replicas: fp32 for the reference only
        ],
    ),
]


@pytest.mark.parametrize(
    "cls, schema, config, overrides", PYTHON_RUNS, ids=[run[2] for run in PYTHON_RUNS]
)
def test_algorithm_runs_from_python(cls, schema, config, overrides, tmp_path, no_stray_procs):
    cfg = load_config(
        schema,
        os.path.join(CONFIGS, f"{config}.yaml"),
        ["steps=3", f"run.dir={tmp_path}", "run.name=py", *QUIET, *overrides]
        + ([] if cls is DPO else ["warm_start.steps=1"]),
    )
    history = cls(cfg).run()
    assert [r["step"] for r in history] == [0, 1, 2]
    page = "algorithms/dpo.md" if cls is DPO else f"algorithms/{config}.md"
    assert not undocumented_metrics(history, page)
    for record in history:
        assert all(isinstance(v, int | str) or math.isfinite(v) for v in record.values()), record
        if cls is DAPO and record["step"]:  # the eval mesh's figures come a step later
            last = record["step"] == len(history) - 1  # ... but the last step's wait for it
            assert record["eval/step"] == (record["step"] if last else record["step"] - 1)
            assert 0 <= record["eval/heldout/pass@1"] <= record["eval/heldout/pass@2"] <= 1
        if cls is RLOO:  # the held-out set, every step: pass@1 <= pass@3, both in [0, 1]
            assert 0 <= record["eval/heldout/pass@1"] <= record["eval/heldout/pass@3"] <= 1
            assert 0 <= record["eval/heldout/reward"] <= 1
        if cls is PPO and record["step"] == 2:  # the held-out episodes, scored
            assert 0 <= record["eval/tools/pass@1"] <= record["eval/tools/pass@2"] <= 1
        if cls is PPO:  # the replies were in the batch, attended, and the critic trained
            assert record["tokens/environment"] > 0 and record["episodes/turns_mean"] >= 1
            assert record["sampling/logprob_abs_diff"] < 1e-4 and record["value/grad_norm"] > 0


class ZeroAdvantageGRPO(GRPO):
    """The hook a variant overrides: every completion gets advantage 0. Its
    `after_step` adds a key and does not call `super()`: the loop records the step
    all the same (before, the step was never logged and was run again forever)."""

    calls = 0

    def compute_advantages(self, rewards, batch):
        ZeroAdvantageGRPO.calls += 1
        return torch.zeros_like(batch.completion_mask, dtype=torch.float32)

    def after_step(self, step, metrics):
        metrics["variant/step_seen"] = step


def test_a_subclass_overriding_one_hook_is_what_runs(tmp_path, no_stray_procs):
    cfg = load_config(
        GRPOConfig,
        os.path.join(CONFIGS, "grpo_default.yaml"),
        ["steps=4", "warm_start.steps=0", f"run.dir={tmp_path}", *QUIET],
    )
    cfg.run.name = "base"
    base = GRPO(cfg).run()
    cfg.run.name = "zero"
    zero = ZeroAdvantageGRPO(cfg).run()
    assert ZeroAdvantageGRPO.calls == 4
    assert [r["variant/step_seen"] for r in zero] == [0, 1, 2, 3]
    # Zero advantages zero the policy gradient on the trainer procs; GRPO's do not.
    assert all(r["train/grad_norm"] == 0 for r in zero)
    assert all(r["train/grad_norm"] > 0 for r in base)
