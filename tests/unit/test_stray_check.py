"""The suite's stray-proc check owns what the suite started: a Monarch-looking
process of another run on this machine is not counted, one this pytest process
started is (`tests.conftest.monarch_procs`, by the tag every child inherits)."""

import os
import subprocess
import sys
import time

import pytest

from tests.conftest import monarch_procs

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

# A process whose command line reads like a Monarch proc's.
LOOKALIKE = [sys.executable, "-c", "import time; time.sleep(60)", "bootstrap_main"]


def start(env: dict) -> subprocess.Popen:
    proc = subprocess.Popen(LOOKALIKE, env=env)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # its environ readable once it runs
        with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
            if b"bootstrap_main" in f.read():
                return proc
        time.sleep(0.05)
    return proc


def test_another_runs_procs_are_not_ours_and_our_own_are():
    other = {k: v for k, v in os.environ.items() if k != "MESHRL_TEST_SESSION"}
    theirs, ours = start(other), start(dict(os.environ))
    try:
        found = monarch_procs()
        assert theirs.pid not in found, "another run's proc counted as the suite's"
        assert ours.pid in found, "a proc the suite started was not seen: a leak would pass"
    finally:
        for proc in (theirs, ours):
            proc.kill()
            proc.wait()
