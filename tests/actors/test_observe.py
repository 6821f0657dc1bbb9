"""Monarch's telemetry in one process: a second telemetry job is one line."""

from __future__ import annotations

import pytest

from meshrl.config import ConfigError
from meshrl.observe.monarch import Observe


@pytest.mark.actors
def test_a_second_telemetry_job_in_one_process_is_one_line(monkeypatch):
    """Monarch 0.7 gives a process's telemetry to one job for the process's life
    (its socket sink and mesh admin): a notebook's next run is told, not hung."""
    from monarch.job import LocalJob

    from meshrl.observe import monarch as observe

    monkeypatch.setattr(observe, "_used_in_process", True)
    with pytest.raises(ConfigError, match="'run.telemetry': Monarch runs telemetry for one job"):
        Observe(telemetry=True).enable(LocalJob(("policy",)), "local")
