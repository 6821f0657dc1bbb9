"""Checkpoints that cannot run code and prove their bytes (`meshrl.loop.checkpoint`).

A pickle payload placed in a checkpoint file (its manifest rewritten to match,
as anyone who can write the directory could) is refused in one line naming the
file, on every path that reads one: the controller's `loop.pt`, the trainer's
`trainer.pt` (resumed in its proc, or exported for `model.path`); the FSDP
shards' index: tests/unit/test_checkpoint_trust.py. A file whose bytes changed is
named, and `resume=auto` falls back to the newest intact checkpoint."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from algorithms.grpo import GRPO, GRPOConfig
from meshrl.config import ConfigError, load_config
from meshrl.loop import checkpoint
from meshrl.loop.checkpoint import CheckpointError
from tests.conftest import DEFAULT_CONFIG
from tests.support.checkpoints import Payload


def plant(path, marker) -> None:
    """Put a payload in `path` (kept a dict, as the real file is) and rewrite the
    checkpoint's manifest so that it vouches for the new bytes."""
    torch.save({"loop": Payload(str(marker)), "sizes": {}, "model": Payload(str(marker))}, path)
    checkpoint.write_manifest(os.path.dirname(path))


def overrides(tmp_path, name, *more):
    return [
        "steps=3",
        "prompts_per_step=4",
        "group_size=2",
        "warm_start.steps=0",
        "eval.every=0",
        "run.progress=false",
        f"run.dir={tmp_path}",
        f"run.name={name}",
        *more,
    ]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A real run's directory with checkpoints after steps 1, 2 and 3."""
    root = tmp_path_factory.mktemp("trust")
    cfg = load_config(
        GRPOConfig,
        DEFAULT_CONFIG,
        overrides(root, "run", "checkpoint.every=1", "checkpoint.keep=3"),
    )
    GRPO(cfg).run()
    return root / "run"


def copy_run(saved, tmp_path, name="copy"):
    target = tmp_path / name
    shutil.copytree(saved, target)
    return target


def step_dir(run, step: int):
    return run / "checkpoints" / f"step_{step:08d}"


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_pickle_payload_in_any_checkpoint_file_is_refused_naming_the_file(
    saved, tmp_path, no_stray_procs
):
    marker = tmp_path / "payload_ran"
    # The controller's loop state, and the trainer's part (read in its proc), on resume.
    for name in ("loop", "trainer"):
        run = copy_run(saved, tmp_path, name)
        plant(step_dir(run, 3) / f"{name}.pt", marker)
        cfg = load_config(
            GRPOConfig,
            DEFAULT_CONFIG,
            overrides(tmp_path, name, f"checkpoint.resume={step_dir(run, 3)}", "steps=4"),
        )
        with pytest.raises(Exception, match=rf"{name}\.pt is not a checkpoint file") as error:
            GRPO(cfg).run()
        assert "posix.mkdir" in str(error.value)
        if name == "loop":
            assert isinstance(error.value, CheckpointError) and "\n" not in str(error.value)
    # The same file as another run's starting model (`model.path`, exported here).
    with pytest.raises(ConfigError, match=r"'model.path': .*trainer\.pt is not a checkpoint"):
        GRPO(load_config(GRPOConfig, DEFAULT_CONFIG, [f"model.path={step_dir(run, 3)}"]))
    assert not marker.exists(), "the payload ran"


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_damaged_bytes_are_named_and_resume_auto_falls_back_to_an_intact_checkpoint(
    saved, tmp_path, capsys, no_stray_procs
):
    run = copy_run(saved, tmp_path)
    trainer = step_dir(run, 3) / "trainer.pt"
    data = bytearray(trainer.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    trainer.write_bytes(bytes(data))  # the same size: only the digest tells
    (step_dir(run, 2) / "loop.pt").write_bytes(b"")  # a truncated file
    with pytest.raises(ConfigError, match=r"trainer\.pt is not the file that was written"):
        load_config(GRPOConfig, DEFAULT_CONFIG, [f"checkpoint.resume={step_dir(run, 3)}"])
    with pytest.raises(ConfigError, match=r"loop\.pt has 0 bytes"):
        load_config(GRPOConfig, DEFAULT_CONFIG, [f"checkpoint.resume={step_dir(run, 2)}"])
    cfg = load_config(
        GRPOConfig, DEFAULT_CONFIG, overrides(tmp_path, "copy", "checkpoint.resume=auto", "steps=4")
    )
    history = GRPO(cfg).run()
    out = capsys.readouterr().out
    assert f"checkpoint {step_dir(run, 3)} is damaged, skipped" in out
    assert f"checkpoint {step_dir(run, 2)} is damaged, skipped" in out
    assert f"resumed from {step_dir(run, 1)} at step 1" in out
    assert [r["step"] for r in history] == [0, 1, 2, 3]  # step 0's record kept from before
