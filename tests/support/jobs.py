"""The job a config builds, printed as JSON (`python -m tests.support.jobs build|join
CONFIG KEY=VALUE...`), for tests/unit/test_job.py. In a process of its own: Monarch's
SlurmJob and KubernetesJob switch the process's transport to TCP when constructed."""

import json
import sys

from algorithms.grpo import GRPOConfig
from meshrl.config import load_config
from meshrl.procs.job import build_job, joining_job


def fields(job) -> dict:
    return {k: v for k, v in vars(job).items() if isinstance(v, (str, int, list, dict, type(None)))}


def main(mode: str, config: str, *overrides: str) -> dict:
    cfg = load_config(GRPOConfig, config, list(overrides))
    if mode == "join":  # a host joining for a policy replica past its hosts (`job.max_procs`)
        job, name = joining_job(cfg.job, "policy", 3)
        role, mesh, slots = "policy", name, 8
    else:
        job, name = build_job(cfg.job, ["policy", "trainer", "environment"]), None
        role, mesh, slots = "trainer", "trainer", 64
    named = {"mesh": name} if name else {}
    if hasattr(job, "allocations"):  # meshrl's SLURM job: the sbatch script it would submit
        from meshrl.procs.slurm import Allocation

        alloc = Allocation(mesh, job.meshes[mesh], 20000, ["id"] * slots)
        return {**named, "_meshes": job.meshes, "script": job.allocations.script(alloc, role)}
    return {**named, **fields(job)}


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:]), default=str))
