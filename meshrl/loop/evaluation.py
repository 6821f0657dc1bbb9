"""Evaluation during training: held-out prompt sets sampled `k` times each on
the policy replicas between steps, scored on the environment mesh, reported
as mean reward, pass@1 and pass@k (`eval/<set>/...`).

pass@k is the unbiased estimator of Chen et al. 2021 (*Evaluating Large Language
Models Trained on Code*): with n samples of a prompt of which c pass,

    pass@k = 1 - C(n - c, k) / C(n, k)

averaged over the prompts; a sample passes when its reward reaches the set's
`threshold`. A multi-turn task's samples are whole episodes (its tools and
replies included; a failed one scores 0). A set's prompts come from a dataset file (`dataset`), or are
drawn once from the run's task generator with a seed of their own. Either
way they are held out: the training draws skip every prompt text of every set
(`Collector.held_out`).
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from meshrl.config.files import ConfigError
from meshrl.model.vision import shard
from meshrl.procs.mesh import split, start_each
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
    before: bool = False
    """Also evaluate once before the first update (after any warm-start), logged with
    step 0's record as `eval/<set>/<figure>_before`; not on a resumed run."""
    mesh: bool = False
    """Sample on an `eval` policy mesh of its own (`procs` procs), which pulls the
    step's weights and samples while the next step trains; its figures are logged
    with the next step's (`eval/step` says which weights). False: on the policy
    replicas, between steps."""
    procs: int = 1
    """Procs of the `eval` mesh (with `mesh: true`)."""
    sets: dict[str, EvalSetConfig] = field(default_factory=dict)
    """Held-out sets by name, each with dataset, prompts, k, temperature and
    threshold; logged as eval/<name>/reward, pass@1 and pass@<k>."""

    def validate(self) -> None:
        if self.every < 0:
            raise ConfigError("config key 'eval.every': must be >= 0")
        if self.every and not self.sets:
            raise ConfigError("config key 'eval.sets': eval.every is set but there is no set")
        if self.procs < 1:
            raise ConfigError("config key 'eval.procs': must be >= 1")
        for name, spec in self.sets.items():
            if "/" in name or not name:
                raise ConfigError(f"config key 'eval.sets': '{name}' is not a set name")
            spec.validate(f"eval.sets.{name}")


Judge = Callable[[Completions, float], dict[str, float]]
"""Figures of an algorithm's own about a set's samples (distillation: the teacher's
reverse KL), from the completions and their sampling temperature."""


class Evaluator:
    """A run's held-out sets (drawn once) and their evaluation. `collector` (a
    `Collector`) lays out the prompts, skips them in training, and reaches the
    policy and environment meshes through its supervisor. `mesh`: an `eval`
    policy mesh of its own (then `sync`, a `WeightSync` for it, gets each
    version's handle from the run's). `judge`: more figures per single-turn set,
    logged beside its reward as `eval/<set>/<figure>`."""

    def __init__(
        self,
        cfg: EvalConfig,
        collector: Any,
        seed: int,
        mesh: Any = None,
        sync: Any = None,
        judge: Judge | None = None,
    ):
        self.cfg, self.collector, self.mesh, self.sync = cfg, collector, mesh, sync
        self.judge = judge
        self.sets: dict[str, list[Prompt]] = {}
        self.pending: tuple[int, dict] | None = None  # (step, per set: the calls in flight)
        self.before: dict[str, float] = {}  # `cfg.before`'s figures, until step 0 logs them
        task = collector.task
        for name, spec in cfg.sets.items():
            if spec.dataset:
                from meshrl.envs.dataset import DatasetError, read_rows

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
            collector.held_out |= {p.key for p in prompts}

    def due(self, step: int, last: int) -> bool:
        every = self.cfg.every
        return bool(every and self.sets) and ((step + 1) % every == 0 or step == last)

    def after_step(self, step: int, last: int, handle: Any = None) -> dict[str, float]:
        """The figures to log with `step`'s record: on the replicas, this step's
        evaluation when due; on an eval mesh, the previous one's (collected now),
        and this step's is sent (`handle`: the weights it trained), or, at the
        last step, collected too."""
        started, due = time.perf_counter(), self.due(step, last)
        figures = self.finish() if self.pending is not None else {}
        figures.update({f"{key}_before": value for key, value in self.before.items()})
        self.before = {}
        if due:
            if self.mesh is None:
                figures.update(self.evaluate())
            else:
                self.start(step, handle)
                if step == last:
                    figures.update(self.finish())
        if figures or due:
            figures["time/eval_s"] = time.perf_counter() - started
        return figures

    def evaluate(self) -> dict[str, float]:
        """Every set now, on the policy replicas: k samples a prompt, scored."""
        self.pending = (-1, {name: self._send(name, self.collector.policy) for name in self.sets})
        return self.finish()

    def evaluate_before(self) -> None:
        """`cfg.before`: every set now, before the first update; the figures go with
        step 0's record."""
        if self.cfg.before and self.sets:
            self.before = self.evaluate()

    def start(self, step: int, handle: Any) -> None:
        """The eval mesh takes `handle`'s weights, then samples every set; nothing
        waits for the samples."""
        self.sync.handle = handle
        self.sync.pull(self.mesh)
        self.pending = (step, {name: self._send(name, self.mesh) for name in self.sets})

    def finish(self) -> dict[str, float]:
        """The pending samples collected and scored: the figures by set."""
        (step, calls), self.pending = self.pending, None
        figures = {"eval/step": step} if step >= 0 else {}
        for name, prompts in self.sets.items():
            spec = self.cfg.sets[name]
            rewards, judged = self._score(name, *calls[name])
            figures.update({f"eval/{name}/{key}": value for key, value in judged.items()})
            passed = [sum(r >= spec.threshold for r in per) for per in rewards]
            figures[f"eval/{name}/reward"] = sum(map(sum, rewards)) / (len(prompts) * spec.k)
            figures[f"eval/{name}/pass@1"] = _mean(pass_at_k(spec.k, c, 1) for c in passed)
            if spec.k > 1:
                figures[f"eval/{name}/pass@{spec.k}"] = _mean(
                    pass_at_k(spec.k, c, spec.k) for c in passed
                )
        return figures

    def _send(self, name: str, role: Any) -> tuple[Any, list, list, int]:
        """k samples of each of the set's prompts, sent to `role`'s replicas (a
        multi-turn task's episodes are played when collected, in `_score`)."""
        spec, collector = self.cfg.sets[name], self.collector
        if collector.task.multi_turn:
            return role, [], [], role.respawns
        prompts, pixels = collector.encode(self.sets[name])  # a VLM's pictures too
        ids = [row for row in prompts for _ in range(spec.k)]
        pixels = [x for x in pixels for _ in range(spec.k)]
        generation = replace(collector.cfg.generation, temperature=spec.temperature)
        args = [
            (rows, generation, None, shard(part))
            for rows, part in zip(split(ids, role.size), split(pixels, role.size), strict=True)
        ]
        return role, args, start_each(role, "generate", args), role.respawns

    def _score(
        self, name: str, role: Any, args: list, futures: list, respawns: int
    ) -> tuple[list[list[float]], dict[str, float]]:
        """[prompt][sample] rewards of a set's samples from the environment mesh
        (not entered in the sample ledger), and the judge's figures."""
        spec, collector = self.cfg.sets[name], self.collector
        sup, environment = collector.sup, collector.environment
        group = [p for p in self.sets[name] for _ in range(spec.k)]
        judged: dict[str, float] = {}
        if collector.task.multi_turn:
            flat = self._episodes(name, group, role)
        else:
            parts, _ = sup.call(role, "generate", args, (futures, respawns), independent=True)
            completions = Completions.concat(parts, collector.tokenizer.pad_token_id)
            n = environment.size
            work = zip(split(group, n), split(completions.completion_lists(), n), strict=True)
            scores, _ = sup.call(environment, "score", list(work), independent=True)
            flat = [reward for part, _ in scores for reward in part]
            if self.judge is not None:
                judged = self.judge(completions, spec.temperature)
        rewards = [flat[i * spec.k : (i + 1) * spec.k] for i in range(len(self.sets[name]))]
        return rewards, judged

    def _episodes(self, name: str, group: list[Prompt], role: Any) -> list[float]:
        """A multi-turn task's episodes of `group` on `role`'s replicas and the
        environment mesh (`meshrl.envs.rollout.run_episodes`): each one's reward, 0 for
        a failed one."""
        from meshrl.envs.rollout import run_episodes

        c, spec = self.collector, self.cfg.sets[name]
        generation = replace(c.cfg.generation, temperature=spec.temperature)
        if getattr(c.task, "is_agent", False):  # the agent drives an endpoint of its own
            from meshrl.envs.endpoint import PolicyServer, Router

            router = Router(lambda: role.actors, role.size, generation, c.sup.timeout_s)
            server = PolicyServer(router, c.format, c.context, tool_parser=c.cfg.policy.tool_parser)
            try:
                episodes, _ = c.task.play(group, server, f"eval.{name}.")
            finally:
                server.close()
            return [0.0 if e.failed else e.reward for e in episodes]
        roles = {"policy": role, "environment": c.environment}
        episodes, _ = run_episodes(
            group,
            lambda which: roles[which].actors,
            role.size,
            c.environment.size,
            c.format,
            generation,
            c.task.turns,
            c.context,
            c.sup.timeout_s,
            on_lost=c.sup.recover,
            key_prefix=f"eval.{name}.",
            vision=c.vision,
        )
        return [0.0 if e.failed else e.reward for e in episodes]


def _mean(values: Any) -> float:
    values = list(values)
    return sum(values) / len(values)
