"""DPO: direct preference optimization (Rafailov et al. 2023) on Monarch meshes.

Offline: no policy replicas and no environment. A preference file (JSONL or
Parquet of `prompt`, `chosen`, `rejected`) is split into train and held-out
prompts. An optional supervised warm-start on the chosen responses of the
train split gives the SFT model; the reference mesh takes a copy of it over
RDMA and keeps it frozen. Each step takes `batch_size` pairs, the reference
mesh scores both responses, and the trainer mesh takes one step of the DPO
loss (data-parallel: each rank gets whole pairs). Every `eval_every` steps the
held-out pairs are scored without a gradient step and their preference
accuracy is logged.

Run it:
    python -m algorithms.dpo --config algorithms/configs/dpo.yaml
    python -m algorithms.dpo --config algorithms/configs/dpo.yaml data.path=prefs.parquet beta=0.2

In Python: `DPO(load_config(DPOConfig, "algorithms/configs/dpo.yaml")).run()`.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from dataclasses import dataclass, field

import torch

from algorithms.base import Algorithm, main, supervised_batch
from meshrl.config import (
    ConfigError,
    ModelConfig,
    OptimConfig,
    PlacementConfig,
    RunConfig,
    check_lora_placement,
)
from meshrl.data import DatasetError, PreferencePair, load_preferences, split_holdout
from meshrl.job import JobConfig
from meshrl.losses import dpo_loss, sequence_logprobs
from meshrl.mesh import start_each
from meshrl.types import TrainBatch

SHIPPED_PREFERENCES = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "meshrl",
    "envs",
    "data",
    "reverse_digits_preferences.jsonl",
)


@dataclass
class PreferenceDataConfig:
    path: str = SHIPPED_PREFERENCES
    """A .jsonl or .parquet file of prompt / chosen / rejected strings."""
    eval_fraction: float = 0.1
    """Share of the prompts held out for evaluation."""

    def validate(self) -> None:
        if not 0 <= self.eval_fraction < 1:
            raise ConfigError("config key 'data.eval_fraction': must be in [0, 1)")
        if not os.path.isfile(self.path):
            raise ConfigError(f"config key 'data.path': file not found: {self.path}")


@dataclass
class SFTConfig:
    steps: int = 0
    """Supervised steps on the train split's chosen responses before DPO; 0 skips."""
    batch_size: int = 64
    lr: float = 3e-3

    def validate(self) -> None:
        if self.steps < 0 or self.batch_size < 1 or self.lr <= 0:
            raise ConfigError("config keys 'sft.*': steps >= 0, batch_size >= 1, lr > 0")


@dataclass
class DPOConfig:
    steps: int = 200
    """Optimizer steps."""
    batch_size: int = 32
    """Preference pairs per step."""
    beta: float = 0.1
    """Strength of the implicit KL to the reference (higher keeps closer)."""
    label_smoothing: float = 0.0
    """cDPO: assumed probability that a preference label is flipped."""
    eval_every: int = 25
    """Steps between held-out evaluations (and after the last step)."""
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    run: RunConfig = field(default_factory=RunConfig)
    job: JobConfig = field(default_factory=JobConfig)

    def validate(self) -> None:
        for section in (
            self.data,
            self.sft,
            self.model,
            self.optim,
            self.placement,
            self.run,
            self.job,
        ):
            section.validate()
        check_lora_placement(self.model, self.placement)
        for key in ("steps", "batch_size", "eval_every"):
            if getattr(self, key) < 1:
                raise ConfigError(f"config key '{key}': must be >= 1")
        if self.beta <= 0:
            raise ConfigError("config key 'beta': must be > 0")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError("config key 'label_smoothing': must be in [0, 0.5)")
        trainers = self.placement.trainer * self.job.hosts_for("trainer")
        if self.batch_size % trainers:
            raise ConfigError(
                f"config key 'placement.trainer': {self.batch_size} pairs per step do not "
                f"split evenly over {trainers} procs"
            )


class DPO(Algorithm):
    name = "dpo"
    headline = "eval/accuracy"

    def run(self) -> list[dict]:
        cfg = self.cfg
        try:
            pairs = load_preferences(cfg.data.path)
        except DatasetError as error:
            raise ConfigError(str(error)) from None
        self.train_pairs, self.eval_pairs = split_holdout(
            pairs, cfg.data.eval_fraction, cfg.run.seed
        )
        self.setup()
        try:
            if cfg.sft.steps:
                self.sft()
            self.sync_weights()  # publish the starting (SFT) weights ...
            self.load_reference()  # ... which the reference keeps
            self.start_logger(cfg.steps)
            before = self.evaluate()
            print(f"dpo: held-out accuracy before training {before.get('eval/accuracy')}")
            for step in range(cfg.steps):
                started = time.perf_counter()
                batch = self.pair_batch(self.next_pairs())
                batch.ref_logprobs = self.reference_logprobs(batch)
                metrics = self.train_pairs_step(batch, "train_step")
                record = {"step": step, **metrics, "time/step_s": time.perf_counter() - started}
                if step == 0:
                    record.update({f"{k}_before": v for k, v in before.items()})
                if (step + 1) % cfg.eval_every == 0 or step == cfg.steps - 1:
                    record.update(self.evaluate())
                self.log_step(record)
                self.end_step(step + 1)  # stops here on Ctrl-C
            self.finish()
        finally:
            self.shutdown()
        return self.logger.history

    # --- hooks ------------------------------------------------------------------------

    def loss(self, logprobs: torch.Tensor, batch: TrainBatch) -> tuple[torch.Tensor, dict]:
        """Runs on every trainer proc. Rows are [chosen; rejected] of the same pairs."""
        cfg = self.cfg
        policy = sequence_logprobs(logprobs, batch.completion_mask)
        ref = sequence_logprobs(batch.ref_logprobs, batch.completion_mask)
        half = len(policy) // 2
        loss, metrics = dpo_loss(
            policy[:half],
            policy[half:],
            ref[:half],
            ref[half:],
            beta=cfg.beta,
            label_smoothing=cfg.label_smoothing,
        )
        metrics["logps/chosen"] = policy[:half].mean().item()
        metrics["logps/rejected"] = policy[half:].mean().item()
        return loss, metrics

    # --- data -------------------------------------------------------------------------

    def next_pairs(self) -> list[PreferencePair]:
        """The next `batch_size` train pairs: shuffled passes over the split."""
        if not getattr(self, "_queue", None):
            self._queue = list(self.train_pairs)
            self.rng.shuffle(self._queue)
        while len(self._queue) < self.cfg.batch_size:
            more = list(self.train_pairs)
            self.rng.shuffle(more)
            self._queue += more
        batch, self._queue = self._queue[: self.cfg.batch_size], self._queue[self.cfg.batch_size :]
        return batch

    def pair_batch(self, pairs: list[PreferencePair]) -> TrainBatch:
        """Rows [chosen_0 .. chosen_n-1, rejected_0 .. rejected_n-1], each response
        followed by EOS."""
        tok, eos = self.tokenizer, self.tokenizer.eos_token_id
        prompts = [tok(p.prompt).input_ids for p in pairs] * 2
        responses = [p.chosen for p in pairs] + [p.rejected for p in pairs]
        targets = [tok(r, add_special_tokens=False).input_ids + [eos] for r in responses]
        return supervised_batch(prompts, targets, tok.pad_token_id)

    # --- the meshes -------------------------------------------------------------------

    def roles(self) -> dict[str, int]:
        return {"trainer": self.cfg.placement.trainer, "reference": self.cfg.placement.reference}

    def spawn_actors(self) -> None:
        from actors.reference import Reference

        cfg = self.cfg
        self.spawn_trainer(cfg.steps)
        self.reference = self.meshes.spawn(
            "reference", "reference", Reference, cfg.model, cfg.run.seed
        )

    def reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self.call_rows("reference", "logprobs", batch)

    def train_pairs_step(self, batch: TrainBatch, endpoint: str) -> dict[str, float]:
        """`endpoint` on every trainer rank with whole pairs: rank i takes pairs
        i, i + n, ... (its chosen rows, then the same pairs' rejected rows)."""
        n, half = self.meshes.size("trainer"), len(batch) // 2
        shards = []
        for i in range(n):
            rows = torch.arange(i, half, n)
            shards.append((batch.rows(torch.cat([rows, rows + half])),))
        return self.collect(start_each(self.trainer, endpoint, shards), f"trainer.{endpoint}")

    def evaluate(self) -> dict[str, float]:
        """DPO loss and preference accuracy on the held-out pairs (no update)."""
        if not self.eval_pairs:
            return {}
        n = self.meshes.size("trainer")
        usable = len(self.eval_pairs) - len(self.eval_pairs) % n
        batch = self.pair_batch(self.eval_pairs[:usable])
        batch.ref_logprobs = self.reference_logprobs(batch)
        metrics = self.train_pairs_step(batch, "eval_step")
        return {
            "eval/accuracy": metrics["rewards/accuracy"],
            "eval/loss": metrics["loss/dpo"],
            "eval/margin": metrics["rewards/margin"],
        }

    def sft(self) -> None:
        """Supervised steps on the chosen responses of the train split."""
        cfg = self.cfg.sft
        rng = random.Random(self.cfg.run.seed)
        with open(f"{self.run_dir}/sft.jsonl", "w") as log:
            for step in range(cfg.steps):
                pairs = rng.sample(self.train_pairs, min(cfg.batch_size, len(self.train_pairs)))
                batch = self.pair_batch(pairs).rows(slice(0, len(pairs)))  # the chosen rows
                metrics = self.train(batch, "warm_start_step", cfg.lr)
                log.write(json.dumps({"step": step, **metrics}) + "\n")
        print(f"sft: {cfg.steps} steps on chosen responses, nll {metrics['loss/nll']:.3f}")


if __name__ == "__main__":
    sys.exit(main(DPO, DPOConfig))
