"""Critic: per-token value estimates for PPO, trained on its own mesh.

A value head on the policy architecture's backbone (`meshrl.model.models.ValueModel`)
with its own optimizer, data-parallel over the procs of the critic mesh. Its
backbone starts from the trainer's published weights (the policy RL starts
from), pulled over RDMA like a policy replica's.
"""

from __future__ import annotations

import math

import torch
from monarch.actor import Actor, current_rank, current_size, endpoint

from meshrl.config import ModelConfig, OptimConfig
from meshrl.model.files import load_state, save_state
from meshrl.model.losses import value_loss
from meshrl.model.models import completion_values, device_for_this_proc, load_value_model
from meshrl.model.optim import build_optimizer
from meshrl.observe.telemetry import observed
from meshrl.procs.faults import Drillable
from meshrl.procs.parallel import (
    Ranks,
    accumulated_gradients,
    accumulated_step,
    data_parallel,
    shutdown,
)
from meshrl.types import TrainBatch
from meshrl.weights.peer_state import PeerState
from meshrl.weights.publisher import WeightHandle
from meshrl.weights.receiver import WeightReceiver


class Critic(PeerState, Drillable, Actor):
    role = "critic"

    def __init__(
        self,
        model_cfg: ModelConfig,
        optim_cfg: OptimConfig,
        total_steps: int,
        value_clip: float = 0.2,
        seed: int = 0,
        master: tuple[str, int] = ("127.0.0.1", 0),
        micro_batches: int = 1,
        layout: str = "padded",
    ):
        """`layout`: the forward pass's batch layout (`trainer.layout`, meshrl.model.packing)."""
        # Global rank over hosts x procs (the controller sees one flat `procs` dim).
        sizes = dict(current_size())
        self.rank, self.world_size = current_rank().rank, math.prod(sizes.values())
        self.device = device_for_this_proc()
        self.model = load_value_model(model_cfg, seed).to(self.device).train()
        self.weights = WeightReceiver(self.model.backbone, prefix=self.model.backbone_prefix)
        ranks = Ranks(self.device, self.rank, self.world_size, master, sizes.get("procs"))
        self.module = data_parallel(self.model, ranks)
        self.optim_cfg = optim_cfg
        self.optimizer, self.scheduler = build_optimizer(self.model, optim_cfg, total_steps)
        self.value_clip = value_clip
        self.micro_batches = micro_batches
        self.layout = layout
        if self.world_size > 1:  # its peers may heal from it (`PeerState`)
            self.ready_to_share()

    @endpoint
    @observed
    def load_backbone(self, handle: WeightHandle) -> int:
        """Take the backbone of a published policy version (the head is kept)."""
        self.weights.pull(handle)
        return self.weights.version

    @endpoint
    @observed
    def values(self, batch: TrainBatch) -> torch.Tensor:
        """[B, T] value of the prefix before each completion token."""
        self.drill("values")
        with torch.no_grad():
            values = completion_values(
                self.model,
                batch.input_ids.to(self.device),
                batch.attention_mask.to(self.device),
                batch.num_completion_tokens,
                self.layout,
                None if batch.images is None else batch.images.to(self.device),
                batch.image_counts,
            )
        return values.cpu()

    @endpoint
    @observed
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step of the clipped value loss on this rank's shard
        (needs `batch.returns` and `batch.old_values`)."""
        self.drill("train_step")
        batch = batch.apply(lambda t: t.to(self.device))
        _, metrics, grad_norm, skipped = accumulated_step(
            batch.split(self.micro_batches),
            self._loss,
            self.model,
            self.optimizer,
            self.optim_cfg.max_grad_norm,
        )
        metrics["value/grad_norm"] = grad_norm
        metrics["value/nonfinite_skipped"] = float(skipped)
        metrics["value/lr"] = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        return metrics

    def _loss(self, part: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """The clipped value loss of one micro-batch, a mean over the whole batch."""
        values = completion_values(
            self.module,
            part.input_ids,
            part.attention_mask,
            part.num_completion_tokens,
            self.layout,
            part.images,
            part.image_counts,
        )
        return value_loss(
            values, part.old_values, part.returns, part.completion_mask, self.value_clip, part.scale
        )

    @endpoint
    def gradients(self, batch: TrainBatch) -> dict[str, torch.Tensor]:
        """The gradient `train_step` would take on this shard (averaged over the
        ranks, before clipping), on CPU, with no step (for inspection and tests)."""
        batch = batch.apply(lambda t: t.to(self.device))
        return accumulated_gradients(batch.split(self.micro_batches), self._loss, self.model)

    @endpoint
    def save_state(self, directory: str) -> None:
        """Rank 0 writes model, optimizer and schedule: `critic.pt` in the
        checkpoint `directory`."""
        if self.rank == 0:
            save_state(
                f"{directory}/critic.pt",
                model=self.model,
                optimizer=self.optimizer,
                scheduler=self.scheduler,
            )

    @endpoint
    def load_state(self, directory: str) -> None:
        load_state(
            f"{directory}/critic.pt",
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
        )

    def peer_state(self) -> dict:
        """What a rank that replaces a lost one takes from this one (`PeerState`)."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "backbone_version": self.weights.version,
        }

    def load_peer_state(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.weights.version = state["backbone_version"]

    @endpoint
    def parameters(self) -> dict[str, torch.Tensor]:
        """A CPU copy of every parameter (for inspection and tests)."""
        return {name: p.detach().cpu().clone() for name, p in self.model.named_parameters()}

    def __del__(self):
        shutdown()
