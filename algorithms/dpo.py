"""DPO: direct preference optimization (Rafailov et al. 2023) on Monarch meshes.

Offline: no policy replicas and no environment. A preference file (JSONL or
Parquet of `prompt`, `chosen`, `rejected`) is split into train and held-out
prompts. An optional supervised warm-start on the chosen responses of the
train split gives the SFT model; the reference mesh takes a copy of it over
RDMA and keeps it frozen. Each step takes `batch_size` pairs, the reference
mesh scores both responses, and the trainer mesh takes one step of the DPO
loss (data-parallel: each rank gets whole pairs). Every `eval.every` steps the
held-out pairs are scored without a gradient step and their preference
accuracy is logged.

Run it:
    python -m algorithms.dpo --config algorithms/configs/dpo.yaml
    python -m algorithms.dpo --config algorithms/configs/dpo.yaml data.path=prefs.parquet beta=0.2

In Python: `DPO(load_config(DPOConfig, "algorithms/configs/dpo.yaml")).run()`.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from algorithms.base import Loss, run_main
from algorithms.rl_config import OfflineConfig
from algorithms.sft import SFT, SHIPPED_PREFERENCES
from meshrl.config import (
    ConfigError,
    WarmStartConfig,
)
from meshrl.envs.dataset import DatasetError, PreferencePair, load_preferences, split_holdout
from meshrl.loop.run import Role, Run
from meshrl.loop.supervised import supervised_batch, supervised_steps
from meshrl.loop.supervisor import mean_metrics
from meshrl.model.losses import dpo_loss, scale_of, sequence_logprobs
from meshrl.types import TrainBatch


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
class DPOConfig(OfflineConfig):
    batch_size: int = 32
    """Preference pairs per step."""
    beta: float = 0.1
    """Strength of the implicit KL to the reference (higher keeps closer)."""
    label_smoothing: float = 0.0
    """cDPO: assumed probability that a preference label is flipped."""
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    """Supervised steps on the train split's chosen responses before DPO (the
    on-policy algorithms' `warm_start:` keys, on the chosen responses); 0 skips."""

    ALGORITHM: ClassVar[str] = "DPO"
    MOVED: ClassVar[dict[str, str]] = {**OfflineConfig.MOVED, "sft": "warm_start"}
    # `trainer.layout` also lays out the reference's batches (tree: a pair's two
    # responses share one forward of its prompt).

    def validate(self) -> None:
        super().validate()
        self.trainer.check_offline("DPO", micro_batches=False)
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


class DPOLoss(Loss):
    """Runs on every trainer proc. Rows are [chosen; rejected] of the same pairs."""

    def __call__(self, logprobs: torch.Tensor, batch: TrainBatch) -> tuple[torch.Tensor, dict]:
        cfg = self.cfg
        policy = sequence_logprobs(logprobs, batch.completion_mask)
        ref = sequence_logprobs(batch.ref_logprobs, batch.completion_mask)
        half = len(policy) // 2
        scale = scale_of(batch.completion_mask, batch.scale)  # means over the whole batch
        pairs = scale.sequences // 2
        loss, metrics = dpo_loss(
            policy[:half],
            policy[half:],
            ref[:half],
            ref[half:],
            beta=cfg.beta,
            label_smoothing=cfg.label_smoothing,
            pairs=pairs,
            ranks=scale.ranks,
        )
        metrics["logps/chosen"] = scale.sequence_mean(policy[:half].detach(), pairs).item()
        metrics["logps/rejected"] = scale.sequence_mean(policy[half:].detach(), pairs).item()
        return loss, metrics


class DPO(SFT):
    """SFT's offline loop (`SFT.run`, algorithms/sft.py) on preference pairs: a
    frozen reference of the starting (SFT) weights, whose log-probs of both
    responses each batch carries, and the DPO loss, each trainer rank on whole
    pairs."""

    name = "dpo"
    headline = "eval/accuracy"
    Loss = DPOLoss

    def start(self) -> None:
        super().start()
        print(f"dpo: held-out accuracy before training {self.before.get('eval/accuracy')}")

    # --- hooks ------------------------------------------------------------------------

    def placement(self) -> dict[str, int]:
        return {"trainer": self.cfg.placement.trainer, "reference": self.cfg.placement.reference}

    def spawn_reference(self, run: Run) -> Role:
        """The frozen reference: the starting (SFT) weights, pulled once."""
        from actors.reference import Reference

        cfg = self.cfg
        return run.spawn(
            "reference", Reference, cfg.model, cfg.run.seed, cfg.trainer.layout, frozen_copy=True
        )

    def next_batch(self) -> TrainBatch:
        return self.pair_batch(self.next_pairs())

    # --- data -------------------------------------------------------------------------

    def load_data(self) -> None:
        """The preference file, split into train and held-out pairs."""
        cfg = self.cfg
        try:
            pairs = load_preferences(cfg.data.path)
        except DatasetError as error:
            raise ConfigError(str(error)) from None
        self.train_pairs, self.eval_pairs = split_holdout(
            pairs, cfg.data.eval_fraction, cfg.run.seed
        )

    def next_pairs(self) -> list[PreferencePair]:
        """The next `batch_size` train pairs: shuffled passes over the split (the
        position is in the `LoopState`, so a resumed run goes on where it was)."""
        taken = self.state.next_items(len(self.train_pairs), self.cfg.batch_size)
        return [self.train_pairs[i] for i in taken]

    def pair_batch(self, pairs: list[PreferencePair]) -> TrainBatch:
        """Rows [chosen_0 .. chosen_n-1, rejected_0 .. rejected_n-1], each response
        followed by EOS."""
        tok, eos = self.tokenizer, self.tokenizer.eos_token_id
        prompts = [tok(p.prompt).input_ids for p in pairs] * 2
        responses = [p.chosen for p in pairs] + [p.rejected for p in pairs]
        targets = [tok(r, add_special_tokens=False).input_ids + [eos] for r in responses]
        batch = supervised_batch(prompts, targets, tok.pad_token_id)
        batch.paired = True  # micro-batches keep each pair's two rows together
        return batch

    # --- the meshes -------------------------------------------------------------------

    def train_on(self, batch: TrainBatch, endpoint: str) -> dict[str, float]:
        """`endpoint` on every trainer rank with whole pairs: data-parallel rank i
        takes pairs i, i + n, ... (its chosen rows, then the same pairs' rejected
        rows)."""
        n, half = self.trainer.data_parallel, len(batch) // 2

        def rows(i: int) -> torch.Tensor:
            picked = torch.arange(i, half, n)
            return torch.cat([picked, picked + half])

        shards = [(shard,) for shard in self.trainer.shards(batch, rows)]
        results, _ = self.sup.call(self.trainer, endpoint, shards)
        return mean_metrics(results)

    def evaluate(self) -> dict[str, float]:
        """DPO loss and preference accuracy on the held-out pairs (no update)."""
        if not self.eval_pairs:
            return {}
        # Every pair counts: uneven shards still give the whole set's means (LossScale).
        batch = self.pair_batch(self.eval_pairs)
        batch.ref_logprobs = self.sup.call_rows(self.reference, "logprobs", batch)
        metrics = self.train_on(batch, "eval_step")
        return {
            "eval/accuracy": metrics["rewards/accuracy"],
            "eval/loss": metrics["loss/dpo"],
            "eval/margin": metrics["rewards/margin"],
        }

    def warm_start(self) -> None:
        """Supervised steps on the chosen responses of the train split
        (warm_start.jsonl), before DPO: `warm_start.steps`."""
        cfg, rng = self.cfg.warm_start, random.Random(self.cfg.run.seed)
        if not cfg.steps:
            return

        def chosen(step: int) -> TrainBatch:
            pairs = rng.sample(self.train_pairs, min(cfg.batch_size, len(self.train_pairs)))
            return self.pair_batch(pairs).rows(slice(0, len(pairs)))  # the chosen rows

        path = f"{self.runtime.dir}/warm_start.jsonl"
        supervised_steps(self.sup, self.trainer, chosen, cfg.steps, cfg.lr, path, "warm-start")


if __name__ == "__main__":
    run_main(DPO, DPOConfig)
