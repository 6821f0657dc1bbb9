"""Shared test helpers: tiny configs and a check that no Monarch proc outlives a test."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from meshrl.procs import channels, zygote
from meshrl.procs.mesh import monarch_pids
from meshrl.procs.proc_pool import CORES_ENV, local_cores, pooled_pids, reuse_procs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(REPO, "algorithms", "configs", "grpo_default.yaml")


# Every process this pytest process starts inherits this tag (Monarch's procs,
# subprocess hosts, SLURM jobs through sbatch's `--export=ALL`): the checks
# below count the suite's own processes, not another run's on the same machine
# (nor the other worker's, with `pytest -n 2`).
TAG = f"MESHRL_TEST_SESSION={os.getpid()}-{uuid.uuid4().hex[:8]}"
os.environ["MESHRL_TEST_SESSION"] = TAG.split("=", 1)[1]


def own_pids() -> set[int]:
    """Pids of live processes started by this pytest process (by `TAG`)."""
    mark, found = TAG.encode(), set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    found.add(int(entry))
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return found


def descendants(root: int) -> set[int]:
    """`root` and every live process below it."""
    parents: dict[int, int] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    found, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        children = [child for child, parent in parents.items() if parent == pid]
        found.update(children)
        frontier += children
    return found


def monarch_procs() -> set[int]:
    """Pids of live Monarch worker processes that this pytest process started."""
    return monarch_pids() & own_pids()


def listeners(pids: set[int]) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket that one of `pids` listens on."""
    import ipaddress

    inodes = channels.socket_inodes(pids)
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                    continue
                raw, port = fields[1].split(":")
                data = bytes.fromhex(raw)
                # /proc prints each 32-bit word of the address in host (little-endian) order.
                data = b"".join(data[i : i + 4][::-1] for i in range(0, len(data), 4))
                found.append((str(ipaddress.ip_address(data)), int(port, 16)))
    return found


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
    (`meshrl.procs.proc_pool.ProcPool`): a proc boots torch and transformers once, not once
    per test. Stopped, and checked gone, at the end of the session. Every other
    local proc, of this process's runs and of the command-line runs and notebook
    kernels it starts, is a fork of one server (`meshrl.procs.zygote.share`)."""
    before = monarch_procs()
    channels.seal()  # as a run does first: the suite's own Monarch channels private too
    zygote.share()
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


TIERS = ("unit", "actors", "e2e", "learning", "notebook", "cluster")
"""Every test names its tier (pyproject's markers): `make check` runs unit and actors."""

FOLDERS = {
    "unit": "unit",
    "actors": "actors",
    "e2e": "e2e",
    "learning": "learning",
    "notebooks": "notebook",
    "cluster": "cluster",
}
"""Each tier's tests live in a folder of their own under tests/ (the folder, its marker);
tests/support/ holds the helpers they share and the modules runs load by name."""


FIRST = (
    "cluster/test_cluster.py",
    "learning/test_environments.py",
    "notebooks/test_notebooks.py",
    "learning/test_algorithms.py",
    "e2e/test_recovery.py",
    "learning/test_agent_learning.py",
    "learning/test_layouts.py",
    "e2e/test_e2e.py",
    "e2e/test_elastic.py",
    "e2e/test_agent.py",
    "e2e/test_checkpoint.py",
    "e2e/test_job.py",
    "learning/test_default_run.py",
)
"""The longest files, longest first, by their path under tests/: `make test`'s two pytest
workers (`-n 2`) each take the next whole file when theirs ends
(`pytest_xdist_make_scheduler`), so the long ones go first and the short ones fill in
at the end. (Measured on 2 cores in `make test` on 2026-11-28, whole files: test_cluster.py
390 s, test_environments.py 297, test_notebooks.py 160, test_algorithms.py 118,
test_recovery.py 69, test_e2e.py 53, test_elastic.py 52, test_agent.py 38,
test_checkpoint.py 36, test_job.py 24 and test_default_run.py 21; on 2026-12-05, alone
on a loaded machine, learning/test_agent_learning.py 61 s. cluster/test_health.py, 80 to
134 s alone, is left to the end: beside a learning file its throttled nodes' procs boot
slowest.) The SLURM tier then
runs beside the rest: alone it took 343 s of CPU in 447 s (about one core)."""

TESTS = os.path.dirname(os.path.abspath(__file__))


def relative(item) -> str:
    """`item`'s file by its path under tests/ ("unit/test_job.py"): two folders may hold
    files of the same name."""
    return os.path.relpath(str(item.path), TESTS).replace(os.sep, "/")


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        """One work unit per test file (its module fixtures set up once), in the
        order collected (`pytest_collection_modifyitems`)."""

        def _split_scope(self, nodeid: str) -> str:
            return nodeid.split("::")[0]

    config.option.loadscopereorder = False  # keep FIRST's order, not xdist's by count
    return ByFile(config, log)


def pytest_configure(config):
    # Two workers share this machine's cores: each worker's runs take their half
    # (`meshrl.procs.proc_pool.local_cores`), so that two runs at once do not
    # oversubscribe the cores with twice the threads.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and CORES_ENV not in os.environ:
        os.environ[CORES_ENV] = str(max(1, local_cores() // workers))


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(relative(item), len(FIRST)))  # stable: in file order
    untiered, misplaced = [], []
    for item in items:
        tiers = [t for t in TIERS if item.get_closest_marker(t)]
        folder = FOLDERS.get(relative(item).split("/")[0])
        if not tiers:
            untiered.append(item.nodeid)
        elif tiers != [folder]:
            misplaced.append(f"{item.nodeid} ({', '.join(tiers)})")
    if untiered:
        raise pytest.UsageError(
            f"tests without a tier marker ({', '.join(TIERS)}): {', '.join(untiered)}"
        )
    if misplaced:
        raise pytest.UsageError(
            "tests whose tier marker is not their folder's (tests/<folder>/ holds the tier "
            + ", ".join(f"{t} in {f}/" for f, t in FOLDERS.items())
            + f"): {', '.join(misplaced)}"
        )


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A real SLURM cluster on this machine for the `cluster` tests: slurmctld and
    12 slurmd (`tests/support/slurm_cluster.py`), installed from Debian's packages when
    missing and possible; skipped with the reason where it is not. After the
    session: no daemon, no job."""
    from tests.support.slurm_cluster import Cluster

    why = Cluster.unavailable()
    if why:
        pytest.skip(f"no SLURM cluster here: {why}")
    cluster = Cluster(str(tmp_path_factory.mktemp("slurm")), nodes=12)
    # A pytest process killed hard (SIGKILL, or an xdist worker on Ctrl-C) runs no
    # teardown: this process, in a session of its own, stops the cluster once it is gone.
    reaper = subprocess.Popen(
        [sys.executable, "-m", "tests.support.slurm_cluster", "stop", "--dir", cluster.root]
        + ["--after", str(os.getpid())],
        cwd=REPO,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield cluster.start()
    finally:
        cluster.stop()
        reaper.kill()
        reaper.wait()
    assert not cluster.pids(), "a SLURM daemon outlived the suite"
    assert not cluster.processes(), f"processes of the cluster outlived it: {cluster.processes()}"


@pytest.fixture
def small_disk(tmp_path):
    """A 48 MB tmpfs at tmp_path/disk, unmounted after the test."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
