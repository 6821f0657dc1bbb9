"""Tensor parallelism of a HF decoder over a trainer's procs, with DTensor.

The plan is the model's own: transformers ships, in each config, which linear
layers split by output features (`colwise`) and which by input features
(`rowwise`); meshrl applies it with torch's `ColwiseParallel` and
`RowwiseParallel` over the `tp` dim of the trainer's device mesh. Qwen3's
per-head q/k norms (`replicated_with_grad_allreduce`) run on each rank's heads
as DTensors, so their weight's gradient is summed over the tp ranks. The
embeddings, norms and head stay whole on every rank.

A layer that is not an `nn.Linear` but splits itself the same way
(`split_tensor_parallel(mesh, style)`: an FP8 replica's `Fp8Linear`) is handed
its style instead.

Architectures whose plan holds anything else (fused or packed projections,
experts) or that have none are refused, naming the key; so are head counts
that the tp degree does not divide.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from typing import Any

import torch

from meshrl.config import PlacementConfig
from meshrl.config.files import check

SUPPORTED = {"colwise", "rowwise", "replicated_with_grad_allreduce"}
"""HF tp-plan entries meshrl applies."""


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def refusal(config, tp: int, key: str = "placement.tp") -> str | None:
    """Why a model of `config` cannot be split over `tp` ranks (None: it can)."""
    text = _text_config(config)
    plan = getattr(text, "base_model_tp_plan", None) or {}
    kind = getattr(text, "model_type", "?")
    if getattr(config, "vision_config", None) is not None:
        return (
            f"{key}: vision-language models ({config.model_type}) are not split (text models only)"
        )
    if not plan:
        return f"{key}: model type '{kind}' has no tensor-parallel plan (llama, mistral, qwen2, qwen3 and gemma2 have)"
    other = sorted({style for style in plan.values() if style not in SUPPORTED})
    if other:
        return f"{key}: model type '{kind}' splits layers as {', '.join(other)}, which meshrl does not apply (dense llama, mistral, qwen2, qwen3 and gemma2 blocks only)"
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(text, field, None)
        if heads is not None and heads % tp:
            return f"{key}={tp} does not divide the model's {field} ({heads})"
    return None


def check_placement(placement: PlacementConfig, config) -> None:
    """`placement`'s tensor parallelism against a model of HF `config`: the
    trainer's (`sharding` tp or fsdp_tp) and each policy replica's (`policy_tp`).
    A `ConfigError` naming the key where the model's layers cannot be split."""
    checks = []  # (the key the error names, its words' prefix, the key refused, tp degree)
    if placement.policy_tp > 1:
        checks.append(("placement.policy_tp", "", "placement.policy_tp", placement.policy_tp))
    if placement.trainer_tp > 1:
        key = "placement.trainer" if placement.sharding == "tp" else "placement.tp"
        checks.append(("placement.sharding", f"{placement.sharding}: ", key, placement.trainer_tp))
    for where, prefix, key, tp in checks:
        why = refusal(config, tp, key)
        check(why is None, where, f"{prefix}{why}")


def module_styles(model: torch.nn.Module) -> dict[str, str]:
    """Qualified module name -> its HF tp style, for every module the plan names."""
    text = _text_config(model.config)
    plan = getattr(text, "base_model_tp_plan", None) or {}
    base = model.base_model
    prefix = next(name for name, module in model.named_modules() if module is base)
    styles = {}
    for name, _ in base.named_modules():
        for pattern, style in plan.items():
            if name and fnmatch.fnmatchcase(name, pattern):
                styles[f"{prefix}.{name}" if prefix else name] = style
    return styles


def parameter_styles(model: torch.nn.Module) -> dict[str, str]:
    """Parameter name -> its split in the reshard plan (`meshrl.procs.reshard`):
    colwise (dim 0), rowwise (dim 1) or replicate."""
    modules = module_styles(model)
    out = {}
    for name, param in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        style = modules.get(owner)
        if style == "colwise":
            out[name] = "colwise"
        elif style == "rowwise" and leaf == "weight" and param.dim() == 2:
            out[name] = "rowwise"
        else:
            out[name] = "replicate"
    return out


def tensor_parallel(model: torch.nn.Module, mesh) -> None:
    """Split `model`'s planned layers over the 1-D device mesh `mesh` in place."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    why = refusal(model.config, mesh.size())
    if why:
        raise ValueError(why)
    make = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        # [batch, tokens, heads, head_dim]: each rank normalises its own heads.
        "replicated_with_grad_allreduce": lambda: SequenceParallel(
            sequence_dim=2, use_local_output=True
        ),
    }
    plan = {}
    for name, style in module_styles(model).items():
        module = model.get_submodule(name)
        # A layer torch's plans do not take (an FP8 one: meshrl.weights.precision)
        # splits itself, with the same inputs and outputs as theirs.
        split = getattr(module, "split_tensor_parallel", None)
        if split is not None:
            split(mesh, style)
        else:
            plan[name] = make[style]()
    parallelize_module(model, mesh, plan)


def _groups(parameters: Iterable[torch.nn.Parameter]) -> list[list[torch.Tensor]]:
    """The gradients of `parameters` grouped by kind: plain tensors, and DTensors
    of one mesh and placement (torch's foreach ops take one kind at a time)."""
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    for param in parameters:
        grad = param.grad
        if grad is not None:
            key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
            groups.setdefault(key, []).append(grad)
    return list(groups.values())


def grad_norm(parameters: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """The 2-norm of all gradients, as a plain tensor, for parameters that mix
    plain tensors and DTensors on several meshes (a tensor-parallel model,
    FSDP2 over it): each group of one mesh and placement is reduced by torch,
    then the groups' squares add up. Every rank must call it."""
    from torch.distributed.tensor import DTensor

    total = None
    for grads in _groups(parameters):
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        square = norm.float() ** 2
        total = square if total is None else total + square.to(total.device)
    return torch.zeros(()) if total is None else total.sqrt()


def clip_gradients(
    parameters: list,
    max_norm: float | None,
    stages: Any = None,
    local: list = (),
    copies: list = (),
) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for parameters of several meshes
    (`grad_norm`), with `stages` (a pipeline's process group: each rank holds
    other parameters) of every stage, and with `local` (parameters each rank
    holds a different part of by hand: expert parallelism's experts) of every
    rank's; `copies` (of other ranks' parameters) are clipped but not counted.
    Returns the norm before clipping."""
    import torch.distributed as dist

    squared = grad_norm(parameters).detach().double().cpu().reshape(1) ** 2
    if local:
        mine = grad_norm(local).detach().double().cpu().reshape(1) ** 2
        dist.all_reduce(mine)
        squared = squared + mine
    if stages is not None:
        dist.all_reduce(squared, group=stages)
    norm = squared.sqrt().float().reshape(())
    if max_norm is not None and torch.isfinite(norm):
        coef = float(max_norm) / (float(norm) + 1e-6)
        if coef < 1.0:
            for grads in _groups([*parameters, *local, *copies]):
                torch._foreach_mul_(grads, coef)
    return norm
