"""Shared test helpers: tiny configs and a check that no Monarch proc outlives a test."""

from __future__ import annotations

import os
import time

import pytest

from meshrl.mesh import monarch_pids
from meshrl.proc_pool import pooled_pids, reuse_procs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(REPO, "algorithms", "configs", "grpo_default.yaml")


def monarch_procs() -> set[int]:
    """Pids of live Monarch worker processes on this machine."""
    return monarch_pids()


def wait_for_no_new_procs(before: set[int], timeout_s: float = 30.0) -> set[int]:
    """Procs started since `before` that are still alive after `timeout_s`, other
    than those the proc pool keeps for the next test."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = monarch_procs() - before - pooled_pids()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.25)


@pytest.fixture(scope="session", autouse=True)
def reused_procs():
    """Runs in this process reuse the single-proc meshes of earlier tests' runs
    (`meshrl.mesh.ProcPool`): a proc boots torch and transformers once, not once
    per test. Stopped, and checked gone, at the end of the session."""
    before = monarch_procs()
    pool = reuse_procs()
    yield pool
    reuse_procs(False)
    left = wait_for_no_new_procs(before)
    assert not left, f"pooled Monarch procs outlived the session: {sorted(left)}"


@pytest.fixture
def no_stray_procs():
    """Fails the test if a Monarch proc it started is still alive afterwards."""
    before = monarch_procs()
    yield
    left = wait_for_no_new_procs(before)
    assert not left, f"Monarch procs outlived the test: {sorted(left)}"


def local_master() -> tuple[str, int]:
    """A free (address, port) on this host for a mesh's torch.distributed rank 0."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return "127.0.0.1", s.getsockname()[1]


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A real SLURM cluster on this machine for the `cluster` tests: slurmctld and
    8 slurmd (`tests/slurm_cluster.py`), installed from Debian's packages when
    missing and possible; skipped with the reason where it is not. After the
    session: no daemon, no job."""
    from tests.slurm_cluster import Cluster

    why = Cluster.unavailable()
    if why:
        pytest.skip(f"no SLURM cluster here: {why}")
    cluster = Cluster(str(tmp_path_factory.mktemp("slurm")), nodes=8).start()
    try:
        yield cluster
    finally:
        cluster.stop()
    assert not cluster.pids(), "a SLURM daemon outlived the suite"
    assert not cluster.processes(), f"processes of the cluster outlived it: {cluster.processes()}"
