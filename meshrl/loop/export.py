"""HF model directories: the final model at the end of a run, and any checkpoint
after the fact with `meshrl export PATH OUT`.

`save_hf` (`meshrl.model.hf`) writes what transformers and vLLM load.

`export_checkpoint` rebuilds the trainer's model from the run's `config.yaml`,
loads the trainer's part of a checkpoint (`trainer.pt`, or the FSDP shards in
`trainer_shards/`, gathered in this one process) and saves it with `save_hf`.
No proc is spawned and no GPU is needed.
"""

from __future__ import annotations

import os
import sys

from meshrl.config import ConfigError, ModelConfig
from meshrl.loop import checkpoint
from meshrl.model import lora
from meshrl.model.files import load_state
from meshrl.model.hf import save_hf
from meshrl.model.models import load_model
from meshrl.model.tokenizer import check_tokenizer_fits


def run_model_config(run_dir: str) -> ModelConfig:
    """The `model` section of the run's saved `config.yaml`."""
    from omegaconf import OmegaConf

    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{run_dir} has no config.yaml: not a meshrl run directory")
    raw = OmegaConf.load(path)
    if "model" not in raw:
        raise ValueError(f"{path} has no model section")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), raw.model))


def resolve(path: str) -> tuple[str, str]:
    """(checkpoint dir, run dir) for a checkpoint dir or a run dir (its newest)."""
    path = os.path.abspath(path)
    if os.path.isfile(os.path.join(path, "config.yaml")):  # a run directory
        newest = checkpoint.latest(path)
        if newest is None:
            final = os.path.join(path, "final")
            hint = (
                f"; its final model is already an HF directory: {final}"
                if os.path.isfile(os.path.join(final, "config.json"))
                else " (set checkpoint.every to write them)"
            )
            raise FileNotFoundError(f"{path} has no complete checkpoint{hint}")
        return newest, path
    if not os.path.isdir(path) or not os.path.basename(path).startswith("step_"):
        raise FileNotFoundError(f"{path} is neither a run directory nor a checkpoint (step_N)")
    return path, os.path.dirname(os.path.dirname(path))  # <run dir>/checkpoints/step_N


def export_checkpoint(path: str, out: str) -> str:
    """The trainer's model in checkpoint (or run dir) `path` as an HF directory
    at `out`; returns the checkpoint exported."""
    ckpt, run_dir = resolve(path)
    cfg = run_model_config(run_dir)
    model = load_model(cfg)
    if cfg.lora.rank:
        model = lora.wrap(model, cfg.lora)
    shards = os.path.join(ckpt, "trainer_shards")
    if os.path.isdir(shards):
        import torch.distributed.checkpoint as dcp

        # The shards hold global tensors: DCP reads them into this process's
        # full (unsharded) state dict, without a process group.
        from meshrl.procs.parallel import safe_reader

        state = {"model": model.state_dict()}
        dcp.load(state, storage_reader=safe_reader(shards))
        model.load_state_dict(state["model"])
    else:
        load_state(os.path.join(ckpt, "trainer.pt"), model=model)
    os.makedirs(out, exist_ok=True)
    save_hf(model, cfg, out)
    return ckpt


def model_source(path: str) -> str:
    """An HF directory for `model.path`: `path` itself when it is one; a run
    directory's `final/` when it has one; else a checkpoint's (or a run
    directory's newest) model, exported once into the checkpoint's `hf/`. So a
    run starts from another's output with no conversion step (SFT -> RL -> SFT)."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    final = os.path.join(path, "final")
    if os.path.isfile(os.path.join(path, "config.yaml")) and os.path.isfile(
        os.path.join(final, "config.json")
    ):
        return final
    ckpt, _ = resolve(path)
    out = os.path.join(ckpt, "hf")
    if not os.path.isfile(os.path.join(out, "config.json")):
        partial = f"{out}.partial-{os.getpid()}"  # renamed into place once written
        export_checkpoint(ckpt, partial)
        os.replace(partial, out)
    return out


def start_from(model: ModelConfig, key: str) -> None:
    """Point `model.path` at an HF directory when it names another run's output
    (its `final/`, or a checkpoint exported once: `model_source`)."""
    if model.path is None:
        return
    try:
        model.path = model_source(model.path)
    except (OSError, ValueError, checkpoint.CheckpointError) as error:
        raise ConfigError(f"config key '{key}': {error}") from None
    model.validate(key.rsplit(".", 1)[0])
    check_tokenizer_fits(model, key.rsplit(".", 1)[0])  # the tokenizer of what it resolved to


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or any(a.startswith("-") for a in args):
        print("usage: meshrl export CHECKPOINT_OR_RUN_DIR OUT_DIR", file=sys.stderr)
        return 2
    try:
        ckpt = export_checkpoint(args[0], args[1])
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"exported {ckpt} to {os.path.abspath(args[1])}")
    return 0
