"""The controller on real runs: the defects the old all-in-one base class had (each
test here failed on it)."""

import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from algorithms.dpo import DPO, DPOConfig
from algorithms.grpo import GRPO
from meshrl.procs.mesh import RemoteCallError
from tests.conftest import REPO
from tests.support.runs import LOOK_BACK, configure

# --- e2e: the defects --------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_refill_after_a_rewind_keeps_the_rewind_count(tmp_path, no_stray_procs):
    """The trainer dies at step 3 and the run goes back to step 2, whose second
    try has a failed reward: its record counts both the rewind and the refill."""
    cfg = configure(
        tmp_path,
        "rewind",
        "steps=4",
        "warm_start.steps=0",
        "checkpoint.every=2",
        "faults.kill=[trainer:0@3]",
        "task.name=tests.support.envs:FailsAtCall520",
        "run.save_final=false",
    )
    algo = GRPO(cfg)
    history = algo.run()
    batch = cfg.prompts_per_step * cfg.group_size
    assert [r["step"] for r in history] == [0, 1, 2, 3]
    assert history[2]["samples/dropped_trainer_rewind"] == 2 * batch
    assert history[2]["samples/dropped_env_failed"] == cfg.group_size
    assert history[2]["samples/dropped"] == 2 * batch + cfg.group_size
    for record in history:
        assert record["samples/generated_total"] == (
            record["samples/trained_total"] + record["samples/dropped_total"]
        )
    assert history[-1]["samples/trained_total"] == 4 * batch


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_generation_ahead_with_a_failing_reward_trains_on(tmp_path, no_stray_procs):
    """With max_staleness=1 the refill's completions come from a newer version than
    the batch's (a mixed batch); the step trains on them."""
    cfg = configure(
        tmp_path,
        "ahead",
        "steps=3",
        "warm_start.steps=0",
        "max_staleness=1",
        "task.name=tests.support.envs:FailsAtCall130",
        "run.save_final=false",
    )
    history = GRPO(cfg).run()
    assert [r["step"] for r in history] == [0, 1, 2]
    assert history[1]["samples/dropped_env_failed"] == cfg.group_size
    assert history[1]["samples/trained"] == cfg.prompts_per_step * cfg.group_size
    assert all(
        r["samples/generated_total"] == r["samples/trained_total"] + r["samples/dropped_total"]
        for r in history
    )


class InterruptedDPO(DPO):
    """Ctrl-C during step 1, as a user would press it: the run stops after the step."""

    def after_step(self, step, metrics):
        super().after_step(step, metrics)
        if step == 1:
            os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_dpo_resumes_exactly_and_a_second_run_is_not_stopped_by_the_first(tmp_path, no_stray_procs):
    path = os.path.join(REPO, "algorithms", "configs", "dpo.yaml")
    # A retried error at step 0: the resumed run must go on counting it (a counter
    # that is not in the checkpoint would start again from 0 and the records differ).
    keys = ["steps=5", "eval.every=2", "warm_start.steps=2", "checkpoint.every=4"]
    keys += ["faults.retry_errors=1", "faults.raise_in=[trainer.train_step@0]"]
    DPO(configure(tmp_path, "straight", *keys, schema=DPOConfig, path=path)).run()

    with pytest.raises(KeyboardInterrupt, match="stopped after 2 steps"):
        InterruptedDPO(configure(tmp_path, "cut", *keys, schema=DPOConfig, path=path)).run()
    # Ctrl-C asked for a stop: a checkpoint after the step, although not due.
    assert os.path.isdir(tmp_path / "cut" / "checkpoints" / "step_00000002")
    # The next run in this process is not stopped by the first one's Ctrl-C.
    DPO(
        configure(tmp_path, "cut", *keys, "checkpoint.resume=auto", schema=DPOConfig, path=path)
    ).run()

    straight = load_file(str(tmp_path / "straight" / "final" / "model.safetensors"))
    cut = load_file(str(tmp_path / "cut" / "final" / "model.safetensors"))
    assert all(torch.equal(straight[k], cut[k]) for k in straight), "parameters differ"

    def records(name):
        import json

        with open(tmp_path / name / "metrics.jsonl") as f:
            return [
                {
                    k: v
                    for k, v in json.loads(line).items()
                    if not k.startswith("time/") and k not in LOOK_BACK
                }
                for line in f
            ]

    assert records("cut") == records("straight")
    assert records("cut")[-1]["faults/errors_retried"] == 1


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_in_a_notebook_an_actor_error_keeps_the_meshes_and_the_next_step_goes_on(
    tmp_path, no_stray_procs
):
    """The trainer's step raises (a drill, no retry) during `train(3)`: the error
    reaches the cell, the meshes stay up, and `step()` goes on from that step; the
    samples of the broken step are counted as dropped."""
    algo = GRPO(
        configure(
            tmp_path,
            "run",
            "steps=5",
            "warm_start.steps=0",
            "run.save_final=false",
            "faults.retry_errors=0",
            "faults.raise_in=[trainer.train_step@1]",
        )
    )
    try:
        algo.train(1)
        pids = {p["pid"] for p in algo.mesh_status(show=False)}
        with pytest.raises(RemoteCallError, match=r"trainer\.train_step"):
            algo.train(3)
        assert algo.runtime is not None and algo.state.step == 1
        record = algo.step()
        assert record["step"] == 1 and {p["pid"] for p in algo.mesh_status(show=False)} == pids
        assert (
            record["samples/dropped_step_error"] == algo.cfg.prompts_per_step * algo.cfg.group_size
        )
        assert record["samples/generated_total"] == (
            record["samples/trained_total"] + record["samples/dropped_total"]
        )
    finally:
        algo.stop()
    assert algo.runtime is None
