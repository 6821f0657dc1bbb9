"""Reference model: per-token log-probs of given sequences under frozen weights.

Its weights arrive once, like a policy's, from the trainer's published version
at the start of RL (after any warm-start), and never change afterwards.
"""

from __future__ import annotations

import torch
from monarch.actor import Actor, current_rank, endpoint

from meshrl.config import ModelConfig
from meshrl.model.files import load_state, save_state
from meshrl.model.models import completion_logprobs, device_for_this_proc, load_model
from meshrl.observe.telemetry import observed
from meshrl.procs.faults import Drillable
from meshrl.types import TrainBatch
from meshrl.weights.publisher import WeightHandle
from meshrl.weights.receiver import WeightReceiver


class Reference(Drillable, Actor):
    role = "reference"

    def __init__(self, model_cfg: ModelConfig, seed: int = 0, layout: str = "padded"):
        """`layout`: the forward pass's batch layout (`trainer.layout`, meshrl.model.packing)."""
        self.layout = layout
        self.rank = current_rank().rank  # read in __init__: endpoints see no rank here
        self.device = device_for_this_proc()
        self.model = load_model(model_cfg, seed).to(self.device).eval()
        self.weights = WeightReceiver(self.model)

    @endpoint
    @observed
    def load_weights(self, handle: WeightHandle) -> int:
        self.weights.pull(handle)
        return self.weights.version

    @endpoint
    def save_state(self, directory: str) -> None:
        """Rank 0 writes the frozen weights and their version: `reference.pt` in
        the checkpoint `directory`."""
        if self.rank == 0:
            save_state(f"{directory}/reference.pt", model=self.model, version=self.weights.version)

    @endpoint
    def load_state(self, directory: str) -> int:
        path = f"{directory}/reference.pt"
        self.weights.version = load_state(path, model=self.model)["version"]
        return self.weights.version

    @endpoint
    @observed
    def logprobs(self, batch: TrainBatch, temperature: float = 1.0) -> torch.Tensor:
        """[B, T] log-probs of the batch's completion tokens."""
        self.drill("logprobs")
        with torch.no_grad():
            logprobs = completion_logprobs(
                self.model,
                batch.input_ids.to(self.device),
                batch.attention_mask.to(self.device),
                batch.num_completion_tokens,
                temperature,
                self.layout,
                images=None if batch.images is None else batch.images.to(self.device),
                image_counts=batch.image_counts,
            )
        return logprobs.cpu()
