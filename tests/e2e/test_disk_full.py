"""A disk that fills up mid-run, on a real small filesystem (a tmpfs mounted for the
test; skipped, saying why, where this user cannot mount one): the run stops with
one line naming the file, and its JSONL files end on whole lines."""

from __future__ import annotations

import contextlib
import json
import os

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def fill(directory) -> None:
    """Take every free byte of the filesystem at `directory`."""
    fd = os.open(os.path.join(directory, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (1 << 20, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * size)
    finally:
        os.close(fd)


def whole_lines(path) -> list[dict]:
    data = path.read_text() if path.exists() else ""
    assert not data or data.endswith("\n"), f"{path.name} ends in a cut line"
    return [json.loads(line) for line in data.splitlines()]


def test_a_full_disk_stops_the_run_in_one_line_naming_the_file(small_disk, capfd, no_stray_procs):
    """The disk fills after step 2's generation: the step's record cannot be
    written, the run stops with one line naming the file (the CLI prints it as
    `error: ...`), and what was written ends on whole lines."""
    from algorithms.grpo import GRPO, GRPOConfig
    from meshrl.config import load_config
    from meshrl.procs.mesh import one_line
    from tests.conftest import DEFAULT_CONFIG

    class FillsTheDisk(GRPO):
        def after_step(self, step, metrics):
            if step == 2:
                fill(small_disk)
            super().after_step(step, metrics)

    cfg = load_config(
        GRPOConfig,
        DEFAULT_CONFIG,
        [
            "steps=6",
            "warm_start.steps=0",
            "eval.every=0",
            "run.samples_every=1",
            "run.status_every_s=0.2",
            "checkpoint.every=0",
            "run.progress=false",
            f"run.dir={small_disk}",
            "run.name=run",
        ],
    )
    run = small_disk / "run"
    with pytest.raises(OSError) as info:
        FillsTheDisk(cfg).run()
    line = one_line(info.value)
    assert line.startswith(f"cannot write {run}/") and line.endswith("No space left on device")
    captured = capfd.readouterr()
    assert "Traceback" not in captured.out + captured.err
    records = whole_lines(run / "metrics.jsonl")
    # Step 2's record is the first write after the fill, unless status.json's writer
    # thread held a temp file then: it frees that file's blocks as its own write
    # fails, and step 2's line fits in them (then step 3's samples are the first).
    assert [r["step"] for r in records] in ([0, 1], [0, 1, 2])
    assert {s["step"] for s in whole_lines(run / "samples.jsonl")} <= {0, 1, 2}
    json.loads((run / "status.json").read_text())  # the last whole one
    assert not (run / "final").exists()
