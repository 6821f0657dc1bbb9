"""Pipeline parallelism of a HF decoder over a trainer's procs, with torch's
`torch.distributed.pipelining` (`PipelineStage` and its schedules).

The decoder's layers are split into contiguous stages (`reshard.stage_layers`:
the earlier stages take the extra layer); stage 0 also holds the embedding, the
last stage the final norm and the output head. With an interleaved schedule each
pipeline rank holds `virtual` stages, loop style (virtual stage k on rank
k % pp). Each rank keeps the model object it built (every rank builds the same
one from the seed) pruned to what it holds, so its parameters keep their HF
names (`model.layers.7.mlp.up_proj.weight` on the rank that holds layer 7):
publishing, checkpoints (torch.distributed.checkpoint), gradients and exports
need no renaming.

A stage runs the model's own forward (its mask and rotary embedding code) over
its layers only: it takes the token ids (stage 0) or the hidden states, with the
attention mask passed along beside them, so every stage computes the positions
and the mask the unsplit model computes. The last stage returns the logits of
the completion's positions; the schedule's loss function turns a micro-batch's
logits into log-probs and calls the algorithm's loss on that micro-batch's rows,
which it finds by their row numbers (the schedule splits a tensor of row numbers
as it splits the inputs). The losses divide by the whole batch's counts
(`meshrl.model.losses.LossScale`), so the schedule does not scale the gradients
again (`scale_grads=False`): the micro-batches' gradients add up to the batch's.

Architectures: those whose forward is embedding -> decoder layers -> norm ->
head with nothing else between (`PIPELINED`); a model that scales its
embeddings or adds learned positions in its forward (Gemma, GPT-2) is refused,
Tied input and output embeddings (Qwen2/3's small sizes) are held twice, as
Megatron-LM holds them: stage 0's embedding and, on the last stage, a copy of
it as the head (`MIRRORS`), their gradients summed over the two procs after
each backward (`Pipeline.sum_tied`), so both take the same step and stay
equal; the copy is left out of the gradient norm, of publishing and of
exports (the one parameter is stage 0's).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

from meshrl.config.trainer import PP_SCHEDULES as SCHEDULES
from meshrl.procs.reshard import pipeline_rank, stage_layers

PIPELINED = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
"""HF model types whose forward is embedding -> layers -> norm -> head."""


def check_pipeline(hf_config: Any, pp: int, virtual: int = 1) -> str | None:
    """Why a model of `hf_config` cannot be split into `pp` x `virtual` stages,
    in one line (None: it can)."""
    kind = getattr(hf_config, "model_type", "?")
    if kind not in PIPELINED:
        return f"model type '{kind}' is not one of {', '.join(PIPELINED)}"
    layers = hf_config.num_hidden_layers
    if layers < pp * virtual:
        return f"{layers} layers cannot make {pp * virtual} stages"
    return None


MIRRORS = ("lm_head.weight",)
"""The last stage's copy of a tied embedding (`prune`): a parameter of its own there."""


def check_placement(placement: Any, config: Any, trainer: Any = None) -> None:
    """`placement`'s pipeline stages against a model of HF `config` (and the
    `trainer:` section's schedule and routing replay): a `ConfigError` naming the
    key where the model cannot be split so."""
    from meshrl.config.files import check

    if placement.trainer_pp == 1:
        return
    interleaved = trainer is not None and trainer.pp_schedule == "interleaved"
    why = check_pipeline(config, placement.trainer_pp, 2 if interleaved else 1)
    alone = check_pipeline(config, placement.trainer_pp) is None  # (2 stages a proc: too many)
    key = "trainer.pp_schedule" if why and alone else "placement.sharding"
    check(why is None, key, f"{placement.sharding}: {why}")
    if trainer is not None:
        check(
            not trainer.routing_replay,
            "trainer.routing_replay",
            f"routing replay does not run across pipeline stages ({placement.sharding})",
        )


class KeyedLayers(torch.nn.ModuleList):
    """A `ModuleList` of some of a model's decoder layers, named by their index in
    the whole model (`layers.7`), so its parameters keep their HF names; iterating
    and slicing give the layers in order, as the model's forward expects."""

    def __init__(self, layers: dict[int, torch.nn.Module] | list | None = None):
        super().__init__()
        if not isinstance(layers, dict):  # a slice (the model's forward takes one)
            layers = dict(enumerate(layers or []))
        for index, layer in sorted(layers.items()):
            self._modules[str(index)] = layer


class Stage(torch.nn.Module):
    """One stage: the model's backbone over `layers` (with the embedding on the
    first stage, the norm and head on the last). forward(x, mask): `x` is token ids
    [B, L] (first stage) or hidden states [B, L, H]; returns (hidden, mask), or on
    the last stage the logits of the last `keep` positions (all when 0)."""

    def __init__(self, lm: torch.nn.Module, layers: range, first: bool, last: bool, positions: Any):
        """`positions(mask)`: the position ids of rows under `mask` (left padding
        skipped), as the unsplit model's forward is given them."""
        super().__init__()
        self.positions = positions
        whole = lm.model
        base = copy.copy(whole)  # its own children, sharing every module it keeps
        base._modules = dict(whole._modules)
        base._parameters = dict(whole._parameters)
        base._buffers = dict(whole._buffers)
        base.config = config = copy.copy(whole.config)
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = [config.layer_types[i] for i in layers]
        config.num_hidden_layers = len(layers)
        base.layers = KeyedLayers({i: whole.layers[i] for i in layers})
        if not first:
            base.embed_tokens = None
        if not last:
            base.norm = torch.nn.Identity()
        self.base, self.first, self.last = base, first, last
        self.head = lm.lm_head if last else None
        self.keep = 0  # the positions the loss needs (set per batch: `Pipeline.run`)

    def forward(self, x: torch.Tensor, mask: torch.Tensor):
        ids = {"input_ids": x} if self.first else {"inputs_embeds": x}
        hidden = self.base(
            **ids,
            attention_mask=mask,
            position_ids=self.positions(mask),
            use_cache=False,
        ).last_hidden_state
        if not self.last:
            return hidden, mask
        if self.keep:
            hidden = hidden[:, -self.keep :]
        return self.head(hidden)


def prune(
    lm: torch.nn.Module, pp: int, rank: int, virtual: int, positions: Any
) -> tuple[list[Stage], list[int]]:
    """Cut `lm` (a HF causal LM) down, in place, to what pipeline rank `rank` of
    `pp` holds, and build its stages; returns them and their stage indices (of
    `pp * virtual`). `positions`: as `Stage` takes it."""
    count = pp * virtual
    ranges = stage_layers(lm.config.num_hidden_layers, count)
    mine = [k for k in range(count) if pipeline_rank(k, pp, virtual) == rank]
    stages = [Stage(lm, ranges[k], k == 0, k == count - 1, positions) for k in mine]
    held = {i: lm.model.layers[i] for k in mine for i in ranges[k]}
    lm.model.layers = KeyedLayers(held)
    if 0 not in mine:
        del lm.model.embed_tokens
    if count - 1 not in mine:
        del lm.model.norm
        del lm.lm_head
    elif 0 not in mine and getattr(lm.config, "tie_word_embeddings", False):
        # The head is stage 0's embedding: a copy of it here (`MIRRORS`).
        lm.lm_head.weight = torch.nn.Parameter(lm.lm_head.weight.detach().clone())
    return stages, mine


class Pipeline:
    """A rank's stages (each wrapped for data parallelism as the layout says) run
    by a schedule of `torch.distributed.pipelining` over the pipeline's `group`.
    Stages and schedule are built again for each new batch shape (the stages
    infer their buffers' shapes from their first micro-batch)."""

    def __init__(
        self,
        modules: list[torch.nn.Module],
        indices: list[int],
        count: int,
        device: torch.device,
        group: Any,
        schedule: str = "1f1b",
        microbatches: int = 2,
        coords: tuple[int, int, int] = (0, 0, 0),
        tie_group: Any = None,
    ):
        """`coords`: this rank's (pipeline rank, dp, tp) coordinates; `tie_group`:
        the process group of this pipeline's first and last ranks, when the model
        ties its embeddings and this rank is one of them."""
        if schedule not in SCHEDULES:
            raise ValueError(f"'{schedule}' is not one of {', '.join(SCHEDULES)}")
        self.modules, self.indices, self.count = modules, indices, count
        self.device, self.group, self.kind = device, group, schedule
        self.microbatches = microbatches
        self.coords = coords
        self.tie_group = tie_group
        self.mirrors = list(MIRRORS) if tie_group is not None and 0 not in indices else []
        """This rank's copies of a tied parameter (left out of the norm, publishing
        and exports)."""
        self.pp = dist.get_world_size(group)
        self.last = count - 1 in indices
        self.first = 0 in indices
        self._built: dict[tuple, Any] = {}
        self.inferring = False

    def _schedule(self, shape: tuple, loss_fn: Any, n: int) -> Any:
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import (
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        key = (shape, n, loss_fn is None)
        if key not in self._built:
            stages = [
                PipelineStage(module, index, self.count, self.device, group=self.group)
                for module, index in zip(self.modules, self.indices, strict=True)
            ]
            if self.kind == "interleaved":
                built = ScheduleInterleaved1F1B(stages, n, loss_fn=loss_fn, scale_grads=False)
            else:
                kind = ScheduleGPipe if self.kind == "gpipe" else Schedule1F1B
                built = kind(stages[0], n, loss_fn=loss_fn, scale_grads=False)
            self._built = {key: built}  # one shape at a time: the last batch's
            # Its first step infers the stages' shapes, running each stage once on
            # placeholder inputs and the loss on their outputs: that call is no
            # micro-batch's (`run` answers it with a loss of 0).
            self.inferring = loss_fn is not None
        schedule = self._built[key]
        schedule._loss_fn = loss_fn
        return schedule

    def _stage_modules(self):
        for module in self.modules:
            yield getattr(module, "module", module)  # under DDP: the stage itself

    def run(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        keep: int,
        loss_of_rows: Any = None,
    ) -> tuple[list, list]:
        """The pipeline over one batch (every rank of the pipeline the same rows):
        with `loss_of_rows(logits, rows)` (last stage: a micro-batch's logits and
        its row numbers -> its loss), forward and backward of every micro-batch
        (gradients accumulate); without, forward only. Returns, on the last stage,
        the micro-batches' losses (training) or the logits of every row, in order
        (forward only); elsewhere empty lists. A batch of fewer rows than
        micro-batches runs in as many micro-batches as it has rows (never fewer than
        the stages); rows that do not split evenly are made up to a multiple of the
        micro-batches with the last row repeated, left out of every loss (each
        micro-batch has one shape, which the stages' buffers take)."""
        rows = len(input_ids)
        floor = self.pp if self.kind != "gpipe" else 1
        n = max(min(self.microbatches, rows), floor)
        index = torch.arange(-(-max(rows, n) // n) * n, device=input_ids.device)
        taken = index.clamp(max=rows - 1)
        ids, mask = input_ids[taken], attention_mask[taken]
        for stage in self._stage_modules():
            stage.keep = keep
        losses: list = []
        if loss_of_rows is not None:

            def loss_fn(logits: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
                real = chunk < rows
                if self.inferring or not bool(real.any()):
                    self.inferring = False
                    return logits.float().sum() * 0
                if bool(real.all()):
                    return loss_of_rows(logits, chunk)
                return loss_of_rows(logits[real], chunk[real])

            schedule = self._schedule(tuple(ids.shape), loss_fn, n)
            args = (ids, mask) if self.first else ()
            schedule.step(*args, target=index if self.last else None, losses=losses)
            return losses, []
        schedule = self._schedule(tuple(ids.shape), None, n)
        with torch.no_grad():
            out = schedule.eval(*((ids, mask) if self.first else ()))
        if self.last:
            return [], [out[:rows]]
        return [], []


def sum_tied(pipeline: Pipeline, model: torch.nn.Module) -> None:
    """A tied embedding's gradient: stage 0's and the last stage's copy's, summed
    on both (each rank its FSDP2 block of it: the two are split alike)."""
    if pipeline.tie_group is None:
        return
    named = dict(model.named_parameters())
    param = named["model.embed_tokens.weight" if pipeline.first else MIRRORS[0]]
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    grad = param.grad
    dist.all_reduce(
        grad.to_local() if hasattr(grad, "to_local") else grad, group=pipeline.tie_group
    )


def broadcast_from_last(value: Any, group: Any, last: bool) -> Any:
    """`value` of the pipeline's last rank, on every rank of `group` (a tensor
    or any picklable value)."""
    size = dist.get_world_size(group)
    box = [value if last else None]
    dist.broadcast_object_list(box, group=group, group_src=size - 1)
    return box[0]


def gather_over(state: dict, group: Any) -> dict:
    """The union of every rank's `state` (name -> tensor) over `group` (a
    pipeline's ranks: each its stages' parameters), on every rank of it."""
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, state, group=group)
    merged: dict = {}
    for part in parts:
        merged.update(part)
    return merged
