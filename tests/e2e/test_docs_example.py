"""The loops in docs/write_your_own.md, run as a reader runs them: each of the
page's python blocks saved as the script its docstring names and run for a few
steps; the two-policy one with a drill that kills one player's trainer."""

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
TINY = [  # a step of a few rows: these tests check the wiring, not the learning
    f"warm_start.steps={WARM_START_STEPS}",
    "warm_start.batch_size=8",
    "prompts_per_step=4",
    "group_size=2",
    "run.progress=false",
]


def page_scripts() -> dict[str, str]:
    """The page's ```python blocks, by the file name each one's docstring tells the
    reader to save it as ("From the repository root: python NAME.py ...")."""
    with open(PAGE) as f:
        blocks = re.findall(r"^```python\n(.*?)^```", f.read(), re.S | re.M)
    scripts = {}
    for block in blocks:
        name = re.search(r"From the repository root: python (\w+\.py)", block)
        assert name, f"{PAGE}: a python block names no script:\n{block[:300]}"
        scripts[name.group(1)] = block
    assert sorted(scripts) == ["reinforce.py", "two_policies.py"], sorted(scripts)
    return scripts


def run_script(tmp_path, name: str, *overrides: str) -> subprocess.CompletedProcess:
    """The page's script `name`, saved under that name and run from the repository
    root (it reads algorithms/configs/grpo_default.yaml from there)."""
    script = tmp_path / name
    script.write_text(page_scripts()[name])
    path = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, str(script), f"run.dir={tmp_path}", *TINY, *overrides],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=270,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


def records_of(run_dir) -> list[dict]:
    with open(run_dir / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    for record in records:
        for key, value in record.items():
            if isinstance(value, (int, float)):
                assert math.isfinite(value), f"step {record['step']}: {key} = {value}"
    return records


def check_ledger(record: dict) -> None:
    dropped = record["samples/dropped_total"]
    assert record["samples/generated_total"] == record["samples/trained_total"] + dropped


def test_write_your_own_loop_runs_and_logs_every_step(tmp_path, no_stray_procs):
    run_script(tmp_path, "reinforce.py", f"steps={STEPS}", "run.name=doc")

    run_dir = tmp_path / "doc"
    records = records_of(run_dir)
    assert [r["step"] for r in records] == list(range(STEPS))
    for record in records:
        for key in ("reward/mean", "loss/policy", "train/loss", "train/grad_norm", "time/train_s"):
            assert key in record, f"step {record['step']}: no {key}"
        assert record["train/nonfinite_skipped"] == 0
    # On-policy: a version per step, each step sampled with the previous step's.
    versions = [r["weights/version"] for r in records]
    assert versions == list(range(WARM_START_STEPS + 1, WARM_START_STEPS + 1 + STEPS))
    assert all(r["weights/generated_with"] == r["weights/version"] - 1 for r in records)
    last = records[-1]
    assert last["samples/trained_total"] == STEPS * last["samples/trained"] > 0
    check_ledger(last)

    with open(run_dir / "warm_start.jsonl") as f:
        assert len(f.readlines()) == WARM_START_STEPS
    assert (run_dir / "final" / "config.json").is_file()


def test_two_policies_train_apart_and_a_lost_trainer_rewinds_only_its_player(
    tmp_path, no_stray_procs
):
    """Steps 0-4; checkpoints after steps 0-1 and 0-3; B's trainer killed as step 3
    begins. One run checks the plain steps (0-2, 4) and the drill (3)."""
    result = run_script(
        tmp_path,
        "two_policies.py",
        "steps=5",
        "run.name=two",
        "checkpoint.every=2",
        "faults.kill=[trainer_b:0@3]",
    )
    assert "recovering trainer_b from" in result.stdout, result.stdout[-2000:]

    run_dir = tmp_path / "two"
    records = records_of(run_dir)
    assert [r["step"] for r in records] == list(range(5))  # no step undone, none repeated
    rows = records[0]["samples/trained"] // 2  # each player's, a step
    for record in records:
        for key in ("reward/mean", "reward/task", "loss/policy", "train/loss", "time/generate_s"):
            assert f"a/{key}" in record, f"step {record['step']}: no a/{key}"
        # the actors' own figures, per player (`Run(metric_prefix=...)`)
        assert "a/time/trainer/train_step_s" in record and "a/time/policy/generate_s" in record
        assert not any(k.startswith(("time/trainer/", "time/policy/")) for k in record)
        check_ledger(record)
    plain = [r for r in records if r["step"] != 3]
    for record in plain:
        assert "b/loss/policy" in record and "b/time/trainer/train_step_s" in record
        assert record["samples/trained"] == 2 * rows
        assert record["b/reward/max"] in (0.0, 1.0)  # all or nothing
        assert all(f"{p}/weights/generated_with" in record for p in "ab")
    # B's reward is 1 for an exact reversal (which the task scores 1 too), else 0: never
    # above the task's partial credit for the same completions.
    assert all(r["b/reward/mean"] <= r["b/reward/task"] + 1e-6 for r in plain)

    # A never went back: a version a step, from the warm-start's on.
    start = WARM_START_STEPS + 1
    assert [r["a/weights/version"] for r in records] == list(range(start, start + 5))
    assert not any("a/recovered_from_step" in r for r in records)
    # B went back to the checkpoint after steps 0-1 at step 3 (no B step there), and
    # step 4 trained on from it: its version is step 1's plus one.
    drill = records[3]
    assert drill["b/recovered_from_step"] == 2 and "b/weights/version" not in drill
    assert [r.get("b/weights/version") for r in records] == [
        start,
        start + 1,
        start + 2,
        None,
        start + 2,
    ]
    assert [("b/recovered_from_step" in r) for r in records] == [False] * 3 + [True, False]
    assert drill["faults/recoveries"] == 1 and drill["samples/trained"] == rows  # A's only
    # B's step 2, undone, and its step 3, never trained, count as dropped.
    assert drill["samples/dropped_trainer_rewind"] == 2 * rows

    checkpoints = run_dir / "checkpoints"
    for step in ("step_00000002", "step_00000004"):
        for player in "ab":  # `subdirs`: the players' files apart
            assert (checkpoints / step / player / "trainer.pt").is_file(), (step, player)
    for player in "ab":
        with open(run_dir / f"warm_start_{player}.jsonl") as f:
            assert len(f.readlines()) == WARM_START_STEPS
        assert (run_dir / "final" / player / "config.json").is_file()
