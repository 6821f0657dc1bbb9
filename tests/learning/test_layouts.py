"""Every trainer layout learns the default task (`placement.sharding`): the
invariance tests (tests/actors/test_invariance.py) prove each layout's gradient and
steps equal one proc's; these run the whole loop on each, its replicas included
(FSDP2 x TP with tensor-parallel replicas; pipeline stages under 1F1B, with FSDP2
under GPipe, and of tensor-parallel groups interleaved, 2 stages a proc; Qwen3-MoE's
experts spread over 2 procs), and check that the reward
climbs. DDP's run is tests/e2e/test_job.py's, its 2 ranks on hosts of their own."""

import pytest

from tests.support.runs import grpo

pytestmark = [pytest.mark.learning, pytest.mark.timeout(300)]

STEPS = 60


@pytest.mark.parametrize(
    "placement",
    [
        ("placement.trainer=2", "placement.sharding=fsdp"),
        ("placement.trainer=2", "placement.sharding=tp"),
        ("placement.trainer=4", "placement.sharding=fsdp_tp", "placement.policy_tp=2"),
        ("placement.trainer=2", "placement.sharding=pp", "trainer.pp_schedule=1f1b"),
        ("placement.trainer=4", "placement.sharding=fsdp_pp", "trainer.pp_schedule=gpipe"),
        (
            "placement.trainer=4",
            "placement.sharding=fsdp_tp_pp",
            "model.num_layers=4",
            "trainer.pp_schedule=interleaved",
        ),
        ("placement.trainer=2", "placement.ep=2", "model.arch=qwen3_moe"),
    ],
    ids=["fsdp", "tp", "fsdp_tp_and_tp_replica", "pp", "fsdp_pp", "tp_pp", "ep_qwen3_moe"],
)
def test_each_trainer_layout_learns_the_default_task(placement, tmp_path, no_stray_procs):
    """The default config's first 60 steps (measured here on 2026-11-29, means of 10
    steps: 0.10 at the start in every layout, 0.31 over steps 50-59 with TP and
    FSDP2 x TP (and DDP), 0.29 with FSDP2; the curves part only by float rounding, which RL
    amplifies)."""
    _, history = grpo(
        tmp_path,
        "grpo_default.yaml",
        f"steps={STEPS}",
        "prompts_per_step=16",
        "group_size=8",
        "eval.every=0",
        *placement,
    )
    rewards = [record["reward/mean"] for record in history]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    # The 4-layer model (interleaved needs 2 stages a proc) climbs less in 60 steps
    # on any layout: 0.078 -> 0.164 on one proc, 0.076 -> 0.168 on TP2 x PP2
    # (measured here on 2026-12-05).
    climb = 0.06 if "model.num_layers=4" in placement else 0.12
    assert last - first >= climb, (first, last)
