"""The same scripts on a real SLURM cluster (slurmctld and 12 slurmd on this machine,
`tests/support/slurm_cluster.py`), with the faults a scheduler brings.

Each run is the CLI a user types, in a process of its own (a SLURM run's
controller talks TCP to its nodes; the suite's other runs use Unix sockets), with
`SLURM_CONF` pointing at the private cluster."""

from __future__ import annotations

import glob
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from meshrl.procs import zygote
from tests.conftest import DEFAULT_CONFIG, REPO, own_pids
from tests.support import other_user

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(420)]

CONFIGS = os.path.join(REPO, "algorithms", "configs")


def command(run_dir, name, *overrides, module="algorithms.grpo", config=DEFAULT_CONFIG):
    """The user's command for a SLURM run (each role on nodes of its own)."""
    # The controller runs here, a fork of the suite's server (`zygote.python_m`); its
    # procs and hosts run on the SLURM nodes, fresh Pythons started by slurmd.
    return zygote.python_m(
        module,
        "--config",
        config,
        "job.kind=slurm",
        "job.partition=debug",
        f"job.python_exe={sys.executable}",
        "placement.threads_per_proc=1",  # twelve "nodes" share this machine's cores
        # ... so a node's preflight figures move with its neighbours' load and the other
        # test worker's (an RDMA read at 0.45 of the median, a matmul at 0.11, were seen
        # on healthy nodes): here only a node 50 times slower than the median is judged
        # slow; failures still count. A node throttled to a tenth of a core is judged at
        # the default 0.5 in its own test (test_health.py).
        "health.min_ratio=0.02",
        "run.progress=false",
        f"run.dir={run_dir}",
        f"run.name={name}",
        *overrides,
    )


def start(cluster, run_dir, name, *overrides, **kwargs) -> subprocess.Popen:
    if "module" not in kwargs:  # GRPO: no held-out evaluation (not what is tested here)
        overrides = ("eval.every=0", *overrides)
    return subprocess.Popen(
        command(run_dir, name, *overrides, **kwargs),
        cwd=REPO,
        env=cluster.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # A background shell starts children with SIGINT ignored; a user's terminal does not.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"the run did not end within {timeout}s:\n{out[-3000:]}") from None
    return out


def history(run_dir, name) -> list[dict]:
    path = os.path.join(run_dir, name, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def status(run_dir, name) -> dict:
    with open(os.path.join(run_dir, name, "status.json")) as f:
        return json.load(f)


def at_step(run_dir, name, step: int, action, proc: subprocess.Popen, timeout: float = 240):
    """Run `action()` in a thread once the run logged `step` steps."""
    done: dict = {}

    def watch():
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            if len(history(run_dir, name)) >= step:
                done["at"] = time.monotonic()
                done["result"] = action()
                return
            time.sleep(0.1)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread, done


def wait_while_running(cluster, proc, check, what: str, timeout: float, poll: float) -> None:
    """Until `check()` holds, while the run `proc` goes on: a run that ended fails
    with its output, and a `what` not seen by `timeout` with the queue."""
    deadline = time.monotonic() + timeout
    while not check():
        assert proc.poll() is None, finish(proc)[-3000:]
        assert time.monotonic() < deadline, f"{what}: {cluster.run('squeue', check=False)}"
        time.sleep(poll)


def job_nodes(cluster, job_id: str) -> list[str]:
    """The nodes SLURM itself says a job ran on."""
    out = cluster.run("scontrol", "show", "job", "-o", job_id, check=False)
    for field in out.split():
        if field.startswith("NodeList="):
            return cluster.run("scontrol", "show", "hostnames", field.split("=", 1)[1]).split()
    return []


def assert_clean_end(cluster, timeout_s: float = 30.0):
    """No job of the run left in the queue (SLURM's KillWait may hold one briefly)."""
    deadline = time.monotonic() + timeout_s
    while cluster.jobs() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not cluster.jobs(), cluster.run("squeue", check=False)


def assert_ledger_exact(records: list[dict]):
    last = records[-1]
    assert last["samples/generated_total"] == (
        last["samples/trained_total"] + last["samples/dropped_total"]
    ), "samples were lost"


# --- the same script on SLURM -----------------------------------------------------------


def another_user_view(run_dir) -> dict:
    """A running SLURM run as uid 65534 sees it: the workers' addresses (from the jobs'
    output), what a TLS handshake without the run's certificate gets from each, and
    what of the run's Unix sockets and files it reaches."""
    workers = []
    for path in glob.glob(os.path.join(run_dir, "slurm", "*.out")):
        with open(path) as f:
            workers += re.findall(r"meshrl worker on \S+ at (\S+)", f.read())
    refused = []
    for address in workers:
        host, port = address.split("://", 1)[1].rsplit(":", 1)
        refused.append(other_user.tls_without_certificate(host, int(port)))
    ours = own_pids()
    return {
        "workers": workers,
        "without_certificate": refused,
        "reached": other_user.reached_by_nobody(ours, [str(run_dir)]),
    }


def test_grpo_on_slurm_learns_over_rdma_with_each_role_on_nodes_of_its_own(
    slurm_cluster, tmp_path, no_stray_procs
):
    cluster = slurm_cluster
    began = time.monotonic()
    proc = start(cluster, tmp_path, "grpo", "steps=40", "job.hosts.policy=3", "placement.policy=1")
    checked, seen = at_step(tmp_path, "grpo", 3, lambda: another_user_view(tmp_path / "grpo"), proc)
    out = finish(proc)
    checked.join(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    records = history(tmp_path, "grpo")
    assert len(records) == 40
    first = sum(r["reward/mean"] for r in records[:5]) / 5
    last = sum(r["reward/mean"] for r in records[-5:]) / 5
    assert last > first + 0.05, f"reward {first:.3f} -> {last:.3f}"
    assert all(math.isfinite(r["train/loss"]) for r in records)
    # Weights crossed nodes over RDMA buffers, through the relay tree (3 replica nodes).
    assert records[-1]["weights/rdma_replicas"] == 3
    assert records[-1]["weights/shm_replicas"] == 0
    assert records[-1]["weights/max_hop_depth"] == 2
    # Each role on nodes of its own, as SLURM itself reports them.
    jobs = status(tmp_path, "grpo")["slurm"]
    assert set(jobs) == {"trainer", "policy", "environment"}
    nodes = {role: job_nodes(cluster, where["job_id"]) for role, where in jobs.items()}
    assert len(nodes["policy"]) == 3 and len(nodes["trainer"]) == len(nodes["environment"]) == 1
    assert sum(len(n) for n in nodes.values()) == len({n for ns in nodes.values() for n in ns})
    assert nodes == {role: where["nodes"] for role, where in jobs.items()}
    # Another user of the cluster: the workers talk TLS with the run's certificates only,
    # and nothing of the run (its directory, the jobs' output) is readable.
    view = seen["result"]
    assert view["workers"] and all(w.startswith("tls://") for w in view["workers"]), view
    assert all("certificate required" in r for r in view["without_certificate"]), view
    assert view["reached"] == {"sockets": [], "files": []}, view
    print(f"GRPO on SLURM: 40 steps in {time.monotonic() - began:.1f}s, {first:.3f} -> {last:.3f}")
    assert_clean_end(cluster)


OTHERS = {  # name: (module, config, overrides)
    "ppo": ("algorithms.ppo", "ppo.yaml", ["steps=3", "warm_start.steps=2", "eval.every=0"]),
    "dpo": ("algorithms.dpo", "dpo.yaml", ["steps=3"]),
    "coevolve": ("algorithms.coevolve", "coevolve.yaml", ["steps=2"]),
}


def test_ppo_dpo_and_coevolution_run_unchanged_on_slurm(slurm_cluster, tmp_path, no_stray_procs):
    """The three at once, as three users would submit them (11 nodes of the 12: none
    waits for another's): each gets nodes of its own from the same cluster."""
    procs = {
        name: start(
            slurm_cluster,
            tmp_path,
            name,
            *overrides,
            module=module,
            config=os.path.join(CONFIGS, config),
        )
        for name, (module, config, overrides) in OTHERS.items()
    }
    outs = {name: finish(proc) for name, proc in procs.items()}
    for name, proc in procs.items():
        assert proc.returncode == 0, (name, outs[name][-3000:])
        records = history(tmp_path, name)
        assert records and all(
            math.isfinite(v) for r in records for v in r.values() if isinstance(v, float)
        ), name
        jobs = status(tmp_path, name)["slurm"]
        nodes = [n for where in jobs.values() for n in where["nodes"]]
        assert len(jobs) >= 2 and len(nodes) == len(set(nodes)), (name, jobs)  # nodes of their own
    assert_clean_end(slurm_cluster)


# --- the faults a scheduler brings ------------------------------------------------------


def test_lost_policy_and_trainer_nodes_are_replaced_on_new_allocations_and_quarantined(
    slurm_cluster, tmp_path, no_stray_procs
):
    cluster = slurm_cluster
    proc = start(
        cluster,
        tmp_path,
        "lost",
        "steps=16",
        "checkpoint.every=2",
        "job.hosts.policy=2",
        "placement.policy=1",
        # Tensor-parallel replicas (2 procs a node) in a relay chain: the lost policy
        # node takes a whole group, re-formed on the new allocation.
        "placement.policy_tp=2",
        "weights.fanout=1",
        "faults.quarantine_after=1",
    )

    def lose(role: str):
        where = status(tmp_path, "lost")["slurm"][role]
        node = where["nodes"][-1]
        cluster.lose_node(node)
        return node

    policy_loss, lost = at_step(tmp_path, "lost", 3, lambda: lose("policy"), proc)
    policy_loss.join(timeout=240)
    trainer_loss, lost_trainer = at_step(tmp_path, "lost", 10, lambda: lose("trainer"), proc)
    out = finish(proc)
    try:
        assert proc.returncode == 0, out[-3000:]
        records = history(tmp_path, "lost")
        assert [r["step"] for r in records][-1] == 15
        assert records[-1]["faults/recoveries"] == 2, out[-2000:]
        assert_ledger_exact(records)
        last = sum(r["reward/mean"] for r in records[-3:]) / 3
        assert last > sum(r["reward/mean"] for r in records[:3]) / 3
        with open(tmp_path / "lost" / "faults.log") as f:
            faults = f.read()
        # Each loss seen by meshrl's dial of the workers, not after Monarch's channel
        # gave up reconnecting (a minute): the call waiting on the node failed then.
        for role in ("policy", "trainer"):
            assert f"the {role} workers on SLURM node(s)" in faults, faults
        assert "seen before Monarch's supervision says so" in faults, faults
        quarantined = status(tmp_path, "lost")["quarantined"]
        for node in (lost["result"], lost_trainer["result"]):
            assert f"quarantined SLURM node {node}" in faults, faults
        # The lost nodes only: the policy's other node kept its worker (srun --no-kill).
        assert sorted(quarantined) == sorted({lost["result"], lost_trainer["result"]}), faults
        # Each replica split over 2 procs on its node, in the policy role's SLURM job
        # (before, its other procs had a job of their own with too few of them for
        # the leaders, and the groups never formed: a hang); a relay chain between
        # the nodes, every replica checked each step.
        assert all(r["weights/verified_replicas"] == 2 for r in records)
        assert max(r["weights/max_hop_depth"] for r in records) == 2
        # No later allocation got a lost node.
        where = status(tmp_path, "lost")["slurm"]
        assert set(where) == {"trainer", "policy", "environment"}
        assert not {lost["result"], lost_trainer["result"]} & {
            n for w in where.values() for n in w["nodes"]
        }
        serve = [r["faults/time_to_serve_s"] for r in records if "faults/time_to_serve_s" in r]
        print(f"node losses: served again after {sorted(set(serve))} s")
    finally:
        for node in {lost.get("result"), lost_trainer.get("result")} - {None}:
            cluster.restore_node(node)
    assert_clean_end(cluster)


SAME = ["steps=60", "checkpoint.every=100", "run.seed=3"]


@pytest.fixture
def straight(tmp_path_factory):
    """The uninterrupted run the requeued one must equal, bit for bit: a `local` run
    on this machine, one thread per proc as on the nodes (the same math at any
    placement: RDMA between nodes or shared memory on one host). It runs while the
    test waits on SLURM; calling the fixture's value waits for it and returns its
    final weights."""
    root = tmp_path_factory.mktemp("straight")
    overrides = [*SAME, "eval.every=0", "placement.threads_per_proc=1", "run.progress=false"]
    proc = subprocess.Popen(
        zygote.python_m(
            "algorithms.grpo",
            "--config",
            DEFAULT_CONFIG,
            *overrides,
            f"run.dir={root}",
            "run.name=straight",
        ),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )

    def weights() -> dict:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        return load_file(str(root / "straight" / "final" / "model.safetensors"))

    try:
        yield weights
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def set_time_limit(cluster, job_id: str, minutes_left: float) -> None:
    """The job's time limit moved to `minutes_left` from now (SLURM counts whole
    minutes from the job's start)."""
    out = cluster.run("squeue", "-h", "-j", job_id, "-o", "%M")  # elapsed, [[D-]H:]M:S
    parts = [int(p) for p in out.strip().replace("-", ":").split(":")]
    elapsed_s = sum(v * 60**k for k, v in enumerate(reversed(parts)))
    limit = math.ceil((elapsed_s + minutes_left * 60) / 60)
    cluster.run("scontrol", "update", f"JobId={job_id}", f"TimeLimit={limit}")


def test_a_timed_out_then_requeued_trainer_job_checkpoints_first_and_ends_bitwise_equal(
    straight, slurm_cluster, tmp_path, no_stray_procs
):
    """Both notices SLURM gives, in one run. First the time limit: the trainer's job
    has `--time` with `--signal`, and its limit is brought near at step 1: SLURM's
    warning is the notice, and the run requeues the job itself. Then, with the job
    started again and the run stepping, `scontrol requeue` (what a preemption by
    requeue does): SLURM's SIGTERM is the notice. Each time a checkpoint is written
    before the kill and the run goes on when SLURM starts the job again; the final
    weights equal those of the same run, uninterrupted, on this machine."""
    cluster = slurm_cluster
    # A slower environment (the same math) keeps the run going until SLURM, which
    # checks time limits every 30 s, has sent its warning, and past the requeue.
    slow = ["faults.episode_latency=0.6,0x1", "job.time_limit=00:30:00", "job.warn_before_s=90"]
    proc = start(cluster, tmp_path, "requeued", *SAME, *slow)
    faults = tmp_path / "requeued" / "faults.log"

    def near_limit():
        job_id = status(tmp_path, "requeued")["slurm"]["trainer"]["job_id"]
        set_time_limit(cluster, job_id, 1.0)  # inside the 90 s warning
        return job_id

    def wait_for(check, what):
        wait_while_running(cluster, proc, check, what, timeout=240, poll=0.2)

    # SLURM checks time limits every 30 s: the warning may come that late, so the
    # limit is brought near early enough for it to land mid-run.
    thread, done = at_step(tmp_path, "requeued", 1, near_limit, proc)
    thread.join(timeout=240)
    assert "result" in done, "the time limit was never brought near"
    job_id = done["result"]
    wait_for(lambda: faults.exists() and "trainer job warning" in faults.read_text(), "warning")
    cluster.run("scontrol", "update", f"JobId={job_id}", "TimeLimit=30")  # once warned
    # Stepping again after the first recovery: now the requeue.
    wait_for(lambda: history(tmp_path, "requeued")[-1].get("faults/recoveries") == 1, "recovery")
    steps = len(history(tmp_path, "requeued"))
    wait_for(lambda: len(history(tmp_path, "requeued")) >= steps + 2, "steps after the recovery")
    assert len(history(tmp_path, "requeued")) < 55, "the run ended before its requeue"
    cluster.run("scontrol", "requeue", job_id)
    out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    text = faults.read_text()
    for said in ("trainer job warning", "trainer job terminated"):
        assert f"written on SLURM's notice ({said}" in text, text
    records = history(tmp_path, "requeued")
    assert [r["step"] for r in records] == list(range(60))
    assert records[-1]["faults/recoveries"] == 2  # the trainer's procs were killed after each
    assert_ledger_exact(records)
    # The same job, started again by SLURM twice, holds the trainer.
    assert status(tmp_path, "requeued")["slurm"]["trainer"]["job_id"] == job_id
    a = straight()
    b = load_file(str(tmp_path / "requeued" / "final" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a), "parameters differ"
    assert_clean_end(cluster)


def test_a_job_that_cannot_start_fails_in_one_line_naming_the_key(
    slurm_cluster, tmp_path, no_stray_procs
):
    cases = [
        (["job.partition=nosuch"], "config key 'job.partition'", "invalid partition"),
        (["job.hosts.trainer=16"], "config key 'job.hosts.trainer'", "PartitionNodeLimit"),
        (
            ['job.slurm_args=["--begin=now+3600"]', "job.job_start_timeout_s=3"],
            "config key 'job.job_start_timeout_s'",
            "BeginTime",
        ),
    ]
    assert_clean_end(slurm_cluster)  # earlier tests' jobs drained (SLURM's KillWait)
    for overrides, key, reason in cases:
        began = time.monotonic()
        proc = start(slurm_cluster, tmp_path, "bad", "steps=2", *overrides)
        out = finish(proc, timeout=120)
        assert proc.returncode != 0
        errors = [line for line in out.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and key in errors[0], out[-2000:]
        assert reason.lower() in errors[0].lower(), errors[0]
        assert "Traceback" not in out
        assert time.monotonic() - began < 60
        # Nothing may wait in the queue; a job that had started is COMPLETING for
        # SLURM's KillWait after its cancel, then leaves.
        pending = slurm_cluster.run("squeue", "-h", "-t", "PENDING", "-o", "%i", check=False)
        assert not pending.split(), f"a job was left queued: {pending}"
        assert_clean_end(slurm_cluster)


def test_policy_pool_grows_and_shrinks_by_allocations_and_ctrl_c_leaves_no_job(
    slurm_cluster, tmp_path, no_stray_procs
):
    cluster = slurm_cluster
    # The run steps until Ctrl-C, while allocations join and leave: a slower environment
    # (the same math) keeps it from taking a core the rest of the suite could use.
    slow = "faults.episode_latency=0.25,0x1"
    proc = start(cluster, tmp_path, "pool", "steps=100000", "job.max_procs.policy=3", slow)

    def joined() -> list[str]:
        out = cluster.run("squeue", "-h", "-o", "%j %T", check=False)
        return [line for line in out.splitlines() if "policyjoined" in line]

    def wait_for(check, what):
        wait_while_running(cluster, proc, check, what, timeout=120, poll=0.5)

    try:
        wait_for(lambda: len(history(tmp_path, "pool")) >= 2, "first steps")
        scale = [sys.executable, "-m", "algorithms.commands", "scale", str(tmp_path / "pool")]
        subprocess.run([*scale, "policy=3"], cwd=REPO, check=True, env=cluster.env, timeout=60)
        wait_for(lambda: len(joined()) == 2, "two allocations joined")
        wait_for(
            lambda: history(tmp_path, "pool")[-1].get("pool/policy_size") == 3, "three replicas"
        )
        subprocess.run([*scale, "policy=1"], cwd=REPO, check=True, env=cluster.env, timeout=60)
        wait_for(lambda: not [j for j in joined() if "RUNNING" in j], "joined jobs cancelled")
        subprocess.run([*scale, "policy=2"], cwd=REPO, check=True, env=cluster.env, timeout=60)
        wait_for(lambda: len([j for j in joined() if "RUNNING" in j]) == 1, "one joined again")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
        finish(proc, timeout=60)
    assert_clean_end(cluster)
