"""Environment: scores completions and steps episodes, many at once.

`score` rewards single-turn completions; `step` advances multi-turn episodes
by one model turn each. For an environment that is `threaded` (tools,
sandboxed programs, multi-turn episodes) both run their items concurrently in
a thread pool (`task.env_workers`), so a slow tool holds up only its own
episode, and a step past `task.step_timeout_s` fails. A reward or step that
raises or returns garbage fails only that episode, with the reason.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from monarch.actor import Actor, endpoint

from meshrl.config import ModelConfig, TaskConfig
from meshrl.envs import Episode, Step, make_task, sandbox
from meshrl.envs.base import checked_reward
from meshrl.envs.sandbox import SandboxConfig
from meshrl.model.tokenizer import load_tokenizer
from meshrl.observe.telemetry import observed, record
from meshrl.procs.faults import Drillable
from meshrl.types import Prompt


class Environment(Drillable, Actor):
    role = "environment"

    def __init__(
        self, task_cfg: TaskConfig, model_cfg: ModelConfig, sandbox_cfg: SandboxConfig | None = None
    ):
        sandbox.configure(sandbox_cfg or SandboxConfig(), task_cfg.name)
        self.task = make_task(task_cfg)
        self.tokenizer = load_tokenizer(model_cfg)
        self.timeout_s = task_cfg.step_timeout_s
        self.workers = task_cfg.env_workers
        self.pool = ThreadPoolExecutor(self.workers, thread_name_prefix="episode")
        self.episodes: dict[str, Episode] = {}

    def _run_all(self, calls: list[Callable[[], Any]]) -> list[tuple[Any, str]]:
        """Run `calls` in the pool (inline for an environment that is not
        `threaded`: cheap rewards, where threads only add overhead); (result,
        '') or (None, reason) each."""
        if not self.task.in_threads:
            return self._count([_contained(call) for call in calls])
        futures = [self.pool.submit(call) for call in calls]
        # Items beyond the pool's width wait for a thread: each wave gets the timeout.
        waves = -(-len(calls) // self.workers)
        deadline = time.monotonic() + self.timeout_s * max(1, waves)
        results = []
        for future in futures:
            try:
                results.append((future.result(timeout=max(0.0, deadline - time.monotonic())), ""))
            except FutureTimeout:
                results.append((None, f"timeout: no answer within {self.timeout_s:g}s"))
            except Exception as error:  # noqa: BLE001 - contained: the episode fails, not the actor
                results.append((None, _reason(error)))
        return self._count(results)

    @staticmethod
    def _count(results: list[tuple[Any, str]]) -> list[tuple[Any, str]]:
        failed = sum(1 for _, reason in results if reason)
        if failed:
            record("env/failed", failed, "sum")
        return results

    @endpoint
    @observed
    def score(
        self, prompts: list[Prompt], completion_ids: list[list[int]]
    ) -> tuple[list[float], dict[int, str]]:
        """Reward of each completion (token ids, EOS excluded by decoding), and the
        reasons of those that failed (their reward reads 0)."""
        self.drill("score")
        if not completion_ids:
            return [], {}
        started = time.perf_counter()
        self.wait_latency(completion_ids)  # `faults.episode_latency`, `faults.slow` drills
        self.drag(started)
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        results = self._run_all(
            [
                (lambda p=p, t=t: checked_reward(self.task.reward(p, t)))
                for p, t in zip(prompts, texts, strict=True)
            ]
        )
        failures = {i: reason for i, (_, reason) in enumerate(results) if reason}
        return [0.0 if reason else value for value, reason in results], failures

    @endpoint
    @observed
    def step(
        self, items: list[tuple[str, Prompt, str, bool]]
    ) -> list[tuple[str, Step | None, str]]:
        """One turn of each episode: (key, prompt, the model's action text, final).
        An episode starts at its first step and is forgotten when done, failed or
        final. Returns (key, step, failure reason) each."""
        calls = []
        for key, prompt, action, _ in items:
            episode = self.episodes.get(key)
            if episode is None:
                episode = self.episodes[key] = self.task.episode(prompt)
            calls.append(lambda e=episode, a=action: _checked_step(e.step(a)))
        out = []
        for (key, _, _, final), (step, reason) in zip(items, self._run_all(calls), strict=True):
            if reason or final or step.done:
                ended = self.episodes.pop(key, None)
                if ended is not None:
                    _contained(ended.close)
            if step is not None:
                for name, value in step.info.items():
                    record(f"env/{name}", value, "sum")
            out.append((key, step, reason))
        return out

    def __cleanup__(self, error: Exception | None) -> None:
        """Monarch stops this actor (the run ended; a pooled proc lives on for the
        next run): end the open episodes and stop what the task started (an
        OpenEnv server)."""
        for episode in self.episodes.values():
            _contained(episode.close)
        self.episodes.clear()
        _contained(self.task.close)
        self.pool.shutdown(wait=False, cancel_futures=True)

    def __del__(self):
        self.pool.shutdown(wait=False, cancel_futures=True)


def _reason(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"raised {type(error).__name__}: {text[0] if text else ''}"


def _contained(call: Callable[[], Any]) -> tuple[Any, str]:
    try:
        return call(), ""
    except Exception as error:  # noqa: BLE001 - contained: the episode fails, not the actor
        return None, _reason(error)


def _checked_step(step: Any) -> Step:
    if not isinstance(step, Step):
        raise TypeError(f"garbage step {step!r:.80} (expected meshrl.envs.Step)")
    if not isinstance(step.observation, str):
        raise TypeError(f"garbage observation {step.observation!r:.80} (expected text)")
    step.reward = checked_reward(step.reward)
    return step
