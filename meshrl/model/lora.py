"""LoRA on the trainer, through peft.

`wrap` freezes the model and adds adapters to the configured linear layers;
only the adapters train. Everything outside the trainer sees plain HF
weights: `merged_parameters` folds each adapter into its layer's weight
(W + alpha/r * B @ A) under the HF names, and that is what the trainer
publishes to the replicas and the reference and what a merged export holds.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from meshrl.config import LoraConfig
from meshrl.model.models import seeded_init

ADAPTER = "default"  # peft's name for the one adapter meshrl trains


def wrap(
    model: torch.nn.Module, cfg: LoraConfig, seed: int = 0, exclude: str | None = None
) -> torch.nn.Module:
    """`model` with LoRA adapters (peft `PeftModel`); the base weights frozen.
    `exclude`: a regex of module names that get none (a frozen vision tower)."""
    import peft

    peft_cfg = peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        exclude_modules=exclude,
        bias="none",
    )
    with seeded_init(seed):  # the adapters' init, the same on every rank
        try:
            return peft.get_peft_model(model, peft_cfg)
        except ValueError as error:  # e.g. no module matches target_modules
            raise ValueError(f"model.lora: {str(error).splitlines()[0]}") from None


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


@torch.no_grad()
def merged_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of every weight of the base model with the adapters
    folded in; a model without adapters gives its own parameters."""
    if not is_lora(model):
        yield from model.named_parameters()
        return
    base = model.get_base_model()
    modules = dict(base.named_modules())
    for name, param in base.named_parameters():
        if ".lora_" in name:
            continue
        if ".base_layer." not in name:
            yield name, param
            continue
        owner, leaf = name.split(".base_layer.")
        layer = modules[owner]
        if leaf == "weight" and ADAPTER in getattr(layer, "lora_A", {}):
            yield f"{owner}.{leaf}", param + layer.get_delta_weight(ADAPTER).to(param.dtype)
        else:
            yield f"{owner}.{leaf}", param


def unmerged_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, base weight) of every adapted weight, without its adapter: what a
    replica would serve if the merge did not happen (the `unmerged` drill)."""
    if not is_lora(model):
        return
    base = model.get_base_model()
    modules = dict(base.named_modules())
    for name, param in base.named_parameters():
        if ".base_layer." in name:
            owner, leaf = name.split(".base_layer.")
            if leaf == "weight" and ADAPTER in getattr(modules[owner], "lora_A", {}):
                yield f"{owner}.{leaf}", param
