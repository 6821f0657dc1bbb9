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

import os
import random
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from algorithms.base import Algorithm, Loss, run_main
from algorithms.rl_config import OfflineConfig
from algorithms.roles import heal_trainer, restore_frozen, spawn_trainer
from meshrl.config import (
    ConfigError,
)
from meshrl.envs.dataset import DatasetError
from meshrl.envs.sft_data import Example, load_examples
from meshrl.loop.checkpoint import Checkpointer
from meshrl.loop.run import Role, Run
from meshrl.loop.steplog import StepLog, add_evaluation
from meshrl.loop.supervised import supervised_batch
from meshrl.loop.supervisor import RoleLost, Supervisor
from meshrl.loop.weight_sync import WeightSync
from meshrl.model.losses import nll_loss
from meshrl.types import TrainBatch

SHIPPED_PREFERENCES = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "meshrl",
    "envs",
    "data",
    "reverse_digits_preferences.jsonl",
)
"""The preference pairs the repository ships (DPO's default; SFT's, on `chosen`)."""


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


class SFTLoss(Loss):
    """Runs on every trainer proc: the mean NLL of the step's assistant tokens."""

    def __call__(self, logprobs: torch.Tensor, batch: TrainBatch) -> tuple[torch.Tensor, dict]:
        return nll_loss(logprobs, batch.completion_mask, batch.scale)


class SFT(Algorithm):
    """The offline loop: a trainer mesh, and a frozen reference where an algorithm
    spawns one (`spawn_reference`: DPO's). SFT's hooks make it SFT; DPO (dpo.py)
    runs the same loop with its pairs, its reference and its loss."""

    name = "sft"
    headline = "loss/nll"
    Loss = SFTLoss

    def __init__(self, cfg: OfflineConfig):
        super().__init__(cfg)
        self.reference: Role | None = None

    def run(self, num_steps: int | None = None) -> list[dict]:
        """Spawn the meshes (first call), train `num_steps` more steps (None: to
        `cfg.steps`, then save the model and stop every proc)."""
        cfg, state = self.cfg, self.state
        with self.running(num_steps):  # an error: `failed`; a whole run: `stop()` at its end
            if self.runtime is None:  # --- the meshes: the trainer (and a frozen reference) ---
                self.load_data()  # before any proc: a bad file costs no spawn
                run = self.runtime = Run(cfg, self.name, self.placement(), trains=("trainer",))
                self.reference = reference = self.spawn_reference(run)
                full = reference is not None  # it pulls the trainer's weights whole
                self.trainer = trainer = spawn_trainer(
                    run, cfg, self.make_loss(), full_readers=full, replicas=False
                )
                self.sup = sup = Supervisor(run, cfg.faults, state)
                self.sync = WeightSync(sup)
                heal_trainer(sup, cfg, trainer, self.sync)
                self.ckpt = Checkpointer(run, state, [trainer, reference], cfg.checkpoint)
                if reference is not None:  # its copy: from the newest checkpoint
                    sup.on_respawn(
                        reference.name, lambda: restore_frozen(sup, self.ckpt, reference)
                    )
                self.start()  # a checkpoint's state, or the warm start and the copy
            run, sup, log, reference = self.runtime, self.sup, self.log, self.reference
            # Ctrl-C or SIGTERM: stop after the step under way; the drills and pool sizes
            # due before each step; its count and the checkpoints due after it (`Steps`).
            with self.steps(num_steps) as steps:
                for step in steps:
                    with log.timer("step"):
                        batch = self.next_batch()
                        if reference is not None:  # its log-probs, rows split over its procs
                            batch.ref_logprobs = sup.call_rows(reference, "logprobs", batch)
                        try:  # each trainer rank steps on its rows (`train_on`)
                            metrics = self.train_on(batch, "train_step")
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

    def start(self) -> None:
        """The state step 0 starts from: a checkpoint's (`checkpoint.resume`), or else
        the warm start and the reference's copy of its result (published by the
        trainer, pulled by the reference: shared memory on this host, RDMA across);
        then the step log and the held-out figures before training."""
        if self.ckpt.resume() is None:
            self.warm_start()
            if self.reference is not None:
                handle = self.sync.publish(self.trainer)
                self.sup.call_all(self.reference, "load_weights", handle)
        self.log = StepLog(self.runtime, self.cfg.steps, self.state.step, self.headline)
        self.before = self.evaluate()

    # --- hooks ------------------------------------------------------------------------

    def placement(self) -> dict[str, int]:
        """Procs per role."""
        return {"trainer": self.cfg.placement.trainer}

    def spawn_reference(self, run: Run) -> Role | None:
        """A frozen copy of the starting weights whose log-probs each batch carries
        (DPO's); none here."""
        return None

    def warm_start(self) -> None:
        """Steps before the first (DPO's on the chosen responses); none here."""

    def next_batch(self) -> TrainBatch:
        """The next `batch_size` train rows: shuffled passes over the split (the
        position is in the `LoopState`, so a resumed run goes on where it was)."""
        rows = self.state.next_items(len(self.train), self.cfg.batch_size)
        return self.batch([self.train[i] for i in rows])

    def train_on(self, batch: TrainBatch, endpoint: str) -> dict[str, float]:
        """`endpoint` (`train_step`, `eval_step`) on every trainer rank, each on its
        block of rows; the metrics averaged over the ranks."""
        return self.sup.call_sharded(self.trainer, endpoint, batch)

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
        metrics = self.train_on(self.batch(self.held_out), "eval_step")
        return {"eval/nll": metrics["loss/nll"]}


if __name__ == "__main__":
    run_main(SFT, SFTConfig)
