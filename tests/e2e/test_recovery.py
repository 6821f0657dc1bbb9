"""In-job recovery: procs killed by the `faults:` drill are replaced and the run
finishes every step."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from algorithms.base import NonFiniteLoss
from algorithms.grpo import GRPO, GRPOLoss
from algorithms.ppo import PPO, PPOConfig
from meshrl.loop import checkpoint
from meshrl.loop.checkpoint import CheckpointError
from meshrl.procs.mesh import RemoteCallError, call_all
from tests.conftest import REPO
from tests.support.runs import configure, run_grpo


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_killed_environment_and_policy_procs_are_replaced(tmp_path, capfd, caplog, no_stray_procs):
    cfg = configure(
        tmp_path,
        "drill",
        "steps=6",
        "warm_start.steps=2",
        "placement.policy=2",
        "placement.environment=2",
        "faults.kill=[environment:1@2,policy:0@4]",
        "run.save_final=false",
    )
    algo = GRPO(cfg)
    history = algo.run()
    assert [r["step"] for r in history] == list(range(6))  # every step completed
    assert [r["faults/recoveries"] for r in history] == [0, 0, 1, 1, 2, 2]
    batch = cfg.prompts_per_step * cfg.group_size
    # A lost scoring is redone on the same completions; the lost replica's generation
    # (half the step's: 2 replicas) is redone with the same prompts and seeds and the
    # other replica's kept: nothing is dropped, the redone samples are counted.
    assert [r["samples/dropped"] for r in history] == [0] * 6
    half = batch // 2
    assert [r["samples/redone_policy_lost"] for r in history] == [0, 0, 0, 0, half, 0]
    assert history[-1]["samples/generated_total"] == history[-1]["samples/trained_total"]
    assert history[-1]["samples/redone_total"] == half
    assert [r.split(":")[0] for r in algo.state.recoveries] == ["environment", "policy"]
    # The replaced replicas serve the trainer's current version.
    assert all(r["weights/generated_with"] == r["weights/version"] - 1 for r in history)
    # The console: one line per recovery, and the summary counts them; Monarch's
    # failure events are in the run's faults.log, not on the console.
    out = capfd.readouterr().out
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("recovered ")] == [
        "recovered environment",
        "recovered policy",
    ]
    summary = next(line for line in out.splitlines() if line.startswith("grpo: 6 steps"))
    assert (
        f"recoveries: 1 environment, 1 policy | samples redone: {half} ({half} policy_lost)"
        in summary
    )
    assert not [r for r in caplog.records if "mesh failure" in r.getMessage()]
    # Each failure in full: the call that found the proc gone (the pid check is
    # first, in well under Monarch's ~10 s; its supervision event, when it still
    # comes, is written here too as a `mesh failure:` line), then the recovery.
    log = (tmp_path / "drill" / "faults.log").read_text()
    for role in ("environment", "policy"):
        assert f"recovering {role}: " in log and f"recovered {role} in" in log, log


@pytest.mark.e2e
@pytest.mark.timeout(400)
@pytest.mark.parametrize("lost", ["policy_tp", "policy"], ids=["follower", "leader"])
def test_a_tensor_parallel_replica_that_loses_a_proc_is_replaced_whole(
    lost, tmp_path, no_stray_procs
):
    """A policy replica split over 2 procs loses its follower (or its leader) as
    step 2 begins: a lost follower fails the leader's call, and the leader ends
    its proc; the controller replaces the group whole (both procs, a new process
    group), catches it up to the trainer's version, and samples the step again;
    the log-probs it samples stay the trainer's."""
    cfg = configure(
        tmp_path,
        "tp_drill",
        "steps=4",
        "warm_start.steps=2",
        "placement.policy_tp=2",
        f"faults.kill=[{lost}:0@2]",
        "eval.every=0",
        "run.save_final=false",
    )
    algo = GRPO(cfg)
    history = algo.run()
    assert [r["step"] for r in history] == list(range(4))
    assert [r.split(":")[0] for r in algo.state.recoveries] == ["policy"]
    assert history[-1]["faults/recoveries"] == 1
    assert all(r["sampling/logprob_abs_diff"] < 1e-4 for r in history)
    assert all(r["weights/generated_with"] == r["weights/version"] - 1 for r in history)


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_faults_in_every_role_change_nothing(tmp_path, no_stray_procs):
    """GRPO with a reference, 2 policy replicas, 2 environment procs and 2 trainer
    ranks: a proc of each role killed, and an error raised in generation, scoring,
    the reference and a train step, at fixed steps. The run ends with the weights of
    the same run without faults, bit for bit, and logs the same metrics at every step
    but the fault counters, the sample accounting and the timings (issue 43's property).
    The lost trainer rank is healed from its peer: no step is undone, no sample dropped."""

    def config(name, *extra):
        return configure(
            tmp_path,
            name,
            "steps=6",
            "warm_start.steps=2",
            "checkpoint.every=2",
            "kl_coef=0.01",
            "placement.trainer=2",
            "placement.policy=2",
            "placement.environment=2",
            *extra,
        )

    GRPO(config("straight")).run()
    # Trainer rank 0 of 2, the one that publishes: rank 1 heals it, and publishes anew.
    drills = (
        "faults.kill=[environment:1@1,policy:0@2,reference:0@3,trainer:0@5]",
        "faults.raise_in=[policy.generate@1,environment.score@2,reference.logprobs@4,"
        "trainer.train_step@3]",
        "faults.retry_errors=1",
    )
    algo = GRPO(config("drill", *drills))
    history = algo.run()
    assert [r["step"] for r in history] == list(range(6))
    lost = [r.split(":")[0] for r in algo.state.recoveries]
    assert lost == ["environment", "policy", "reference", "trainer"], lost
    # The trainer's new ranks took rank 0's state: nothing went back to a checkpoint.
    assert all(r["samples/dropped"] == 0 for r in history), [r["samples/dropped"] for r in history]
    assert history[5]["faults/time_to_heal_s"] > 0
    assert "faults/time_to_heal_s" not in history[4]
    assert history[2]["samples/redone_policy_lost"] > 0  # the killed replica's groups, redone

    assert_unharmed(tmp_path, history)


def assert_unharmed(tmp_path, history: list[dict]) -> None:
    """The drill run ended with the straight run's parameters, bit for bit, and logged
    its metrics at every step, but the fault counters, sample accounting and timings."""
    straight = load_file(str(tmp_path / "straight" / "final" / "model.safetensors"))
    drill = load_file(str(tmp_path / "drill" / "final" / "model.safetensors"))
    assert all((straight[k] == drill[k]).all() for k in straight), "parameters differ"
    with open(tmp_path / "straight" / "metrics.jsonl") as f:
        expected = [json.loads(line) for line in f]
    plain = ("time/", "samples/", "faults/")
    for got, want in zip(history, expected, strict=True):
        assert {k: v for k, v in got.items() if not k.startswith(plain)} == {
            k: v for k, v in want.items() if not k.startswith(plain)
        }


# --- raised errors, reference and critic recovery, accounting -------------------------


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_ppo_survives_lost_reference_and_critic_and_raised_errors(tmp_path, no_stray_procs):
    """PPO with its reference, a critic and its policy proc killed and every drillable
    endpoint raising once ends where the same run without faults ends (issue 43's property),
    with work by pull and generation one version ahead. The critic's 2 ranks are
    replicas: the lost one is healed from the other."""

    def config(name, *extra):
        return configure(
            tmp_path,
            name,
            "steps=6",
            "prompts_per_step=16",
            "warm_start.steps=2",
            "kl_coef=0.01",
            "checkpoint.every=2",
            "placement.critic=2",
            "rollout.dispatch=pull",
            "max_staleness=1",
            *extra,
            schema=PPOConfig,
            path=os.path.join(REPO, "algorithms", "configs", "ppo.yaml"),
        )

    PPO(config("straight")).run()
    algo = PPO(
        config(
            "drill",
            "faults.retry_errors=1",
            "faults.kill=[reference:0@2,critic:1@3,policy:0@4]",
            "faults.raise_in=[environment.score@0,policy.generate@1,trainer.train_step@1,"
            "reference.logprobs@4,critic.values@5,critic.train_step@5]",
        )
    )
    history = algo.run()
    assert [r["step"] for r in history] == list(range(6))  # every step completed
    # The reference reloads from the checkpoint; the critic's new ranks take rank 0's
    # state, and the step goes on: nothing is undone or dropped.
    assert [r.split(":")[0] for r in algo.state.recoveries] == ["reference", "critic", "policy"]
    assert history[3]["faults/time_to_heal_s"] > 0
    # Every raise was retried once and the step went on; a failed generation is
    # redone, the same samples.
    assert history[-1]["faults/errors_retried"] == 6
    redone = history[1]["samples/redone_policy_lost"]  # the failed call's groups, by pull
    assert redone >= 1
    for record in history:  # every sample is trained on once or dropped with its reason
        assert record["samples/generated_total"] == (
            record["samples/trained_total"] + record["samples/dropped_total"]
        )
    assert history[-1]["samples/trained_total"] == 6 * 16
    assert history[-1]["samples/dropped_total"] == 0  # the redone are not dropped
    assert history[-1]["samples/redone_total"] >= redone  # and the lost replica's groups
    assert_unharmed(tmp_path, history)


@pytest.mark.e2e
def test_a_raising_reward_function_ends_the_run_with_one_line(tmp_path, no_stray_procs):
    run = run_grpo(
        tmp_path, "raises", "steps=3", "warm_start.steps=0", "faults.raise_in=[environment.score@0]"
    )
    assert run.returncode == 1, run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert lines == [
        "error: environment.score[0] failed: "
        "meshrl.procs.faults.InjectedError: faults.raise_in: injected error in score"
    ], run.stderr[-2000:]
    assert "--debug" in run.stderr


@pytest.mark.e2e
def test_debug_flag_shows_the_traceback_of_a_prompt_too_long(tmp_path, no_stray_procs):
    run = run_grpo(
        tmp_path,
        "long",
        "warm_start.steps=0",
        "model.max_positions=8",
        "generation.overlong_prompt=error",
        "--debug",
    )
    assert run.returncode == 1, run.stderr[-2000:]
    assert "Traceback" in run.stderr and "PromptTooLong" in run.stderr
    assert "error: PromptTooLong: a prompt of 5 tokens does not fit the model's context of 8" in (
        run.stderr
    )


# --- NaN losses --------------------------------------------------------------------------


class NaNOnRankOneLoss(GRPOLoss):
    """Trainer rank 1 only sees a NaN loss at the steps in `nan_at` (counted per
    trainer proc): the ranks must still agree to skip."""

    nan_at = (2, 4, 5, 6)
    calls = 0

    def __call__(self, logprobs, batch):
        loss, metrics = super().__call__(logprobs, batch)
        step, type(self).calls = type(self).calls, type(self).calls + 1
        if step in self.nan_at and torch.distributed.get_rank() == 1:
            loss = loss * float("nan")
        return loss, metrics


class NaNOnRankOne(GRPO):
    Loss = NaNOnRankOneLoss
    params: list = []

    def after_step(self, step, metrics):
        if step in (1, 2, 3):
            per_rank = call_all(self.trainer, "parameters", what="parameters", timeout_s=60)
            type(self).params.append(per_rank)
        super().after_step(step, metrics)


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_nan_loss_steps_are_skipped_on_every_rank_and_too_many_stop(tmp_path, no_stray_procs):
    cfg = configure(
        tmp_path,
        "nan",
        "steps=10",
        "warm_start.steps=0",
        "placement.trainer=2",
        "checkpoint.every=2",
        "faults.max_nonfinite_steps=3",
    )
    algo = NaNOnRankOne(cfg)
    with pytest.raises(NonFiniteLoss, match=r"steps 4\.\.6: 3 steps in a row .*step_00000006"):
        algo.run()
    history = algo.log.history
    assert [r["train/nonfinite_skipped"] for r in history] == [0, 0, 1, 0, 1, 1]
    assert [r["faults/nonfinite_steps"] for r in history] == [0, 0, 1, 1, 2, 3]
    after_1, after_2, after_3 = NaNOnRankOne.params
    for per_rank in (after_1, after_2, after_3):  # the ranks stay equal
        assert all((per_rank[0][k] == per_rank[1][k]).all() for k in per_rank[0])
    # The skipped step 2 left the weights as they were; step 3 changed them.
    assert all((after_2[0][k] == after_1[0][k]).all() for k in after_1[0])
    assert any((after_3[0][k] != after_2[0][k]).any() for k in after_2[0])
    assert checkpoint.latest(str(tmp_path / "nan")).endswith("step_00000006")


# --- a full disk at checkpoint time --------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_full_disk_at_checkpoint_time_stops_with_the_previous_checkpoint_intact(
    tmp_path, no_stray_procs, monkeypatch
):
    def full_disk_at_step_4(run_dir, step):
        """The trainer's checkpoint part after step 4 goes to /dev/full."""
        directory = begin(run_dir, step)
        if step == 4:
            os.symlink("/dev/full", f"{directory}/trainer.pt.tmp")
        return directory

    begin = checkpoint.begin
    monkeypatch.setattr(checkpoint, "begin", full_disk_at_step_4)
    cfg = configure(tmp_path, "full", "steps=6", "warm_start.steps=0", "checkpoint.every=2")
    with pytest.raises(CheckpointError, match="checkpoint after step 4 could not be written"):
        GRPO(cfg).run()
    assert checkpoint.latest(str(tmp_path / "full")).endswith("step_00000002")
    assert len((tmp_path / "full" / "metrics.jsonl").read_text().splitlines()) == 4


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "drill, differ",
    [
        ("corrupt@1", "1 parameter(s)"),
        ("skip_pull:0@1", "21 parameter(s)"),
        ("unmerged@1", "14 parameter(s)"),  # LoRA on the 7 projections of 2 layers
    ],
    ids=["a_byte_flipped_in_the_trainers_slot", "a_pull_that_moved_nothing", "lora_not_merged"],
)
def test_a_weight_sync_that_did_not_land_stops_the_run_naming_replica_and_version(
    drill, differ, tmp_path
):
    lora = ["model.lora.rank=4"] if drill.startswith("unmerged") else []
    cfg = configure(
        tmp_path,
        "drill",
        "steps=3",
        "warm_start.steps=0",
        "eval.every=0",
        f"faults.weights=[{drill}]",
        *lora,
    )
    with pytest.raises(RemoteCallError) as info:
        GRPO(cfg).run()
    message = str(info.value)
    assert "\n" not in message
    # Version 2 is the one published after step 1; the replica is never served it.
    assert f"policy[0], version 2: {differ} differ from the trainer's checksums" in message
    rows = (tmp_path / "drill" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in rows]
    assert [r["weights/verified_replicas"] for r in rows] == [1]  # step 0's sync verified


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "layout",
    [
        ("placement.sharding=pp",),
        ("model.arch=qwen3_moe", "placement.ep=2", "trainer.routing_replay=true"),
    ],
    ids=["pp", "ep_with_routing_replay"],
)
def test_a_lost_stage_or_expert_proc_replaces_the_trainer_whole_and_rewinds(
    layout, tmp_path, no_stray_procs
):
    """A PP2 trainer loses its last stage's proc, or an EP2 trainer (Qwen3-MoE,
    routes replayed) the proc of half the experts, at step 3: no rank holds a copy
    of another's part, so the role is replaced whole and goes back to the
    checkpoint of step 2; the run ends with the weights of the same run without the
    fault, bit for bit."""

    def config(name, *extra):
        return configure(
            tmp_path,
            name,
            "steps=5",
            "warm_start.steps=2",
            "checkpoint.every=2",
            "placement.trainer=2",
            *layout,
            *extra,
        )

    GRPO(config("straight")).run()
    algo = GRPO(config("drill", "faults.kill=[trainer:1@3]"))
    history = algo.run()
    assert [r["step"] for r in history] == list(range(5))
    assert [r.split(":")[0] for r in algo.state.recoveries] == ["trainer"]
    assert history[2]["samples/dropped_trainer_rewind"] > 0  # step 3's try and step 2 redone
    straight = load_file(str(tmp_path / "straight" / "final" / "model.safetensors"))
    drill = load_file(str(tmp_path / "drill" / "final" / "model.safetensors"))
    assert straight.keys() == drill.keys()
    assert all((straight[k] == drill[k]).all() for k in straight), "parameters differ"
