"""Multi-host runs from the same script: GRPO across ProcessJob "hosts"."""

import pytest
import torch

from algorithms.grpo import GRPO, GRPOConfig
from meshrl.config import load_config
from meshrl.procs.mesh import call_all
from tests.conftest import DEFAULT_CONFIG


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
    slots, the other the first replica's. (Tensor-parallel replicas across hosts:
    tests/cluster/test_cluster.py, on SLURM nodes.)"""
    cfg = load_config(
        GRPOConfig,
        DEFAULT_CONFIG,
        [
            "steps=70",
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
    # (The same math as one host: the default run's reward is 0.23 above its start over
    # steps 60-69, measured on 2026-11-28; tests/learning holds the longer horizons.)
    assert last - first >= 0.15, (first, last)
    assert CheckedGRPO.checks == [(2, 2, True), (2, 2, True)]
    assert len(CheckedGRPO.forked) == 6 and all(CheckedGRPO.forked)
    assert history[-1]["weights/version"] == cfg.warm_start.steps + cfg.steps
    # Over RDMA between the hosts, one copy of the model out of the trainer a step.
    model_bytes = history[-1]["weights/trainer_egress_bytes"]
    assert all(r["weights/rdma_replicas"] == r["weights/verified_replicas"] == 2 for r in history)
    assert all(r["weights/max_hop_depth"] == 2 for r in history)
    assert all(r["weights/trainer_egress_bytes"] == model_bytes > 0 for r in history)
