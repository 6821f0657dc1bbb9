"""Multi-host runs from the same script: GRPO across ProcessJob "hosts", and the
SLURM and Kubernetes jobs built from config (checked without a cluster)."""

import json
import os
import subprocess

import pytest
import torch

from algorithms.grpo import GRPO, GRPOConfig
from meshrl.config import ConfigError, load_config
from meshrl.procs import zygote
from meshrl.procs.mesh import call_all
from tests.conftest import DEFAULT_CONFIG, REPO


class CheckedGRPO(GRPO):
    """GRPO that, after its first and last steps, records the trainer's ranks and
    whether their parameters agree (DDP across hosts keeps them equal)."""

    checks: list = []
    forked: list = []

    def after_step(self, step, metrics):
        super().after_step(step, metrics)
        if step == 0:  # each proc a fork of this machine's fork server (`job.fork_server`)
            for proc in self.mesh_status(show=False):
                with open(f"/proc/{proc['pid']}/comm") as f:
                    CheckedGRPO.forked.append(f.read().startswith("meshrl@"))
        if step in (0, self.cfg.steps - 1):
            params = call_all(self.trainer, "parameters", what="p", timeout_s=60)
            same = all(torch.equal(params[0][k], p[k]) for p in params[1:] for k in params[0])
            CheckedGRPO.checks.append((self.trainer.size, len(params), same))


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_grpo_trains_across_process_hosts(tmp_path, no_stray_procs):
    """Trainer on 2 hosts (one rank each), policy on 2, environment and reference
    on a host each: 6 subprocess hosts. It must learn, and stop every host. The
    policy replicas form a relay chain (fanout 1): one reads the trainer's
    slots, the other the first replica's."""
    cfg = load_config(
        GRPOConfig,
        DEFAULT_CONFIG,
        [
            "steps=100",
            "kl_coef=0.001",
            "job.kind=process",
            "job.hosts.trainer=2",
            "job.hosts.policy=2",
            "weights.fanout=1",
            f"run.dir={tmp_path}",
            "run.name=hosts",
            "run.progress=false",
            "run.save_final=false",
        ],
    )
    history = CheckedGRPO(cfg).run()
    rewards = [r["reward/mean"] for r in history]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last - first >= 0.25, (first, last)
    assert CheckedGRPO.checks == [(2, 2, True), (2, 2, True)]
    assert len(CheckedGRPO.forked) == 6 and all(CheckedGRPO.forked)
    assert history[-1]["weights/version"] == cfg.warm_start.steps + 100
    # Over RDMA between the hosts, one copy of the model out of the trainer a step.
    model_bytes = history[-1]["weights/trainer_egress_bytes"]
    assert all(r["weights/rdma_replicas"] == 2 for r in history)
    assert all(r["weights/max_hop_depth"] == 2 for r in history)
    assert all(r["weights/trainer_egress_bytes"] == model_bytes > 0 for r in history)


@pytest.mark.unit
def test_job_keys_are_checked():
    with pytest.raises(ConfigError, match="job.kind"):
        load_config(GRPOConfig, None, ["job.kind=cloud"])
    with pytest.raises(ConfigError, match="job.hosts"):
        load_config(GRPOConfig, None, ["job.hosts.trainer=2"])  # local has one host
    with pytest.raises(ConfigError, match="job.hosts.trainer"):
        load_config(GRPOConfig, None, ["job.kind=process", "job.hosts.trainer=0"])
    with pytest.raises(ConfigError, match="job.time_limit"):
        load_config(GRPOConfig, None, ["job.kind=slurm", "job.time_limit=2h"])
    with pytest.raises(ConfigError, match="job.name"):
        load_config(GRPOConfig, None, ["job.kind=kubernetes", "job.name=Big_Run"])
    # Ranks over hosts: 3 trainer hosts do not split 128 completions.
    with pytest.raises(ConfigError, match="placement.trainer"):
        load_config(GRPOConfig, None, ["job.kind=process", "job.hosts.trainer=3"])


def build(config, *overrides, mode="build"):
    """The job `config` builds (`tests/jobs_for_tests.py`), in a process of its own."""
    result = subprocess.run(
        zygote.python_m(
            "tests.jobs_for_tests", mode, os.path.join(REPO, "docs", "examples", config), *overrides
        ),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.unit
def test_slurm_job_is_built_from_config():
    """One sbatch job per role (the cluster tier submits them for real)."""
    job = build("grpo_slurm.yaml")
    assert job["_meshes"] == {"policy": 1, "trainer": 2, "environment": 1}
    script = job["script"].splitlines()
    for line in [
        "#SBATCH --job-name=meshrl-grpo-trainer",
        "#SBATCH --nodes=2",
        "#SBATCH --no-kill",
        "#SBATCH --requeue",
        "#SBATCH --partition=gpu",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --time=04:00:00",
        "#SBATCH --signal=B:USR1@120",
        "#SBATCH --constraint=h100",
    ]:
        assert line in script, line
    assert any(
        line.startswith(".venv/bin/python -m meshrl.procs.slurm")
        for line in [
            part.split(" &")[0].removeprefix("srun --kill-on-bad-exit=0 ") for part in script
        ]
    )
    job = build("grpo_slurm.yaml", "job.hosts.trainer=4", "job.partition=debug")
    assert job["_meshes"]["trainer"] == 4 and "#SBATCH --partition=debug" in job["script"]


@pytest.mark.unit
def test_kubernetes_job_is_built_from_config():
    job = build("grpo_kubernetes.yaml")
    assert job["_namespace"] == "research"
    specs = job["_meshes"]
    assert set(specs) == {"meshrlgrpopolicy", "meshrlgrpotrainer", "meshrlgrpoenvironment"}
    assert specs["meshrlgrpotrainer"]["num_replicas"] == 2
    assert specs["meshrlgrpoenvironment"]["num_replicas"] == 1
    trainer = str(specs["meshrlgrpotrainer"])
    assert "ghcr.io/example/meshrl:latest" in trainer and "nvidia.com/gpu" in trainer


@pytest.mark.unit
def test_hosts_that_join_slurm_and_kubernetes_runs_are_one_host_jobs_of_their_kind():
    """(On `process` jobs the same path runs for real: tests/test_elastic.py.)"""
    job = build("grpo_slurm.yaml", mode="join")
    assert job["mesh"] == "policyjoined3" and job["_meshes"] == {"policyjoined3": 1}
    script = job["script"].splitlines()
    for line in [
        "#SBATCH --job-name=meshrl-grpo-policyjoined3",
        "#SBATCH --nodes=1",
        "#SBATCH --partition=gpu",
        "#SBATCH --constraint=h100",
        "#SBATCH --gpus-per-node=8",
    ]:
        assert line in script, line
    job = build("grpo_kubernetes.yaml", mode="join")
    assert job["mesh"] == "meshrlgrpopolicyjoined3"
    assert (
        job["_namespace"] == "research"
        and job["_meshes"]["meshrlgrpopolicyjoined3"]["num_replicas"] == 1
    )
    assert "ghcr.io/example/meshrl:latest" in str(job["_meshes"]["meshrlgrpopolicyjoined3"])
