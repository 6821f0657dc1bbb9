"""Multi-host jobs built from config, checked without a cluster: the job keys, and the
SLURM and Kubernetes jobs."""

import json
import os
import subprocess

import pytest

from algorithms.grpo import GRPOConfig
from meshrl.config import ConfigError, load_config
from meshrl.procs import zygote
from tests.conftest import REPO


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
    """The job `config` builds (`tests/support/jobs.py`), in a process of its own."""
    result = subprocess.run(
        zygote.python_m(
            "tests.support.jobs", mode, os.path.join(REPO, "docs", "examples", config), *overrides
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
            part.split(" &")[0].removeprefix("srun --no-kill --kill-on-bad-exit=0 ")
            for part in script
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
    """(On `process` jobs the same path runs for real: tests/e2e/test_elastic.py.)"""
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


@pytest.mark.unit
def test_two_runs_on_one_host_never_pick_the_same_worker_ports(monkeypatch):
    """A run's worker ports are claimed host-wide when picked, not when its workers
    start listening: a second run that draws the same range moves on (the cluster
    tier runs several SLURM runs at once; before the claim two of them could bind
    the same port)."""
    from meshrl.procs import slurm

    draws = iter([20000, 20000, 20000 + 2 * slurm.RESTARTS - 1, 21000])
    monkeypatch.setattr(slurm.random, "randrange", lambda *_: next(draws))
    first, second = slurm.Allocations(None, "."), slurm.Allocations(None, ".")
    assert first._port(2) == 20000
    assert second._port(2) == 21000  # 20000 and the overlapping draw are taken
    first.jobs["trainer"] = slurm.Allocation("trainer", 2, 20000)  # no job id: no scancel
    first.cancel("trainer")
    assert not first.port_holds and 20000 not in first.ports_taken
    draws = iter([20000])
    assert second._port(2) == 20000  # released by the first run
