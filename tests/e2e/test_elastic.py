"""Elastic pools: policy and environment replicas join and leave a running run
(by the config's schedule, by `meshrl scale` from another shell, by the
notebook's `algo.scale`), with an exact ledger, every new replica at the
current version, and the same weights as a fixed pool."""

import glob
import json
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from algorithms.grpo import GRPO
from algorithms.ppo import PPO, PPOConfig
from meshrl.loop import checkpoint
from meshrl.loop.elastic import REQUEST
from meshrl.procs.pool import ScaleError
from tests.conftest import REPO
from tests.support.runs import StopAt, configure, undocumented_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]


def _meshrl(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "meshrl.commands", *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)


def _final(run_dir) -> dict:
    (path,) = glob.glob(f"{run_dir}/final/*.safetensors")
    return load_file(path)


def _sizes(history: list[dict]) -> list[tuple[int, int]]:
    return [(r["pool/policy_size"], r["pool/environment_size"]) for r in history]


def _exact(history: list[dict], batch: int) -> None:
    """Every sample generated was trained, once; each step generated with the
    version published last (new replicas pulled it before they got work)."""
    last = history[-1]
    assert last["samples/generated_total"] == last["samples/trained_total"] == batch * len(history)
    assert all(r["samples/dropped"] == 0 for r in history)
    assert all(r["weights/generated_with"] == r["weights/version"] - 1 for r in history)


# The trainer's old log-probs: the sampler's are those of a batch of another shape
# at another pool size, equal up to float rounding only.
ELASTIC = (
    "warm_start.steps=2",
    "job.max_procs.policy=3",
    "job.max_procs.environment=2",
    "trainer.recompute_old_logprobs=true",
)


def test_pools_grow_and_shrink_by_schedule_meshrl_scale_and_api(tmp_path, no_stray_procs):
    cfg = configure(
        tmp_path, "elastic", "steps=8", *ELASTIC, "pool.schedule=[policy=2@1,policy=1@6]"
    )
    algo = GRPO(cfg)
    try:
        history = _grow_and_shrink(algo, tmp_path)
    finally:
        algo.close()
    assert _sizes(history) == [(1, 1), (2, 1), (2, 1), (3, 2), (3, 2), (3, 1), (1, 1), (1, 1)]
    _exact(history, cfg.prompts_per_step * cfg.group_size)
    finished = _meshrl("scale", algo.run_dir, "policy=2")
    assert finished.returncode == 1 and "has finished" in finished.stderr
    # Same math at any pool size: each sample's seed is the controller's, so a
    # fixed pool of one replica ends with the same weights, bit for bit.
    fixed = GRPO(configure(tmp_path, "fixed", "steps=8", *ELASTIC))
    fixed.run()
    elastic_weights, fixed_weights = _final(algo.run_dir), _final(fixed.run_dir)
    assert elastic_weights.keys() == fixed_weights.keys()
    assert all(elastic_weights[k].equal(fixed_weights[k]) for k in fixed_weights)


def _grow_and_shrink(algo: GRPO, tmp_path) -> list[dict]:
    algo.run(3)  # steps 0-2: the schedule grows the policy pool at step 1
    run_dir = algo.run_dir
    # Bad input from another shell: one line naming the role and the limit.
    for sizes, line in [
        ("policy=0", "scale: policy=0: a pool keeps at least 1 proc"),
        ("trainer=2", "scale: trainer cannot be scaled (its state lives in its procs)"),
        ("policy=4", "scale: policy=4: past this job's limit of 3 (job.max_procs.policy=3)"),
        ("policy", "scale: 'policy' is not role=size"),
    ]:
        bad = _meshrl("scale", run_dir, sizes)
        assert bad.returncode == 1 and line in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    asked = subprocess.Popen(
        [sys.executable, "-m", "meshrl.commands", "scale", run_dir, "policy=3", "environment=2"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not (tmp_path / "elastic" / REQUEST).exists():
        assert asked.poll() is None and time.monotonic() < deadline, asked.communicate()
        time.sleep(0.2)
    algo.run(2)  # steps 3-4: the request is taken as step 3 begins
    out, err = asked.communicate(timeout=60)
    assert asked.returncode == 0 and "scaled: policy=3 environment=2" in out, err
    algo.scale(environment=1)  # the notebook's call, between steps
    with pytest.raises(ScaleError, match=r"trainer cannot be scaled \(its state lives in its"):
        algo.scale(trainer=2)  # a role of this run's, said so where it was spawned
    with pytest.raises(ScaleError, match="no role 'reference'; elastic roles: policy, environ"):
        algo.scale(reference=2)  # this run has none
    return algo.run()  # steps 5-7; the schedule shrinks the policy pool at step 6


def test_a_scale_request_during_a_trainer_recovery(tmp_path, no_stray_procs):
    """The trainer dies as step 3 begins, when the schedule and a request resize
    the policy pool: the run goes back to its checkpoint and on, the pool keeps
    the size asked for, and the ledger counts the rewound samples."""
    cfg = configure(
        tmp_path,
        "rewind",
        "steps=5",
        *ELASTIC,
        "checkpoint.every=2",
        "faults.kill=[trainer:0@3]",
        "pool.schedule=[policy=2@3]",
        "run.save_final=false",
    )
    algo = GRPO(cfg)
    try:
        algo.run(3)
        (tmp_path / "rewind" / REQUEST).write_text(json.dumps({"policy": 3}))
        history = algo.run()
    finally:
        algo.close()
    # Back to the step-2 checkpoint (the records since are dropped) and on.
    assert [r["step"] for r in history] == [0, 1, 2, 3, 4]
    assert [r["pool/policy_size"] for r in history] == [1, 1, 3, 3, 3]
    assert [r.split(":")[0] for r in algo.state.recoveries] == ["trainer"]
    last, batch = history[-1], cfg.prompts_per_step * cfg.group_size
    assert last["samples/trained_total"] == 5 * batch
    assert last["samples/dropped_total"] == 2 * batch  # steps 2 and 3, rewound
    assert last["samples/generated_total"] == 5 * batch + last["samples/dropped_total"]
    assert all(r["weights/generated_with"] == r["weights/version"] - 1 for r in history)


def test_a_policy_replica_joins_on_a_new_host_of_a_process_job(tmp_path, no_stray_procs):
    """A `process` job's policy host is full: the replica asked for joins on a
    host of its own (a Monarch ProcessJob), checked by the preflight before its
    actors run there, pulls the version over RDMA, serves, and its host is stopped
    when it leaves."""
    cfg = configure(
        tmp_path,
        "joined",
        "steps=4",
        "warm_start.steps=0",
        "job.kind=process",
        "job.max_procs.policy=2",
        "pool.schedule=[policy=2@1,policy=1@3]",
        "run.save_final=false",
    )
    algo = GRPO(cfg)
    try:
        algo.run(2)
        group = algo.runtime.meshes.by_role["policy"]
        assert len(group) == 2 and len(group.hosts) == 2 and group.hosts[1].job is not None
        policy = [p for p in algo.mesh_status(show=False) if p["role"] == "policy"]
        assert [p["rank"] for p in policy] == [0, 1] and policy[0]["pid"] != policy[1]["pid"]
        # The joined host's preflight: its own figures (an RDMA read from a host of the
        # first allocation among them) beside the first allocation's.
        preflight = algo.runtime.meshes.checks.status()["preflight"]
        joined = [f for h, f in preflight["hosts"].items() if h.endswith("policy/joined")]
        assert len(joined) == 1 and joined[0]["rdma_gb_s"] > 0 and joined[0]["cpu_cores"] > 0
        assert preflight["runs"][-1]["hosts"] == 1
        faults = (tmp_path / "joined" / "faults.log").read_text()
        assert "preflight of a host joining policy" in faults
        history = algo.run()
    finally:
        algo.close()
    assert len(group.hosts) == 1  # the joined host left with its replica
    assert [r["pool/policy_size"] for r in history] == [1, 2, 2, 1]
    _exact(history, cfg.prompts_per_step * cfg.group_size)


# --- work by pull ----------------------------------------------------------------------

PULL = ("rollout.dispatch=pull", "rollout.groups_per_call=2", "placement.policy=2")
CUT_AHEAD = (
    *PULL,
    "max_staleness=1",
    "checkpoint.every=2",
    "checkpoint.keep=1",
    "warm_start.steps=0",
)
"""By pull, one version ahead, a checkpoint at step 2: the runs cut there and resumed."""
LATE_AT_CUT = (
    "rollout.overprovision=0.5",
    "checkpoint.every=2",
    "warm_start.steps=0",
    "run.save_final=false",
)
"""Groups drawn beyond a step's, so some are late at the checkpoint of step 2."""
# A model whose generation costs more with more rows (the default's hardly does on a
# CPU: its calls are mostly overhead), one replica 8x slower, nothing overlapped.
SLOWED = (
    "placement.threads_per_proc=1",
    "faults.slow=[policy:1x8@0]",
    "warm_start.steps=0",
    "model.hidden_size=256",
    "model.intermediate_size=1024",
    "generation.max_new_tokens=16",
    "generation.min_new_tokens=16",
    "max_staleness=0",
    "steps=4",
)


class _StopAfter(StopAt, GRPO):
    """A run killed after step `stop_at` (its checkpoint written)."""

    stop_at = 2  # in the step after the checkpoint of steps 0-1


def _cut(tmp_path, name: str, *overrides: str) -> GRPO:
    """A run of `overrides` named `name`, stopped in step 2 (`_StopAfter`)."""
    cut = _StopAfter(configure(tmp_path, name, *overrides))
    with pytest.raises(KeyboardInterrupt):
        cut.run()
    return cut


def _cut_and_resumed(tmp_path, *overrides: str) -> tuple[GRPO, list[dict]]:
    """A run of `overrides` named `cut`, stopped in step 2 (`_StopAfter`) and resumed
    from its checkpoint: the resumed run and its records from step 2 on."""
    _cut(tmp_path, "cut", *overrides)
    resumed = GRPO(configure(tmp_path, "cut", *overrides, "checkpoint.resume=auto"))
    return resumed, resumed.run()[2:]  # (its history starts with the records of steps 0-1)


def _resumed_as_never_stopped(straight, history, resumed, after, keys) -> None:
    """The resumed run's records (`keys`) of steps 2 on and its final weights are
    those of the run that never stopped, bit for bit."""
    assert [[r[k] for k in keys] for r in after] == [[r[k] for k in keys] for r in history[2:]]
    final, again = _final(straight.run_dir), _final(resumed.run_dir)
    differ = {  # named with their largest difference, should this ever fail
        name: float((final[name].float() - again[name].float()).abs().max())
        for name in final
        if not torch.equal(final[name], again[name])
    }
    assert not differ, f"{len(differ)} of {len(final)} parameters differ: {differ}"


def _saved_queue(run_dir) -> dict:
    """The rollout queue of the run's newest checkpoint (as plain values:
    `checkpoint.to_plain`)."""
    saved = torch.load(f"{checkpoint.latest(run_dir)}/loop.pt", weights_only=False)
    return saved["loop"]["data"]["rollout_queue"]


def _ledger_closes(record: dict) -> None:
    """Every sample generated was trained or dropped."""
    ledger = record["samples/trained_total"] + record["samples/dropped_total"]
    assert record["samples/generated_total"] == ledger


@pytest.mark.timeout(300)
def test_pull_gives_the_fast_replica_more_groups(tmp_path, no_stray_procs):
    """One replica of two is 8x slower: a static split would give each half the
    groups every step and wait for the slow one; by pull the fast one takes more.
    (What that saves in step time is measured by benchmarks/stragglers.py, not here.)"""
    algo = GRPO(configure(tmp_path, "pull", *SLOWED, *PULL))
    history = algo.run()
    by_replica = algo.dispatcher.trained_by_replica
    assert sorted(by_replica) == [0, 1] and sum(by_replica.values()) == 4 * 16, by_replica
    assert by_replica[0] >= 2 * by_replica[1], by_replica
    assert history[-1]["samples/trained_total"] == 4 * 16 * 8
    assert all(r["samples/dropped"] == 0 for r in history)


def test_pull_resumes_with_the_queued_groups_of_its_checkpoint(tmp_path, no_stray_procs):
    """With `max_staleness=1` the next step's groups are under way while a step
    trains: a checkpoint waits for them and holds them, and a run stopped there
    and resumed trains them first and ends bit for bit as the run never stopped
    (each group is generated with the version current when it was drawn:
    `Dispatcher.hand_out`)."""
    ahead = (*CUT_AHEAD, "steps=4")
    straight = GRPO(configure(tmp_path, "straight", *ahead))
    history = straight.run()
    assert history[-1]["samples/trained_total"] == 4 * 16 * 8
    queue = _saved_queue(straight.run_dir)
    # The next step's groups: those taken by a replica generated and scored, the rest drawn.
    assert len(queue["complete"]) + len(queue["pending"]) == 16 and queue["complete"]
    resumed, after = _cut_and_resumed(tmp_path, *ahead)
    assert [r["step"] for r in after] == [2, 3]
    assert all(r["weights/staleness"] == 1 for r in history[1:] + after)
    keys = ("reward/mean", "train/loss", "samples/trained_total", "samples/generated_total")
    _resumed_as_never_stopped(straight, history, resumed, after, keys)


@pytest.mark.timeout(300)
def test_overprovision_for_stragglers_only_keeps_generation_one_version_behind(
    tmp_path, no_stray_procs
):
    """`rollout.overprovision_stragglers`: where no group straggles (the default
    task's rows end in a few tokens, long before a step trains), the extra groups
    are not drawn, so none waits complete for a step and every step, once the
    first pool has drained, trains groups one version behind (a fixed
    overprovision=1.0 trains every group two behind, the long tail benchmark's
    learning gap: docs/speed.md); no sample is dropped."""
    history = GRPO(
        configure(
            tmp_path,
            "stragglers",
            *PULL,
            "max_staleness=4",
            "rollout.overprovision=1.0",
            "rollout.overprovision_stragglers=true",
            "steps=8",
            "warm_start.steps=0",
            "run.save_final=false",
        )
    ).run()
    assert [r["weights/staleness"] for r in history[-4:]] == [1, 1, 1, 1], history
    assert all(r["rollout/late_groups"] == 0 for r in history[-4:])
    last = history[-1]
    assert last["samples/generated_total"] == last["samples/trained_total"] == 8 * 16 * 8


@pytest.mark.timeout(300)
def test_pull_resumes_with_late_groups_pending(tmp_path, capsys, no_stray_procs):
    """Over-provisioned: the groups that completed after a step had its batch are
    late; the checkpoint holds them, and the resumed run trains them first. The run
    says at its start that it does not repeat bit for bit."""
    late = (*PULL, *LATE_AT_CUT, "max_staleness=2", "steps=3")
    cut = _cut(tmp_path, "late", *late)
    said = [line for line in capsys.readouterr().out.splitlines() if "overprovision" in line]
    assert len(said) == 1 and "does not repeat bit for bit" in said[0], said
    queue = _saved_queue(cut.run_dir)
    pending = sum(entry[-1] for entry in queue["complete"])  # each group's `late`
    assert pending > 0, queue
    resumed = GRPO(configure(tmp_path, "late", *late, "checkpoint.resume=auto"))
    step = resumed.run()[-1]
    assert step["step"] == 2 and step["rollout/late_groups"] >= min(pending, 16)
    assert step["samples/trained_total"] == 3 * 16 * 8
    _ledger_closes(step)


CONTINUOUS = (
    "policy.continuous=true",
    "rollout.groups_per_call=1",
    "rollout.calls_per_replica=4",
    "policy.max_rows=12",
)


def test_continuous_batching_resumes_bit_for_bit(tmp_path, no_stray_procs):
    """Continuous batching, one version ahead: calls join each replica's running
    batch, and a run stopped after its checkpoint and resumed ends with the
    weights of the run that never stopped, bit for bit. (Which rows share a
    decode step is timing; each row's tokens are its seed's alone, and the
    trainer's own old log-probs make the rest exact.)"""
    ahead = (
        *CUT_AHEAD,
        *CONTINUOUS,
        "steps=3",
        "trainer.recompute_old_logprobs=true",
        "faults.completion_lengths=2,0.3x8",
        "generation.max_new_tokens=8",
    )
    straight = GRPO(configure(tmp_path, "straight", *ahead))
    history = straight.run()
    assert history[-1]["samples/trained_total"] == 3 * 16 * 8
    assert all(0 < r["policy/batch_occupancy"] <= 1 for r in history)
    resumed, after = _cut_and_resumed(tmp_path, *ahead)
    keys = ("reward/mean", "train/loss", "samples/trained_total", "policy/completion_tokens")
    _resumed_as_never_stopped(straight, history, resumed, after, keys)


def test_partial_rollouts_train_tokens_of_several_versions(tmp_path, no_stray_procs):
    """Partial rollouts on a heavy tail of lengths: weight pulls land while rows
    decode, rows go on under the new weights, and the steps train rows whose
    tokens come from several versions (each trained token counted by its lag).
    A checkpoint waits for the rows under way and keeps the complete groups with
    their tokens' versions; the resumed run trains them first. A replica killed
    in it, with several calls under way, is replaced once and its calls made
    again; every sample is accounted for."""
    partial = (
        *PULL,
        *CONTINUOUS,
        *LATE_AT_CUT,
        "rollout.partial=true",
        "max_staleness=3",
        "steps=5",
        "faults.completion_lengths=3,0.3x24",
        "generation.max_new_tokens=24",
    )
    cut = _cut(tmp_path, "partial", *partial)
    complete = _saved_queue(cut.run_dir)["complete"]
    assert complete and all(entry[4]["fields"]["token_versions"] is not None for entry in complete)
    resumed = GRPO(
        configure(
            tmp_path, "partial", *partial, "checkpoint.resume=auto", "faults.kill=[policy:1@3]"
        )
    )
    history = resumed.run()
    assert [r["step"] for r in history] == [0, 1, 2, 3, 4]
    late = sum(entry[-1] for entry in complete)  # each group's `late`
    assert history[2]["rollout/late_groups"] >= min(late, 16) > 0
    assert sum(r["rollout/partial_rows"] for r in history) > 0
    assert sum(r["rollout/tokens_lag1"] + r["rollout/tokens_lag2plus"] for r in history) > 0
    for r in history:  # every trained token counted once by its lag
        lags = r["rollout/tokens_lag0"] + r["rollout/tokens_lag1"] + r["rollout/tokens_lag2plus"]
        assert lags == r["policy/completion_tokens"]
    assert not undocumented_metrics(history, "algorithms/grpo.md")
    last = history[-1]
    assert last["samples/trained_total"] == 5 * 16 * 8
    assert last["faults/recoveries"] == 1
    _ledger_closes(last)


# --- recovery in seconds ----------------------------------------------------------------


def test_a_standby_replaces_a_killed_policy_proc_within_seconds(tmp_path, no_stray_procs):
    """A policy proc killed at step 2 is seen gone by its pid (not after Monarch's
    ~10 s), a standby that was spawned and loaded takes its rank, pulls the
    version and serves, and a new standby is spawned; the run goes on."""
    cfg = configure(
        tmp_path,
        "standby",
        "steps=5",
        "warm_start.steps=0",
        "placement.policy=2",
        "faults.standby.policy=1",
        "faults.kill=[policy:0@2]",
        "run.save_final=false",
    )
    algo = GRPO(cfg)
    try:
        algo.run(2)
        group = algo.runtime.meshes.by_role["policy"]
        spare = group.standbys[0]
        # It takes each published version as the replicas do (unwaited: let it land).
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            proc = spare.actors[0].status.call_one().get(timeout=30)
            versions = [a["version"] for a in proc["actors"] if a["actor"] == "policy"]
            if versions == [algo.sync.version]:
                break
            time.sleep(0.2)
        assert versions == [algo.sync.version], proc
        history = algo.run(3)
        assert group.members[0] is spare and len(group.standbys) == 1  # refilled
    finally:
        algo.close()
    assert [r["faults/recoveries"] for r in history] == [0, 0, 1, 1, 1]
    times = algo.sup.recovery_times
    assert len(times) == 1 and times[0]["detect_s"] < 2.0 and times[0]["serve_s"] < 5.0, times
    assert history[2]["faults/time_to_serve_s"] == times[0]["serve_s"]
    batch = cfg.prompts_per_step * cfg.group_size
    assert history[-1]["samples/trained_total"] == 5 * batch
    # The killed replica's half of the step's generation, redone; the other half kept.
    assert history[2]["samples/redone_policy_lost"] == batch // 2
    assert history[-1]["samples/dropped_total"] == 0
    assert all(r["weights/generated_with"] == r["weights/version"] - 1 for r in history)


@pytest.mark.timeout(300)
def test_ppo_trains_by_pull(tmp_path, no_stray_procs):
    """PPO's loop takes its rollouts from the same queue (its critic values the
    trained rows after)."""
    cfg = configure(
        tmp_path,
        "ppo",
        "steps=2",
        "rollout.dispatch=pull",
        "rollout.groups_per_call=4",
        "placement.policy=2",
        "prompts_per_step=16",
        schema=PPOConfig,
        path=f"{REPO}/algorithms/configs/ppo.yaml",
    )
    history = PPO(cfg).run()
    assert [r["samples/trained"] for r in history] == [16 * cfg.group_size] * 2
    assert all(r["samples/dropped"] == 0 and "value/mean" in r for r in history), history[-1]
