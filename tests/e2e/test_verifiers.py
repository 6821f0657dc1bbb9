"""The verifiers adapter (`task.name=verifiers:...`) on real meshes: GRPO trains on the
taskset defined in the tests (tests/support/vf_taskset.py), each sample's reward its
rubric's."""

import importlib.util

import pytest

from algorithms.grpo import GRPO, GRPOConfig
from meshrl.config import load_config
from tests.conftest import DEFAULT_CONFIG
from tests.support.vf_rubric import NAME, read_jsonl, rubric

# The `verifiers` extra (in dev), looked for without importing it: collecting this file
# costs each pytest worker nothing.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("verifiers") is None, reason="needs the verifiers extra"
)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_grpo_trains_on_a_verifiers_taskset(tmp_path, no_stray_procs):
    """A short warm start on the task data's answers, then GRPO: every sample's
    reward is the taskset's rubric of its decoded completion, and not all are 0."""
    cfg = load_config(
        GRPOConfig,
        DEFAULT_CONFIG,
        [
            f"task.name={NAME}",
            "steps=2",
            "prompts_per_step=4",
            "group_size=2",
            "warm_start.steps=30",
            "generation.max_new_tokens=4",
            "eval.every=0",
            f"run.dir={tmp_path}",
            "run.name=run",
            "run.progress=false",
            "run.save_final=false",
            "run.samples_every=1",
        ],
    )
    history = GRPO(cfg).run()
    assert len(history) == 2
    assert all(record.get("episodes/failed", 0) == 0 for record in history)
    samples = read_jsonl(tmp_path / "run" / "samples.jsonl")
    assert len(samples) == 2 * 4 * 2
    for sample in samples:
        assert sample["reward"] == pytest.approx(rubric(sample["prompt"], sample["completion"]))
    assert any(sample["reward"] > 0 for sample in samples)
