"""The loop in docs/write_your_own.md, run as a reader runs it: the page's one
python block saved as a script and run for a few steps."""

import json
import math
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

PAGE = os.path.join(REPO, "docs", "write_your_own.md")
STEPS = 3
WARM_START_STEPS = 2


def page_script() -> str:
    """The page's one ```python block."""
    with open(PAGE) as f:
        blocks = re.findall(r"^```python\n(.*?)^```", f.read(), re.S | re.M)
    assert len(blocks) == 1, f"{PAGE}: expected one python block, found {len(blocks)}"
    return blocks[0]


def test_write_your_own_loop_runs_and_logs_every_step(tmp_path, no_stray_procs):
    code = page_script()
    script = tmp_path / "reinforce.py"
    script.write_text(code)
    path = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [
            sys.executable,
            str(script),
            f"steps={STEPS}",
            f"warm_start.steps={WARM_START_STEPS}",
            f"run.dir={tmp_path}",
            "run.name=doc",
            "run.progress=false",
        ],
        cwd=REPO,  # the script reads algorithms/configs/grpo_default.yaml from here
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=270,
    )
    assert result.returncode == 0, result.stderr[-3000:]

    run_dir = tmp_path / "doc"
    with open(run_dir / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == list(range(STEPS))
    for record in records:
        for key in ("reward/mean", "loss/policy", "train/loss", "train/grad_norm", "time/train_s"):
            assert key in record, f"step {record['step']}: no {key}"
        for key, value in record.items():
            if isinstance(value, (int, float)):
                assert math.isfinite(value), f"step {record['step']}: {key} = {value}"
        assert record["train/nonfinite_skipped"] == 0
    # On-policy: a version per step, each step sampled with the previous step's.
    versions = [r["weights/version"] for r in records]
    assert versions == list(range(WARM_START_STEPS + 1, WARM_START_STEPS + 1 + STEPS))
    assert all(r["weights/generated_with"] == r["weights/version"] - 1 for r in records)
    last = records[-1]
    assert last["samples/trained_total"] == STEPS * last["samples/trained"] > 0
    dropped = last["samples/dropped_total"]
    assert last["samples/generated_total"] == last["samples/trained_total"] + dropped

    with open(run_dir / "warm_start.jsonl") as f:
        assert len(f.readlines()) == WARM_START_STEPS
    assert (run_dir / "final" / "config.json").is_file()
