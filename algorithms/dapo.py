"""DAPO (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning
System at Scale"): GRPO with clip-higher, token-level loss aggregation and
dynamic sampling.

Clip-higher (`clip_high: 0.28`) and the token-mean loss are config values
(algorithms/configs/dapo.yaml). Dynamic sampling is this file's one hook:
groups whose completions all got the same reward carry no gradient under
group-normalized advantages, so they are dropped and more prompts are sampled
until the batch holds `prompts_per_step` groups that do vary. After
`max_sampling_rounds` rounds the batch is topped up with dropped groups (whose
advantages are 0) so that its shape stays fixed; how often that happens is
logged. `reward/mean` is over every completion sampled in the step, kept or
not, so the curve is comparable with GRPO's.

Not included: the overlong reward shaping of the paper (its completions are
thousands of tokens; here `generation.max_new_tokens` caps them).

    python -m algorithms.dapo --config algorithms/configs/dapo.yaml
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from algorithms.base import run_main
from algorithms.grpo import GRPO, GRPOConfig
from meshrl.config import ConfigError
from meshrl.loop.collector import Batch
from meshrl.types import Completions


@dataclass
class DAPOConfig(GRPOConfig):
    clip_high: float | None = 0.28
    loss_aggregation: str = "token-mean"
    max_sampling_rounds: int = 3
    """Rounds of sampling per step (the first included) before topping up."""

    def validate(self) -> None:
        super().validate()
        if self.max_sampling_rounds < 1:
            raise ConfigError("config key 'max_sampling_rounds': must be >= 1")
        if self.max_staleness:
            raise ConfigError("config key 'max_staleness': DAPO samples synchronously (0)")


class DAPO(GRPO):
    name = "dapo"

    def rollout(self, batch: Batch) -> tuple[Completions, torch.Tensor, dict]:
        """Dynamic sampling: keep only groups whose rewards vary, refill, repeat.
        The loop's batch is the first round."""
        cfg, k, collector = self.cfg, self.cfg.group_size, self.collector
        kept, dropped, all_rewards, times = [], [], [], {}
        rounds = 0
        while len(kept) < cfg.prompts_per_step and rounds < cfg.max_sampling_rounds:
            if rounds:
                batch = collector.start(collector.sample_prompts(cfg.prompts_per_step))
            prompts = batch.prompts
            completions, rewards, round_times = collector.finish(batch)
            for key, value in round_times.items():  # summed over rounds; a count is the last
                times[key] = value if key.startswith("faults/") else times.get(key, 0) + value
            all_rewards.append(rewards)
            for g in range(len(prompts)):
                rows = slice(g * k, (g + 1) * k)
                group = (completions.rows(rows), rewards[rows])
                (kept if rewards[rows].std() > 0 else dropped).append(group)
            rounds += 1
        topped_up = max(0, cfg.prompts_per_step - len(kept))
        groups = (kept + dropped[:topped_up])[: cfg.prompts_per_step]
        completions = Completions.concat([c for c, _ in groups], self.tokenizer.pad_token_id)
        sampled = torch.cat(all_rewards)
        # Groups sampled but not in the batch are dropped (sample accounting).
        self.state.ledger.drop("filtered", len(sampled) - len(groups) * k)
        return (
            completions,
            torch.cat([r for _, r in groups]),
            {
                "reward/mean": sampled.mean().item(),  # over everything sampled
                "reward/trained_mean": torch.cat([r for _, r in groups]).mean().item(),
                "dapo/sampling_rounds": rounds,
                "dapo/groups_sampled": len(sampled) // k,
                "dapo/groups_zero_variance": (len(sampled) // k) - len(kept),
                "dapo/groups_topped_up": topped_up,
                **times,
            },
        )


if __name__ == "__main__":
    run_main(DAPO, DAPOConfig)
