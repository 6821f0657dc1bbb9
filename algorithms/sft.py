"""SFT: supervised fine-tuning on the trainer mesh, as an algorithm of its own.

A dataset of prompt/completion pairs or chat conversations (`meshrl.envs.sft_data`:
the chat template, the loss on the assistant's tokens only) is tokenized once
on the controller and split into train and held-out rows. Each step takes
`batch_size` train rows and the trainer mesh takes one optimizer step of their
token-mean NLL (data-parallel, DDP or FSDP2; the mean is over the step's
assistant tokens at any placement). Every `eval.every` steps the held-out rows
give `eval/nll`. A run has the same trainer, checkpoints, exact resume,
metrics and HF export (`final/`) as the RL algorithms.

Chain runs by path, with no conversion: `model.path` may name another run's
directory (its `final/`, else its newest checkpoint) or one of its
checkpoints, for SFT -> RL -> SFT:
    python -m algorithms.sft --config algorithms/configs/sft.yaml run.name=sft
    python -m algorithms.grpo --config algorithms/configs/grpo_default.yaml \
        model.path=runs/sft warm_start.steps=0

In Python: `SFT(load_config(SFTConfig, "algorithms/configs/sft.yaml")).run()`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from algorithms.base import Algorithm, run_main
from algorithms.dpo import SHIPPED_PREFERENCES
from algorithms.rl_config import OfflineConfig
from meshrl.config import (
    ConfigError,
)
from meshrl.envs.dataset import DatasetError
from meshrl.envs.sft_data import Example, load_examples
from meshrl.loop.checkpoint import Checkpointer
from meshrl.loop.run import Run
from meshrl.loop.steplog import StepLog, add_evaluation
from meshrl.loop.supervised import supervised_batch
from meshrl.loop.supervisor import RoleLost, Supervisor
from meshrl.loop.weight_sync import WeightSync
from meshrl.model.losses import nll_loss
from meshrl.types import TrainBatch


@dataclass
class SFTDataConfig:
    path: str = SHIPPED_PREFERENCES
    """A .jsonl or .parquet file, or a datasets `save_to_disk` directory, of
    conversations or prompt/completion pairs (meshrl/envs/sft_data.py)."""
    prompt_field: str = "prompt"
    """The field of a pair's prompt."""
    completion_field: str = "completion"
    """The field of a pair's completion (the shipped file's: `chosen`)."""
    messages_field: str = "messages"
    """The field of a conversation: a list of {role, content}."""
    eval_fraction: float = 0.1
    """Share of the rows held out for `eval/nll`."""

    def validate(self) -> None:
        if not 0 <= self.eval_fraction < 1:
            raise ConfigError("config key 'data.eval_fraction': must be in [0, 1)")


@dataclass
class SFTConfig(OfflineConfig):
    data: SFTDataConfig = field(default_factory=SFTDataConfig)

    ALGORITHM: ClassVar[str] = "SFT"
    MOVED: ClassVar[dict[str, str]] = {
        **OfflineConfig.MOVED,
        "micro_batches": "trainer.micro_batches",
    }


class SFT(Algorithm):
    name = "sft"
    elastic = ()  # no pools that grow and shrink (`scale` says so)
    headline = "loss/nll"

    def run(self, num_steps: int | None = None) -> list[dict]:
        """Spawn the trainer mesh (first call), train `num_steps` more steps (None:
        to `cfg.steps`, then save the model and stop every proc)."""

        cfg, state = self.cfg, self.state
        with self.running(num_steps):  # an error: `failed`; a whole run: `stop()` at its end
            if self.meshes is None:  # --- one mesh: the trainer ---
                self.load_data()
                procs = {"trainer": cfg.placement.trainer}
                run = self.meshes = Run(cfg, self.name, procs, trains=("trainer",))
                self.trainer = self.spawn_trainer(run)
                self.sup = Supervisor(run, cfg.faults, state)
                self.sync = WeightSync(self.sup)
                self.heal_from_peers(self.trainer, self.sync)
                self.ckpt = Checkpointer(run, state, [self.trainer], cfg.checkpoint)
                self.ckpt.resume()
                self.log = StepLog(run, cfg.steps, state.step, self.headline)
                self.before = self.evaluate()
            run, sup, log = self.meshes, self.sup, self.log
            # Ctrl-C or SIGTERM: stop after the step under way; the drills and pool sizes
            # due before each step; its count and the checkpoints due after it (`Steps`).
            with self.steps(num_steps) as steps:
                for step in steps:
                    with log.timer("step"):
                        rows = state.next_items(len(self.train), cfg.batch_size)
                        batch = self.batch([self.train[i] for i in rows])
                        try:  # each trainer rank steps on its block of rows
                            metrics = sup.call_sharded(self.trainer, "train_step", batch)
                        except RoleLost as lost:  # no peer to heal from: to a checkpoint
                            self.ckpt.rewind(lost, sup, log, 0)
                            continue
                    record = {
                        "step": step,
                        **metrics,
                        "tokens/trained": int(batch.completion_mask.sum()),
                        **sup.metrics(),
                    }
                    add_evaluation(
                        record, step, cfg.eval.every, cfg.steps, self.before, self.evaluate
                    )
                    self.record_step(step, record)
        return self.log.history

    def loss(self, logprobs: torch.Tensor, batch: TrainBatch) -> tuple[torch.Tensor, dict]:
        """Runs on every trainer proc: the mean NLL of the step's assistant tokens."""
        return nll_loss(logprobs, batch.completion_mask, batch.scale)

    # --- data -------------------------------------------------------------------------

    def load_data(self) -> None:
        """Every row tokenized, then a seeded split into train and held-out rows."""
        cfg = self.cfg.data
        fields = (cfg.prompt_field, cfg.completion_field, cfg.messages_field)
        try:
            examples = load_examples(cfg.path, self.tokenizer, fields, self.context)
        except DatasetError as error:
            raise ConfigError(str(error)) from None
        order = list(range(len(examples)))
        random.Random(self.cfg.run.seed).shuffle(order)
        held = round(len(examples) * cfg.eval_fraction)
        self.train = [examples[i] for i in order[: len(order) - held]]
        self.held_out = [examples[i] for i in order[len(order) - held :]]
        if not self.train:
            raise ConfigError(
                f"config key 'data.eval_fraction': no rows of {cfg.path} are left to train on"
            )

    def batch(self, examples: list[Example]) -> TrainBatch:
        return supervised_batch(
            [e.prompt for e in examples],
            [e.target for e in examples],
            self.tokenizer.pad_token_id,
            [e.counted for e in examples],
        )

    def evaluate(self) -> dict[str, float]:
        """The mean NLL of the held-out rows' assistant tokens (no update)."""
        if not self.held_out:
            return {}
        metrics = self.sup.call_sharded(self.trainer, "eval_step", self.batch(self.held_out))
        return {"eval/nll": metrics["loss/nll"]}


if __name__ == "__main__":
    run_main(SFT, SFTConfig)
