"""Checkpoints that cannot run code (`meshrl.loop.checkpoint`, `meshrl.model.files`),
without a run: a pickle payload in the FSDP shards' index is refused and real
shards load, and the loop state round-trips as tensors and plain containers."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from meshrl.loop import checkpoint
from meshrl.model.files import read
from meshrl.types import Completions, Prompt
from tests.support.checkpoints import Payload


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
    back = checkpoint.from_plain(read(str(tmp_path / "loop.pt")))
    ((prompts, completions, behind),) = back["ahead"]
    assert prompts[0].text == "12>" and prompts[0].data == {"tests": ["a"], "n": 3}
    assert np.array_equal(prompts[0].images[0], picture) and prompts[0].images[1] == "p.png"
    assert torch.equal(completions.completion_ids, batch.completion_ids) and behind == 1
    assert completions.weight_version == 4 and back["rng"] == (3, (1, 2), None)
