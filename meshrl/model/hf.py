"""HF model directories: what transformers and vLLM load (`save_pretrained`:
safetensors, config, tokenizer), written by `save_hf` for the trainer's final
model and for `meshrl export` (`meshrl.loop.export`). With LoRA,
`model.lora.save` picks the merged model (a plain HF model), the peft adapter in
`OUT/adapter`, or both.
"""

from __future__ import annotations

import os

import torch

from meshrl.config import ModelConfig
from meshrl.model import lora
from meshrl.model.tokenizer import load_processor, load_tokenizer


def save_hf(model: torch.nn.Module, model_cfg: ModelConfig, path: str, state=None) -> None:
    """`model` (with `state`, a full state dict, when its own parameters are
    shards) and the tokenizer as an HF directory at `path`, committed whole: it
    is written under a temporary name and renamed, so a full disk or a crash
    leaves no `path` without weights (`model.path` would take it). The directory
    is its user's only (mode 0700), whatever the umask. A write that fails is one
    OSError naming `path`."""
    import errno
    import shutil

    partial = f"{path}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(partial)), exist_ok=True)
        os.mkdir(partial, 0o700)  # its user's only, whatever the umask (a run's `final/`)
        _write_hf(model, model_cfg, partial, state)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(partial, path)
    except Exception as error:
        shutil.rmtree(partial, ignore_errors=True)
        # safetensors reports a failed write as its own error type, with the OS's words.
        words = str(error).strip().splitlines()[0] if str(error).strip() else ""
        if not isinstance(error, OSError) and "os error" not in words:
            raise
        reason = getattr(error, "strerror", None) or words.rsplit("I/O error: ", 1)[-1]
        code = getattr(error, "errno", None) or errno.EIO
        raise OSError(code, f"cannot write the model to {path}: {reason}") from None


def _write_hf(model: torch.nn.Module, model_cfg: ModelConfig, path: str, state=None) -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # keep the console to the run's own bar
    (load_processor(model_cfg) or load_tokenizer(model_cfg)).save_pretrained(path)
    if not lora.is_lora(model):
        model.save_pretrained(path, state_dict=state)
        return
    save = model_cfg.lora.save
    if save in ("merged", "both"):  # a plain HF model: transformers and vLLM load it
        merged = {name: t.detach().cpu().clone() for name, t in lora.merged_parameters(model)}
        model.get_base_model().save_pretrained(path, state_dict=merged)
    if save in ("adapter", "both"):  # peft's files, on top of the base model
        model.save_pretrained(f"{path}/adapter")
