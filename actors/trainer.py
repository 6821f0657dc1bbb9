"""Trainer: owns the model and optimizer, runs data-parallel over its procs and
publishes weights by version.

With `placement.sharding=ddp` every proc of the trainer mesh holds a full
replica and gradients are averaged through DDP; with `fsdp` parameters,
gradients and optimizer state are sharded over the procs (FSDP2); `tp` and
`fsdp_tp` split the decoder's linear layers with tensor parallelism (and FSDP2
over groups of it): meshrl/procs/parallel.py. `pp`, `fsdp_pp` and `fsdp_tp_pp`
split its layers into pipeline stages run by a schedule of torch's pipelining
(meshrl/procs/pipeline.py), each stage's procs DDP replicas, FSDP2 shards or
tensor-parallel groups with FSDP2 across them. Every layout but ddp writes
checkpoints shard by shard (torch.distributed.checkpoint). torch.distributed
runs gloo on CPU, NCCL on GPU. The loss is the
algorithm's: a picklable `loss_fn(logprobs [B, T], batch) -> (loss, metrics)`
given at construction, so this actor has no algorithm branches.

A rank sees its shard of the optimizer step's batch, in `micro_batches`
passes. `batch.scale` (`meshrl.model.losses.LossScale`) carries the whole batch's
counts: a loss that divides by them (the shipped losses do) gives the same
gradient at any number of ranks and micro-batches. Its metrics are summed over
the micro-batches and averaged over the ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from monarch.actor import Actor, current_rank, current_size, endpoint

from meshrl.config import ModelConfig, OptimConfig
from meshrl.model import lora
from meshrl.model.files import load_state, save_state
from meshrl.model.hf import save_hf
from meshrl.model.losses import nll_loss
from meshrl.model.models import (
    batch_logprobs,
    device_for_this_proc,
    load_model,
    sequence_positions,
    token_logprobs,
)
from meshrl.model.optim import build_optimizer
from meshrl.model.routing import Replay, routers
from meshrl.model.vision import FROZEN_VISION
from meshrl.observe.telemetry import observed
from meshrl.procs.expert_parallel import expert_blocks, gather_blocks
from meshrl.procs.faults import Drillable
from meshrl.procs.parallel import (
    Ranks,
    ShardedState,
    accumulated_gradients,
    accumulated_step,
    data_parallel,
    full_parameters,
    is_sharded,
    pipeline_parallel,
    shutdown,
)
from meshrl.procs.pipeline import broadcast_from_last, gather_over, sum_tied
from meshrl.procs.reshard import replica_parts
from meshrl.types import TrainBatch
from meshrl.weights.peer_state import PeerState
from meshrl.weights.precision import (
    check_precisions,
    compute_precision,
    fp8_weight_names,
)
from meshrl.weights.precision import source as wire_source
from meshrl.weights.publisher import WeightHandle, WeightPublisher

LossFn = Callable[[torch.Tensor, TrainBatch], tuple[torch.Tensor, dict[str, float]]]


class Trainer(PeerState, Drillable, Actor):
    role = "trainer"

    def __init__(
        self,
        model_cfg: ModelConfig,
        optim_cfg: OptimConfig,
        loss_fn: LossFn,
        total_steps: int,
        temperature: float = 1.0,
        seed: int = 0,
        master: tuple[str, int] = ("127.0.0.1", 0),
        sharding: str = "ddp",
        shm_prefix: str | None = None,
        micro_batches: int = 1,
        layout: str = "padded",
        routing_replay: bool = False,
        tp: int = 1,
        replica_tp: int = 1,
        precision: str = "fp32",
        precisions: tuple[str, ...] = ("fp32",),
        pp: int = 1,
        pp_schedule: str = "1f1b",
        pp_microbatches: int = 4,
        ep: int = 1,
    ):
        """`layout`: how a batch is laid out for the forward pass (`trainer.layout`,
        meshrl.model.packing). `routing_replay` (MoE models): a batch's recorded routes
        are replayed in its forwards, not only measured (meshrl.model.routing).
        `sharding` and `tp`: the layout over this mesh's procs (`placement.sharding`,
        meshrl.procs.parallel). `replica_tp`: procs per policy replica
        (`placement.policy_tp`); the weights are published in the parts each of
        their procs holds (meshrl.procs.reshard).
        `precision` (`trainer.precision`): fp32, or bf16-mixed: float32 parameters,
        gradients (so reduced in float32 by DDP, FSDP2 and tensor parallelism alike)
        and optimizer state, each forward's matmuls in bfloat16 under autocast.
        `precisions`: each version is published once in each (`policy.precision`
        of the replicas, fp32 for a reference or critic that pulls it), converted
        here (`meshrl.weights.precision`).
        `pp` > 1 (`placement.pp` of the pipelined `sharding`s): this proc holds its
        stages only, run by `pp_schedule` (`trainer.pp_schedule`) over
        `pp_microbatches` micro-batches of each pass (`trainer.pp_microbatches`).
        `ep` > 1 (`placement.ep`): a mixture of experts' experts spread over the
        procs (`meshrl.procs.expert_parallel`)."""
        check_precisions(precision, precisions, model_cfg.dtype)
        self.precision = precision
        if model_cfg.dtype == "bfloat16":  # its own bytes are bf16 already: named so
            precisions = tuple(dict.fromkeys("bf16" if p == "fp32" else p for p in precisions))
        # Global rank over hosts x procs (the controller sees one flat `procs` dim).
        sizes = dict(current_size())
        self.rank, self.world_size = current_rank().rank, math.prod(sizes.values())
        self.device = device_for_this_proc()
        self.model_cfg = model_cfg
        self.model = load_model(model_cfg, seed).to(self.device).train()
        split = replica_parts(self.model, replica_tp) if replica_tp > 1 else None
        fp8_names = fp8_weight_names(self.model)  # HF names, before any wrapper renames them
        if model_cfg.lora.rank:  # adapters only train; the rest sees merged weights
            frozen = None if model_cfg.vision.train else FROZEN_VISION  # no adapters there
            self.model = lora.wrap(self.model, model_cfg.lora, seed, frozen)
        # MoE routers: measured against a batch's recorded routes, replayed if asked
        # (not across pipeline stages: the config refuses replay there).
        self.routing = Replay(self.model, routing_replay) if routers(self.model) else None
        ranks = Ranks(self.device, self.rank, self.world_size, master, sizes.get("procs"))
        self.pipeline = None
        if pp > 1:
            self.routing = None
            self.pipeline = pipeline_parallel(
                self.model,
                ranks,
                sharding,
                tp,
                pp,
                pp_schedule,
                pp_microbatches,
                positions=sequence_positions,
            )
            self.module = None
        else:
            self.module = data_parallel(self.model, ranks, sharding, tp, ep=ep)
        self._blocks = expert_blocks(self.model)  # (ep > 1: each proc's experts)
        # A tied embedding's copy on the last stage: not a parameter of the model's own.
        self._mirrors = [] if self.pipeline is None else self.pipeline.mirrors
        # Ranks that hold different parts: checkpoints are DCP's, no rank heals another.
        self.sharded = is_sharded(self.model) or self.pipeline is not None or bool(self._blocks)
        self.optim_cfg = optim_cfg
        self.optimizer, self.scheduler = build_optimizer(self.model, optim_cfg, total_steps)
        # What a sharded trainer's checkpoint holds (its pipeline's optimizer state per
        # parameter: each stage holds other parameters).
        self._shards = ShardedState(
            self.model, self.optimizer, self._blocks, flat=self.pipeline is not None
        )
        self.loss_fn = loss_fn
        self.micro_batches = micro_batches
        self.layout = layout
        self.temperature = temperature
        # Whoever owns weights publishes them: rank 0 of replicas, every rank of shards
        # (of what tensor parallelism keeps whole on every rank: rank 0); under a
        # pipeline, each stage's proc at dp and tp coordinate 0 and every shard's.
        self._whole = self.rank == 0
        if self.pipeline is not None:
            self._whole = self.pipeline.coords[1:] == (0, 0)
        self._owns = self._whole or is_sharded(self.model) or bool(self._blocks)
        self._split, self._fp8_names = split, fp8_names
        self.shm_prefix = shm_prefix
        self.publishers: list[WeightPublisher] = []
        self._publish_in(precisions)
        self.version = 0
        self.warm_start_optimizer: torch.optim.Optimizer | None = None
        if self.world_size > 1:  # its peers may heal from it (`PeerState`)
            self.ready_to_share()

    def _publish_in(self, precisions: tuple[str, ...]) -> None:
        """One publisher per precision (each its own slots), on the ranks that own
        weights; `self.publisher` is the first (the drills write there)."""
        check_precisions(self.precision, precisions, self.model_cfg.dtype)
        for publisher in self.publishers:
            publisher.close()
        self.publishers = [
            WeightPublisher(
                self.model,
                self.shm_prefix,
                parameters=wire_source(self.served_parameters, wire, self._fp8_names),
                owns_whole=self._whole,
                placed=self._blocks,
                split=self._split,
                precision=wire,
            )
            for wire in (dict.fromkeys(precisions) if self._owns else ())
        ]
        self.publisher = self.publishers[0] if self.publishers else None

    @endpoint
    def set_precision(self, precision: str, precisions: tuple[str, ...] | None = None) -> None:
        """Compute in `precision` (`trainer.precision`) from the next call on and,
        given `precisions`, publish in those (every rank must be called: a sharded
        trainer's fp8 conversion reduces over its ranks). For tests and notebooks."""
        check_precisions(precision, precisions or (), self.model_cfg.dtype)
        self.precision = precision
        if precisions is not None:
            self._publish_in(precisions)

    def served_parameters(self):
        """(HF name, tensor) of what replicas serve: the parameters (a shard of
        each when sharded), with LoRA adapters merged in."""
        mirrors = self._mirrors
        return ((n, t) for n, t in lora.merged_parameters(self.model) if n not in mirrors)

    def _own(self, state: dict) -> dict:
        """`state` (name -> tensor) without this rank's copies of other ranks'
        parameters (`meshrl.procs.pipeline.MIRRORS`)."""
        return {k: v for k, v in state.items() if k not in self._mirrors}

    def _logprobs(self, module: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
        with compute_precision(self.precision, self.device):
            return batch_logprobs(module, batch, self.temperature, self.layout, self.routing)

    def _eval_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """`_logprobs` of the unwrapped model in eval mode, without a gradient
        (pipelined: through the stages, the last one's on every rank)."""
        self.model.eval()
        with torch.no_grad():
            if self.pipeline is None:
                logprobs = self._logprobs(self.model, batch)
            else:
                T = batch.num_completion_tokens
                with compute_precision(self.precision, self.device):
                    _, outs = self.pipeline.run(batch.input_ids, batch.attention_mask, T + 1)
                logprobs = None
                if self.pipeline.last:
                    targets = batch.input_ids[:, -T:]
                    logprobs = token_logprobs(outs[0][:, :-1], targets, self.temperature)
                last = self.pipeline.last
                logprobs = broadcast_from_last(logprobs, self.pipeline.group, last)
                logprobs = logprobs.to(self.device)
        self.model.train()
        return logprobs

    def _pipelined(self, parts: list, loss_fn: LossFn) -> tuple[torch.Tensor, dict]:
        """Forward and backward of each part through the pipeline's schedule
        (gradients accumulate); the summed loss and metrics, the last stage's on
        every rank. An empty part runs the first again with its loss times 0, as
        `backward_each` does: every data-parallel rank runs as many passes."""
        total, metrics = torch.zeros(()), {}
        pipeline = self.pipeline
        for part in parts:
            empty = len(part) == 0
            run = parts[0] if empty else part
            T = run.num_completion_tokens
            seen: list[dict] = []

            def loss_of_rows(logits, rows, run=run, T=T, seen=seen, empty=empty):
                piece = run.rows(rows)
                targets = piece.input_ids[:, -T:]
                logprobs = token_logprobs(logits[:, :-1], targets, self.temperature)
                loss, part_metrics = loss_fn(logprobs, piece)
                if empty:
                    return loss * 0
                seen.append(part_metrics)
                return loss

            with compute_precision(self.precision, self.device):
                losses, _ = pipeline.run(run.input_ids, run.attention_mask, T + 1, loss_of_rows)
            if not empty:
                total = total + sum(
                    (loss.detach().float().cpu() for loss in losses), torch.zeros(())
                )
                for part_metrics in seen:
                    for key, value in part_metrics.items():
                        metrics[key] = metrics.get(key, 0.0) + value
        sum_tied(pipeline, self.model)
        total, metrics = broadcast_from_last((total, metrics), pipeline.group, pipeline.last)
        return total, metrics

    def _loss_of(self, loss_fn: LossFn):
        """`loss_fn` of one micro-batch, its log-probs through the data-parallel module."""
        return lambda part: loss_fn(self._logprobs(self.module, part), part)

    def _step(self, batch: TrainBatch, loss_fn: LossFn, optimizer: torch.optim.Optimizer) -> dict:
        """One optimizer step on this rank's shard, `micro_batches` passes of it.
        Each pass's loss divides by the whole batch's counts (`batch.scale`), so
        the accumulated, rank-averaged gradient is the whole batch's."""
        batch = batch.apply(lambda t: t.to(self.device))
        pipeline = self.pipeline
        loss, metrics, grad_norm, skipped = accumulated_step(
            batch.split(self.micro_batches),
            self._loss_of(loss_fn),
            self.model,
            optimizer,
            self.optim_cfg.max_grad_norm,
            backward=None if pipeline is None else lambda parts: self._pipelined(parts, loss_fn),
            stages=None if pipeline is None else pipeline.group,
            local=self._blocks,
            mirrors=self._mirrors,
        )
        metrics["train/grad_norm"] = grad_norm
        metrics["train/loss"] = loss
        metrics["train/nonfinite_skipped"] = float(skipped)
        return metrics

    @endpoint
    @observed
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on this rank's shard; the version advances (also
        when a NaN or infinite loss skips the step: `train/nonfinite_skipped`)."""
        self.drill("train_step")
        metrics = self._step(batch, self.loss_fn, self.optimizer)
        metrics["train/lr"] = self.scheduler.get_last_lr()[0]
        if self.routing is not None:  # this step's forwards and the old log-probs' before it
            metrics.update(self.routing.take())
        self.scheduler.step()
        self.version += 1
        return metrics

    @endpoint
    @observed
    def warm_start_step(self, batch: TrainBatch, lr: float) -> dict[str, float]:
        """One supervised step (NLL of the completion tokens) with its own AdamW."""
        if self.warm_start_optimizer is None:
            self.warm_start_optimizer = torch.optim.AdamW(
                self.model.parameters(), lr=lr, betas=tuple(self.optim_cfg.betas)
            )
        metrics = self._step(
            batch,
            lambda logprobs, b: nll_loss(logprobs, b.completion_mask, b.scale),
            self.warm_start_optimizer,
        )
        self.version += 1
        return metrics

    @endpoint
    @observed
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, T] log-probs of the batch's completion tokens under the current
        weights, without a gradient: the old log-probs of a batch, taken before
        its first optimizer step (every rank must be called when sharded)."""
        return self._eval_logprobs(batch.apply(lambda t: t.to(self.device))).cpu()

    @endpoint
    def gradients(self, batch: TrainBatch) -> dict[str, torch.Tensor]:
        """The gradient `train_step` would take on this shard (averaged over the
        ranks, before clipping), full tensors on CPU, with no step (for
        inspection and tests; every rank must be called)."""
        batch = batch.apply(lambda t: t.to(self.device))
        pipeline = self.pipeline
        grads = accumulated_gradients(
            batch.split(self.micro_batches),
            self._loss_of(self.loss_fn),
            self.model,
            backward=None if pipeline is None else lambda p: self._pipelined(p, self.loss_fn),
        )
        grads = gather_blocks(self._own(grads), self._blocks)
        return grads if pipeline is None else gather_over(grads, pipeline.group)

    @endpoint
    def set_loss(self, loss_fn: LossFn) -> None:
        """Train with another loss from the next step on (a phase change: SFT,
        then RL; or an experiment in a notebook)."""
        self.loss_fn = loss_fn

    @endpoint
    @observed
    def eval_step(self, batch: TrainBatch) -> dict[str, float]:
        """The loss and its metrics on this rank's shard, without a gradient step
        (held-out evaluation)."""
        batch = batch.apply(lambda t: t.to(self.device))
        loss, metrics = self.loss_fn(self._eval_logprobs(batch), batch)
        metrics["eval/loss"] = loss.item()
        return metrics

    @endpoint
    @observed
    def save_state(self, directory: str) -> None:
        """This role's part of the checkpoint in `directory`: `trainer.pt` (rank 0:
        schedule and version, and model and optimizer unless sharded) and, when
        sharded, `trainer_shards/` (every rank its shards)."""
        if self.sharded:
            self._shards.save(f"{directory}/trainer_shards")
            parts = {}
        else:
            parts = {"model": self.model, "optimizer": self.optimizer}
        if self.rank == 0:
            save_state(
                f"{directory}/trainer.pt", scheduler=self.scheduler, version=self.version, **parts
            )

    @endpoint
    @observed
    def load_state(self, directory: str) -> int:
        """Every rank restores what `save_state` wrote; returns the version."""
        parts = {} if self.sharded else {"model": self.model, "optimizer": self.optimizer}
        if self.sharded:
            self._shards.load(f"{directory}/trainer_shards")
        extra = load_state(f"{directory}/trainer.pt", scheduler=self.scheduler, **parts)
        self.version = extra["version"]
        return self.version

    def peer_state(self) -> dict:
        """What a rank that replaces a lost one takes from this one (`PeerState`):
        a replicated trainer's whole state; a sharded one has no replica of it."""
        if self.sharded:
            raise ValueError(
                "a sharded trainer's ranks hold different shards: none replaces another"
            )
        warm = self.warm_start_optimizer
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "version": self.version,
            "warm_start_optimizer": None if warm is None else warm.state_dict(),
        }

    def load_peer_state(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = state["version"]
        warm = state["warm_start_optimizer"]
        if warm is not None:
            lr = warm["param_groups"][0]["lr"]
            self.warm_start_optimizer = torch.optim.AdamW(
                self.model.parameters(), lr=lr, betas=tuple(self.optim_cfg.betas)
            )
            self.warm_start_optimizer.load_state_dict(warm)

    @endpoint
    def set_lr(self, lr: float) -> None:
        """A new peak learning rate from the next step on; the schedule (warm-up,
        decay) keeps its shape around it."""
        self.scheduler.base_lrs = [lr for _ in self.scheduler.base_lrs]
        factor = self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * factor
        self.scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    @endpoint
    def set_temperature(self, temperature: float) -> None:
        """The sampling temperature the log-probs are taken at (the policy's)."""
        self.temperature = temperature

    @endpoint
    @observed
    def publish(self, verify: bool = True, delta: bool = False) -> WeightHandle | None:
        """Write the current weights, tagged with the version, where replicas pull
        them (`meshrl.weights.publisher`), with their checksums when `verify` (and with
        `delta`, which pieces changed since which version); returns
        this rank's handle, or None on a rank that owns no weights (ranks > 0
        of a replicated trainer). Merge the ranks' handles with
        `WeightHandle.merge`."""
        if self.publisher is None:
            return None
        handle = WeightHandle.merge(
            [publisher.publish(self.version, verify, delta) for publisher in self.publishers]
        )
        if self.armed("corrupt"):
            self.publisher.corrupt(self.version)
        unmerged = lora.unmerged_parameters(self.model)  # the adapters left out
        if self.armed("unmerged") and not self.publisher.overwrite(self.version, unmerged):
            raise ValueError("the unmerged drill needs LoRA adapters (model.lora.rank > 0)")
        return handle

    @endpoint
    @observed
    def save(self, path: str) -> None:
        """Rank 0: HF `save_pretrained` of model and tokenizer (every rank must be
        called when sharded: the parameters are gathered). With LoRA, per
        `model.lora.save`: the merged model in `path`, the adapter in
        `path/adapter`, or both."""
        state = None
        if self.sharded:
            state = {name: t.detach().cpu() for name, t in full_parameters(self.model)}
        if self.pipeline is not None:  # every stage's, on rank 0
            state = gather_over(self._own(state), self.pipeline.group)
        if self._blocks:  # every proc's experts
            state = gather_blocks(state, self._blocks)
        if self.rank == 0:
            save_hf(self.model, self.model_cfg, path, state)

    @endpoint
    def parameters(self) -> dict[str, torch.Tensor]:
        """A CPU copy of every full parameter, LoRA adapters merged (for
        inspection and tests; every rank must be called when sharded)."""
        if lora.is_lora(self.model):
            return {name: t.detach().cpu().clone() for name, t in self.served_parameters()}
        state = {name: t.detach().cpu().clone() for name, t in full_parameters(self.model)}
        state = gather_blocks(self._own(state), self._blocks)
        return state if self.pipeline is None else gather_over(state, self.pipeline.group)

    def __del__(self):
        for publisher in self.publishers:
            publisher.close()
        shutdown()
