"""Checkpoints: atomic, the last K kept, and `export` naming what is missing."""

import os

import pytest

from algorithms.grpo import GRPOConfig
from meshrl.config import ConfigError, load_config
from meshrl.loop import checkpoint, export


@pytest.mark.unit
def test_commit_is_atomic_and_keeps_the_last_k(tmp_path):
    run = str(tmp_path)
    for step in (2, 4, 6):
        partial = checkpoint.begin(run, step)
        (tmp_path / "checkpoints" / os.path.basename(partial) / "trainer.pt").write_text("x")
        checkpoint.commit(partial, keep=2)
    assert [checkpoint.step_of(p) for p in checkpoint.complete(checkpoint.root(run))] == [4, 6]
    # A crash while writing step 8: its partial directory is never taken as a checkpoint.
    checkpoint.begin(run, 8)
    assert checkpoint.step_of(checkpoint.latest(run)) == 6
    assert checkpoint.latest(str(tmp_path / "none")) is None
    with pytest.raises(ConfigError, match="checkpoint.resume"):
        load_config(GRPOConfig, None, [f"checkpoint.resume={tmp_path}/checkpoints/step_00000008"])


@pytest.mark.unit
def test_export_names_what_is_missing_in_one_line(tmp_path, capsys):
    assert export.main([str(tmp_path), str(tmp_path / "out")]) == 1
    assert "neither a run directory nor a checkpoint" in capsys.readouterr().err
    (tmp_path / "config.yaml").write_text("steps: 3\n")
    assert export.main([str(tmp_path), str(tmp_path / "out")]) == 1
    assert "has no complete checkpoint (set checkpoint.every" in capsys.readouterr().err
    # A run without checkpoints whose final model is saved: that is the HF directory.
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "config.json").write_text("{}")
    assert export.main([str(tmp_path), str(tmp_path / "out")]) == 1
    assert f"already an HF directory: {tmp_path / 'final'}" in capsys.readouterr().err
    assert export.main([str(tmp_path)]) == 2
    assert not (tmp_path / "out").exists()
