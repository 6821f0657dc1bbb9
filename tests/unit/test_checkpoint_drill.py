"""A crash drill of checkpoints: the controller really dies (a forked process,
`os._exit`) at every point of a save and of the prune after it, and the run
resumes from the newest intact checkpoint each time (tests/support/checkpoint_drill.py)."""

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.unit
@pytest.mark.timeout(120)
@pytest.mark.parametrize("keep", [1, 2])
def test_a_controller_killed_at_any_point_of_a_save_resumes_from_the_newest_intact(tmp_path, keep):
    out = tmp_path / "results.json"
    command = [sys.executable, "-m", "tests.support.checkpoint_drill", str(tmp_path), str(keep)]
    done = subprocess.run([*command, str(out)], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    stages = [r["stage"] for r in results]
    # Every stage was a point the controller died at: role files written, the
    # manifest, COMPLETE, the commit rename, the prune's rename and its deletions.
    for stage in (
        "write loop.pt",
        "MANIFEST.json",
        "/COMPLETE",
        "replace .partial_step_00000006 step_00000006",
        f"rename step_{6 - 2 * keep:08d} .deleting_step_{6 - 2 * keep:08d}",
        f"unlink {tmp_path}/",
        "rmdir ",
    ):
        assert any(stage in s for s in stages), (stage, stages)
    assert sum(r["killed"] for r in results) == len(results) - 1
    for r in results:
        after = r["resumed_from"] + 2 if r["resumed_from"] else None
        assert r["resumed_from"] == r["expected"], r  # never step 0, never an older one
        assert r["resumed_whole"] and r["false_intact"] == [], r
        assert r["next_saved"], r
        assert r["left"] == [
            f"step_{s:08d}" for s in range(after - 2 * (keep - 1), after + 1, 2)
        ], r
