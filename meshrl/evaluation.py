"""Evaluation during training: held-out prompt sets sampled `k` times each on
the policy replicas between steps, scored on the environment mesh, reported
as mean reward, pass@1 and pass@k (`eval/<set>/...`).

pass@k is the unbiased estimator of Chen et al. 2021 (*Evaluating Large Language
Models Trained on Code*): with n samples of a prompt of which c pass,

    pass@k = 1 - C(n - c, k) / C(n, k)

averaged over the prompts; a sample passes when its reward reaches the set's
`threshold`. A set's prompts come from a dataset file (`dataset`), or are
drawn once from the run's task generator with a seed of their own. Either
way they are held out: the training draws skip every prompt text of every set
(`Collector.held_out`).
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass, field
from typing import Any

from meshrl.config_files import ConfigError
from meshrl.mesh import split
from meshrl.types import Completions, Prompt


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of k samples drawn without replacement
    from n, of which c pass, passes (Chen et al. 2021, unbiased)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:  # every draw of k holds a passing sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass
class EvalSetConfig:
    """One held-out set of the run's task."""

    dataset: str = ""
    """A .jsonl/.parquet file or save_to_disk directory of held-out rows (the task's
    fields); "" draws `prompts` from the task's generator with a seed of its own."""
    prompts: int = 64
    """Prompts in the set (a dataset's first rows, or generator draws)."""
    k: int = 4
    """Samples per prompt: pass@1 and pass@k are estimated from them."""
    temperature: float = 1.0
    """Sampling temperature of the evaluation."""
    threshold: float = 1.0
    """A sample passes when its reward is at least this."""

    def validate(self, key: str) -> None:
        for name in ("prompts", "k"):
            if getattr(self, name) < 1:
                raise ConfigError(f"config key '{key}.{name}': must be >= 1")
        if self.temperature <= 0:
            raise ConfigError(f"config key '{key}.temperature': must be > 0")
        if self.dataset and not os.path.exists(self.dataset):
            raise ConfigError(
                f"config key '{key}.dataset': no such file or directory: {self.dataset}"
            )


@dataclass
class EvalConfig:
    """Evaluation during training on the policy replicas, between steps."""

    every: int = 0
    """Steps between evaluations (and after the last step); 0: none."""
    sets: dict[str, EvalSetConfig] = field(default_factory=dict)
    """Held-out sets by name, each with dataset, prompts, k, temperature and
    threshold; logged as eval/<name>/reward, pass@1 and pass@<k>."""

    def validate(self) -> None:
        if self.every < 0:
            raise ConfigError("config key 'eval.every': must be >= 0")
        if self.every and not self.sets:
            raise ConfigError("config key 'eval.sets': eval.every is set but there is no set")
        for name, spec in self.sets.items():
            if "/" in name or not name:
                raise ConfigError(f"config key 'eval.sets': '{name}' is not a set name")
            spec.validate(f"eval.sets.{name}")


class Evaluator:
    """A run's held-out sets (drawn once) and their evaluation. `collector` (a
    `Collector`) lays out the prompts, skips them in training, and reaches the
    policy and environment meshes through its supervisor."""

    def __init__(self, cfg: EvalConfig, collector: Any, seed: int):
        self.cfg, self.collector = cfg, collector
        self.sets: dict[str, list[Prompt]] = {}
        task = collector.task
        for name, spec in cfg.sets.items():
            if spec.dataset:
                from meshrl.data import DatasetError, read_rows

                try:
                    rows = read_rows(
                        spec.dataset, [task.cfg.prompt_field], f"eval.sets.{name}.dataset"
                    )
                except DatasetError as error:
                    raise ConfigError(str(error)) from None
                prompts = [task.from_row(row) for row in rows[: spec.prompts]]
            else:
                rng = random.Random(f"eval-{name}-{seed}")
                prompts = collector.sample_prompts(spec.prompts, rng)
            self.sets[name] = prompts
            collector.held_out |= {p.text for p in prompts}

    def due(self, step: int, last: int) -> bool:
        every = self.cfg.every
        return bool(every and self.sets) and ((step + 1) % every == 0 or step == last)

    def evaluate(self) -> dict[str, float]:
        """Every set now: k samples a prompt, scored; the figures by set."""
        figures = {}
        for name, prompts in self.sets.items():
            spec = self.cfg.sets[name]
            rewards = self._rewards(prompts, spec)
            passed = [sum(r >= spec.threshold for r in per) for per in rewards]
            figures[f"eval/{name}/reward"] = sum(map(sum, rewards)) / (len(prompts) * spec.k)
            figures[f"eval/{name}/pass@1"] = _mean(pass_at_k(spec.k, c, 1) for c in passed)
            if spec.k > 1:
                figures[f"eval/{name}/pass@{spec.k}"] = _mean(
                    pass_at_k(spec.k, c, spec.k) for c in passed
                )
        return figures

    def _rewards(self, prompts: list[Prompt], spec: EvalSetConfig) -> list[list[float]]:
        """[prompt][sample] rewards: k samples of each prompt on the replicas, then
        the environment's scores (not entered in the sample ledger)."""
        collector = self.collector
        sup, policy, environment = collector.sup, collector.policy, collector.environment
        ids = [
            row
            for row in collector.format.prompts([p.text for p in prompts])
            for _ in range(spec.k)
        ]
        generation = _with_temperature(collector.cfg.generation, spec.temperature)
        parts, _ = sup.call(policy, "generate", [(s, generation) for s in split(ids, policy.size)])
        completions = Completions.concat(parts, collector.tokenizer.pad_token_id)
        group = [p for p in prompts for _ in range(spec.k)]
        n = environment.size
        work = zip(split(group, n), split(completions.completion_lists(), n), strict=True)
        scores, _ = sup.call(environment, "score", list(work))
        flat = [reward for part, _ in scores for reward in part]
        return [flat[i * spec.k : (i + 1) * spec.k] for i in range(len(prompts))]


def _with_temperature(generation: Any, temperature: float) -> Any:
    from dataclasses import replace

    return replace(generation, temperature=temperature)


def _mean(values: Any) -> float:
    values = list(values)
    return sum(values) / len(values)
