"""One script, several placements: colocated policy and trainer, and generation
running ahead of training (`max_staleness`)."""

import pytest

from algorithms.grpo import GRPO, GRPOConfig
from meshrl.config import load_config
from tests.conftest import DEFAULT_CONFIG

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def run(tmp_path, name, *overrides):
    cfg = load_config(
        GRPOConfig,
        DEFAULT_CONFIG,
        [
            "warm_start.steps=2",
            *overrides,
            f"run.dir={tmp_path}",
            f"run.name={name}",
            "run.progress=false",
            "run.save_final=false",
        ],
    )
    algo = GRPO(cfg)
    return algo, algo.run()


def test_colocated_policy_runs_in_the_trainer_procs(tmp_path, no_stray_procs):
    """A replica in each trainer proc. Trainer rank 1 is killed as step 2 begins,
    taking replica 1 with it: the trainer is healed from rank 0, the replicas
    caught up, replica 0's generation kept (and its figures: what the procs that
    lived on recorded is carried into the step), replica 1's generated again."""
    algo, history = run(
        tmp_path,
        "colocated",
        "steps=4",
        "placement.trainer=2",
        "placement.colocate=true",
        "faults.kill=[trainer:1@2]",
        "eval.every=0",  # (the replicas' held-out sampling would add to their figures)
    )
    assert [r["step"] for r in history] == [0, 1, 2, 3]
    assert "policy" not in algo.placement()[0]  # no policy mesh: a replica in each trainer proc
    assert all(r["weights/shm_replicas"] == 2 for r in history)
    assert all(r["weights/staleness"] == 0 for r in history)
    assert all(r["sampling/logprob_abs_diff"] < 1e-4 for r in history)
    assert [r.split(":")[0] for r in algo.state.recoveries] == ["trainer"]
    assert "faults/time_to_heal_s" in history[2]
    assert all(r["samples/dropped"] == 0 for r in history)
    # Every step's replica figures cover its whole batch, the heal's step's too.
    assert all(r["policy/completion_tokens"] == r["tokens/generated"] for r in history)


def test_generation_runs_one_version_ahead_and_every_sample_is_accounted(tmp_path, no_stray_procs):
    _, history = run(tmp_path, "ahead", "steps=6", "placement.policy=2", "max_staleness=1")
    assert [r["step"] for r in history] == list(range(6))
    # Step 0's batch was generated before any update; every later batch while the
    # step before it trained: one version behind.
    assert [r["weights/staleness"] for r in history] == [0, 1, 1, 1, 1, 1]
    assert history[0]["sampling/logprob_abs_diff"] < 1e-4
    assert all(r["sampling/logprob_abs_diff"] > 1e-4 for r in history[1:])  # off-policy now
    for record in history:
        assert record["samples/generated_total"] == (
            record["samples/trained_total"] + record["samples/dropped_total"]
        )


def test_old_logprobs_from_the_trainer_with_a_correction(tmp_path, no_stray_procs):
    """trainer.recompute_old_logprobs=true, float32 on CPU: the trainer's own old
    log-probs equal the sampler's within 1e-5, so a TIS correction weighs every
    token 1 and the first step's ratio is 1 (nothing clipped)."""
    _, history = run(
        tmp_path,
        "recompute",
        "steps=2",
        "trainer.recompute_old_logprobs=true",
        "trainer.correction=tis",
    )
    for record in history:
        assert record["sampling/sampler_logprob_max_abs_diff"] < 1e-5
        assert record["sampling/ess"] == pytest.approx(1.0, abs=1e-6)
        assert record["sampling/truncated_fraction"] == record["sampling/masked_fraction"] == 0
        assert record["sampling/logprob_abs_diff"] < 1e-5  # trainer vs its own old log-probs
        assert record["policy/clip_fraction"] == 0
        assert record["time/old_logprobs_s"] > 0
