"""Checkpoints that cannot run code and prove their bytes (`meshrl.loop.checkpoint`).

A pickle payload placed in a checkpoint file (its manifest rewritten to match,
as anyone who can write the directory could) is refused in one line naming the
file, on every path that reads one: the controller's `loop.pt`, the trainer's
`trainer.pt` (resumed in its proc, or exported for `model.path`), the FSDP
shards' index. A file whose bytes changed is named, and `resume=auto` falls
back to the newest intact checkpoint."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

from algorithms.grpo import GRPO, GRPOConfig
from meshrl.config import ConfigError, load_config
from meshrl.loop import checkpoint
from meshrl.loop.checkpoint import CheckpointError
from meshrl.types import Completions, Prompt
from tests.conftest import DEFAULT_CONFIG


class Payload:
    """What an attacker's pickle does when it is loaded: here, make a directory."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


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


@pytest.mark.unit
def test_a_payload_in_the_shard_index_is_refused_and_real_shards_load(tmp_path):
    """FSDP checkpoints' index (torch DCP's `.metadata`) is a pickle: meshrl reads it
    with an unpickler that builds DCP's metadata classes and nothing else."""
    import torch.distributed.checkpoint as dcp

    from meshrl.procs.parallel import ShardIndexError, load_dcp

    state = {"model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}}
    dcp.save(state, checkpoint_id=str(tmp_path / "good"))
    loaded = {"model": {"w": torch.zeros(2, 3), "b": torch.zeros(3)}}
    load_dcp(loaded, str(tmp_path / "good"))
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])
    shutil.copytree(tmp_path / "good", tmp_path / "bad")
    marker = tmp_path / "payload_ran"
    with open(tmp_path / "bad" / ".metadata", "wb") as f:
        import pickle

        pickle.dump(Payload(str(marker)), f)
    with pytest.raises(ShardIndexError, match=r"\.metadata: not a shard index .*posix\.mkdir"):
        load_dcp(loaded, str(tmp_path / "bad"))
    assert not marker.exists()


@pytest.mark.unit
def test_the_loop_state_round_trips_as_tensors_and_plain_containers(tmp_path):
    """Prompts (with pictures) and batches generated ahead are written in the form
    `weights_only=True` reads."""
    picture = np.arange(12, dtype=np.uint8).reshape(2, 2, 3)
    prompt = Prompt("12>", "21", data={"tests": ["a"], "n": np.int64(3)}, images=[picture, "p.png"])
    batch = Completions(
        prompt_ids=torch.ones(1, 2, dtype=torch.long),
        prompt_mask=torch.ones(1, 2),
        completion_ids=torch.zeros(1, 3, dtype=torch.long),
        completion_mask=torch.ones(1, 3),
        logprobs=torch.zeros(1, 3),
        weight_version=4,
    )
    state = {"ahead": [([prompt], batch, 1)], "rng": (3, (1, 2), None)}
    torch.save(checkpoint.to_plain(state), tmp_path / "loop.pt")
    back = checkpoint.from_plain(checkpoint.read(str(tmp_path / "loop.pt")))
    ((prompts, completions, behind),) = back["ahead"]
    assert prompts[0].text == "12>" and prompts[0].data == {"tests": ["a"], "n": 3}
    assert np.array_equal(prompts[0].images[0], picture) and prompts[0].images[1] == "p.png"
    assert torch.equal(completions.completion_ids, batch.completion_ids) and behind == 1
    assert completions.weight_version == 4 and back["rng"] == (3, (1, 2), None)


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
