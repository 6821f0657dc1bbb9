"""Agent tasks: your agent program drives the policy through its OpenAI-compatible
endpoint (`meshrl.envs.endpoint`), and meshrl trains on what it recorded.

`task.name=agent:mypkg.agents:solve` names a function

    def solve(base_url: str, prompt: Prompt) -> float:
        client = openai.OpenAI(base_url=base_url, api_key="none")
        ...  # chat calls, tools, whatever the agent does
        return reward

called once per episode (group_size times per prompt) in the controller's
threads (`task.env_workers` at once). `base_url` is the episode's own URL,
its secret in it: the api_key is not checked there (the endpoint's stateless
routes need the run's token; an episode needs none). Its calls to `base_url`
are one episode: the server keeps them as one token sequence, the model's
tokens as sampled and the tool and user messages masked (see
`meshrl.envs.endpoint`). The prompts come from `task.dataset` (its `prompt_field`, `answer_field` and the whole row travel in
the `Prompt`).

An agent that raises, returns something other than a finite number, makes no
call to the endpoint or runs past `task.step_timeout_s` x `task.max_turns`
fails its episode: counted, and its group played again, as with any
environment.
"""

from __future__ import annotations

import importlib
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from meshrl.envs.base import Env, checked_reward
from meshrl.envs.endpoint import PolicyServer
from meshrl.envs.rollout import EpisodeState
from meshrl.types import Prompt


class AgentTask(Env):
    """Prompts from `task.dataset`; episodes played by your agent function."""

    max_turns = 8
    """Calls an episode may make to the endpoint (task.max_turns overrides)."""
    is_agent = True

    @property
    def multi_turn(self) -> bool:
        """Always: the agent plays each episode through the endpoint, whatever its
        turn limit (`task.max_turns=1` included)."""
        return True

    def __init__(self, cfg: Any = None):
        super().__init__(cfg)
        self.function = load_agent(cfg.name)
        self._pool: ThreadPoolExecutor | None = None

    @staticmethod
    def check_name(name: str) -> str:
        try:
            load_agent(name)
        except (ImportError, AttributeError, ValueError) as error:
            return str(error)
        return ""

    def generate(self, rng):
        raise ValueError(
            "config key 'task.dataset': an agent task takes its prompts from a dataset "
            "(.jsonl/.parquet rows with a prompt field)"
        )

    def play(
        self, prompts: list[Prompt], server: PolicyServer, key_prefix: str
    ) -> tuple[list[EpisodeState], dict[str, float]]:
        """One episode per prompt: the agent function with the episode's URL.
        Returns the recorded episodes (in prompt order) and timing metrics."""
        started, generating = time.perf_counter(), server.router.generate_s
        workers = self.cfg.env_workers
        if self._pool is None:
            self._pool = ThreadPoolExecutor(workers, thread_name_prefix="agent")
        keys = [f"{key_prefix}{i}" for i in range(len(prompts))]
        urls = [server.open(key, self.turns) for key in keys]
        futures = [
            self._pool.submit(self.function, url, prompt)
            for url, prompt in zip(urls, prompts, strict=True)
        ]
        limit = self.cfg.step_timeout_s * self.turns
        deadline = started + limit * max(1, -(-len(prompts) // workers))
        episodes = []
        for key, prompt, future in zip(keys, prompts, futures, strict=True):
            reward, failed = 0.0, ""
            try:
                reward = checked_reward(
                    future.result(timeout=max(0.0, deadline - time.perf_counter()))
                )
            except FutureTimeout:
                failed = f"timeout: the agent did not return within {limit:g}s"
            except Exception as error:  # noqa: BLE001 - the episode fails, not the run
                text = str(error).strip().splitlines()
                failed = f"the agent raised {type(error).__name__}: {text[0] if text else ''}"
            transcript = server.close_episode(key)  # a late call now gets a 404
            episode = EpisodeState(key, prompt, transcript.prompt_ids if transcript else [])
            if transcript is not None and transcript.calls:
                episode.tokens, episode.loss_mask = transcript.tokens, transcript.loss_mask
                episode.logprobs, episode.versions = transcript.logprobs, transcript.versions
                episode.turns, episode.truncated = transcript.calls, transcript.truncated
            elif not failed:
                failed = "the agent made no call to the policy endpoint"
            episode.reward, episode.done = reward, True
            episode.failed = failed[:300]
            episodes.append(episode)
        return episodes, {
            "time/episodes_s": time.perf_counter() - started,
            "time/episode_generate_s": server.router.generate_s - generating,
        }

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def load_agent(name: str) -> Any:
    """`agent:module:function` -> the function (ImportError, AttributeError or
    ValueError, one line, when it is not there)."""
    spec = name.partition(":")[2]
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ValueError(f"'{name}' is not agent:module:function")
    function = getattr(importlib.import_module(module), attr)
    if not callable(function):
        raise ValueError(f"'{spec}' is not a function")
    return function
