"""A model that does not fit a real small filesystem (a tmpfs mounted for the test;
skipped, saying why, where this user cannot mount one) leaves no half-written
directory for `model.path` to take."""

from __future__ import annotations

import os

import pytest


@pytest.mark.unit
@pytest.mark.timeout(300)
def test_a_model_that_does_not_fit_leaves_no_directory_for_model_path(small_disk):
    """`save_hf` (the final model, an export) on a disk too small for the weights:
    one OSError naming the directory, and neither it nor a partial one is left."""
    from meshrl.config import ModelConfig
    from meshrl.model.hf import save_hf
    from meshrl.model.models import load_model

    cfg = ModelConfig(hidden_size=512, num_layers=8, num_heads=8, intermediate_size=2048)
    model = load_model(cfg)  # ~100 MB of float32 weights: more than the disk holds
    with pytest.raises(OSError, match=f"cannot write the model to {small_disk}/final: No space"):
        save_hf(model, cfg, str(small_disk / "final"))
    assert os.listdir(small_disk) == []
