"""Trainer: owns the model and optimizer, runs data-parallel over its procs and
publishes weights by version.

Every proc of the trainer mesh holds a full replica; gradients are averaged
with torch.distributed (gloo on CPU, NCCL on GPU) through DDP. The loss is the
algorithm's: a picklable `loss_fn(logprobs [B, T], batch) -> (loss, metrics)`
given at construction, so this actor has no algorithm branches.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from monarch.actor import Actor, current_rank, current_size, endpoint

from meshrl.checkpoint import load_state, save_state
from meshrl.config import ModelConfig, OptimConfig
from meshrl.faults import Drillable
from meshrl.losses import nll_loss
from meshrl.models import completion_logprobs, device_for_this_proc, load_model, load_tokenizer
from meshrl.optim import build_optimizer
from meshrl.parallel import clipped_step, data_parallel, shutdown
from meshrl.types import TrainBatch
from meshrl.weights import WeightHandle, WeightPublisher

LossFn = Callable[[torch.Tensor, TrainBatch], tuple[torch.Tensor, dict[str, float]]]


class Trainer(Drillable, Actor):
    def __init__(
        self,
        model_cfg: ModelConfig,
        optim_cfg: OptimConfig,
        loss_fn: LossFn,
        total_steps: int,
        temperature: float = 1.0,
        seed: int = 0,
        master: tuple[str, int] = ("127.0.0.1", 0),
    ):
        # Global rank over hosts x procs (the controller sees one flat `procs` dim).
        sizes = dict(current_size())
        self.rank, self.world_size = current_rank().rank, math.prod(sizes.values())
        self.device = device_for_this_proc()
        self.model_cfg = model_cfg
        self.model = load_model(model_cfg, seed).to(self.device).train()
        self.module = data_parallel(
            self.model, self.device, self.rank, self.world_size, master, sizes.get("procs")
        )
        self.optim_cfg = optim_cfg
        self.optimizer, self.scheduler = build_optimizer(self.model, optim_cfg, total_steps)
        self.loss_fn = loss_fn
        self.temperature = temperature
        self.publisher = WeightPublisher(self.model) if self.rank == 0 else None
        self.version = 0
        self.warm_start_optimizer: torch.optim.Optimizer | None = None

    def _logprobs(self, module: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
        return completion_logprobs(
            module,
            batch.input_ids,
            batch.attention_mask,
            batch.num_completion_tokens,
            self.temperature,
        )

    def _step(self, batch: TrainBatch, loss_fn: LossFn, optimizer: torch.optim.Optimizer) -> dict:
        batch = batch.apply(lambda t: t.to(self.device))
        loss, metrics = loss_fn(self._logprobs(self.module, batch), batch)
        metrics["train/grad_norm"] = clipped_step(
            loss, self.model, optimizer, self.optim_cfg.max_grad_norm
        )
        metrics["train/loss"] = loss.item()
        return metrics

    @endpoint
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on this rank's shard; the version advances."""
        metrics = self._step(batch, self.loss_fn, self.optimizer)
        metrics["train/lr"] = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.version += 1
        return metrics

    @endpoint
    def warm_start_step(self, batch: TrainBatch, lr: float) -> dict[str, float]:
        """One supervised step (NLL of the completion tokens) with its own AdamW."""
        if self.warm_start_optimizer is None:
            self.warm_start_optimizer = torch.optim.AdamW(
                self.model.parameters(), lr=lr, betas=tuple(self.optim_cfg.betas)
            )
        metrics = self._step(
            batch,
            lambda logprobs, b: nll_loss(logprobs, b.completion_mask),
            self.warm_start_optimizer,
        )
        self.version += 1
        return metrics

    @endpoint
    def eval_step(self, batch: TrainBatch) -> dict[str, float]:
        """The loss and its metrics on this rank's shard, without a gradient step
        (held-out evaluation)."""
        batch = batch.apply(lambda t: t.to(self.device))
        self.model.eval()
        with torch.no_grad():
            loss, metrics = self.loss_fn(self._logprobs(self.model, batch), batch)
        self.model.train()
        metrics["eval/loss"] = loss.item()
        return metrics

    @endpoint
    def save_state(self, path: str) -> None:
        """Rank 0 writes model, optimizer, schedule and version (a checkpoint part)."""
        if self.rank == 0:
            save_state(
                path,
                model=self.model,
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                version=self.version,
            )

    @endpoint
    def load_state(self, path: str) -> int:
        """Every rank restores what `save_state` wrote; returns the version."""
        extra = load_state(
            path, self.device, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler
        )
        self.version = extra["version"]
        return self.version

    @endpoint
    def publish(self) -> WeightHandle:
        """Rank 0: copy the current weights into the RDMA buckets, tagged with the version."""
        assert self.publisher is not None, "publish is called on trainer rank 0"
        return self.publisher.publish(self.version)

    @endpoint
    def save(self, path: str) -> None:
        """Rank 0: HF `save_pretrained` of model and tokenizer."""
        if self.rank == 0:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # keep the controller's console to the run's own bar
            self.model.save_pretrained(path)
            load_tokenizer(self.model_cfg).save_pretrained(path)

    @endpoint
    def parameters(self) -> dict[str, torch.Tensor]:
        """A CPU copy of every parameter (for inspection and tests)."""
        return {name: p.detach().cpu().clone() for name, p in self.model.named_parameters()}

    def __del__(self):
        shutdown()
