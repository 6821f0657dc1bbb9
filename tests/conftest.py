"""Shared test helpers: tiny configs and a check that no Monarch proc outlives a test."""

from __future__ import annotations

import os
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(REPO, "algorithms", "configs", "grpo_default.yaml")


def monarch_procs() -> set[int]:
    """Pids of live Monarch worker processes on this machine."""
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"bootstrap_main" in cmdline and state != "Z":
            pids.add(int(entry))
    return pids


def wait_for_no_new_procs(before: set[int], timeout_s: float = 30.0) -> set[int]:
    """Procs started since `before` that are still alive after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = monarch_procs() - before
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.25)


@pytest.fixture
def no_stray_procs():
    """Fails the test if a Monarch proc it started is still alive afterwards."""
    before = monarch_procs()
    yield
    left = wait_for_no_new_procs(before)
    assert not left, f"Monarch procs outlived the test: {sorted(left)}"
