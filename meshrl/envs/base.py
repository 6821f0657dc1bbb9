"""The environment protocol.

An environment class samples task instances (`Prompt`s: from a dataset file
named by `task.dataset`, or from its own generator) and starts one episode per
completion to be sampled. An episode goes turn by turn: the model acts (its
text), the episode answers with a `Step`: the observation to append (a tool's
output), the reward and whether it is done. A single-turn task is the
one-step case: `Task.reward` scores the only action.

    class Echo(Env):
        max_turns = 3

        def generate(self, rng):
            return Prompt(text="say hi", answer="hi")

        def episode(self, prompt):
            return EchoEpisode(prompt)

    class EchoEpisode(Episode):
        def step(self, action):
            if action.strip() == "hi":
                return Step(reward=1.0)
            return Step(observation=" <result>try again</result> ", done=False)

Environments run on the environment mesh (`actors/environment.py`), many
episodes at once; an episode's `step` may block on a tool (its latency hides
behind other episodes' generation) and may raise: that episode is marked
failed, counted, and its group sampled again.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from meshrl.types import Prompt


@dataclass
class Step:
    """An episode's answer to one action."""

    observation: str = ""
    """Text appended to the episode before the model's next turn (ignored when done)."""
    reward: float = 0.0
    """The episode's reward in [0, 1]; the last step's counts."""
    done: bool = True
    info: dict[str, Any] = field(default_factory=dict)
    """Numbers to report (summed over the episode's steps, e.g. tool_calls)."""
    images: list | None = None
    """Pictures that come with the observation (a tool's screenshot or crop), for
    a vision-language model: paths, PIL images or [H, W, 3] uint8 arrays."""


class Episode:
    """One episode's state; `step` is called with each model turn's text."""

    def step(self, action: str) -> Step:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the episode holds (a connection to a server), once it has
        ended: done, failed, or cut at its last turn. Called from the environment
        actor's thread: must not block."""


class Env:
    """An environment: task instances and their episodes. `cfg` is the TaskConfig."""

    max_turns = 1
    """Model turns per episode (task.max_turns overrides)."""
    sandboxed = False
    """Runs model-written programs (`meshrl.envs.sandbox`): the run refuses to
    start where the kernel cannot isolate them, unless sandbox.allow_weak."""
    threaded: bool | None = None
    """Run rewards and steps in the environment procs' thread pool, concurrently
    and under `task.step_timeout_s`: for anything that waits (tools, programs,
    remote calls). None: threaded when multi-turn; cheap single-turn rewards run
    inline, where threads would only add overhead."""

    def __init__(self, cfg: Any = None):
        self.cfg = cfg
        self._rows: list[dict] | None = None

    @property
    def in_threads(self) -> bool:
        """Whether the environment procs run this one's rewards and steps in threads."""
        return self.multi_turn if self.threaded is None else self.threaded

    @property
    def multi_turn(self) -> bool:
        return self.turns > 1

    @property
    def turns(self) -> int:
        return getattr(self.cfg, "max_turns", 0) or self.max_turns

    def generate(self, rng: random.Random) -> Prompt:
        """One synthetic task instance (used when no dataset is configured)."""
        raise NotImplementedError

    def from_row(self, row: dict) -> Prompt:
        """A dataset row -> Prompt, by the field names in task.prompt_field and
        task.answer_field; the whole row travels as `data`, and its `images`
        (file paths) go to a vision-language model with the text."""
        images = row.get("images")
        return Prompt(  # the fields' types were checked when the rows were read (`task_rows`)
            text=row[self.cfg.prompt_field],
            answer=row.get(self.cfg.answer_field, ""),
            data=row,
            images=[images] if isinstance(images, str) else images,
        )

    def sample(self, num_prompts: int, rng: random.Random) -> list[Prompt]:
        dataset = getattr(self.cfg, "dataset", "")
        if not dataset:
            return [self.generate(rng) for _ in range(num_prompts)]
        if self._rows is None:
            from meshrl.envs.dataset import task_rows

            self._rows = task_rows(dataset, self.cfg.prompt_field, self.cfg.answer_field)
        return [self.from_row(rng.choice(self._rows)) for _ in range(num_prompts)]

    def episode(self, prompt: Prompt) -> Episode:
        return _OneStep(self, prompt)

    def reward(self, prompt: Prompt, completion: str) -> float:
        """Single-turn tasks: the reward of the only action."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop what this environment started (a server it runs): at the end of a
        run, in the controller and in each environment proc, whose process may
        serve another run next (pooled procs). A later use may start it again."""

    def demonstration(self, prompt: Prompt) -> str | list[str]:
        """A correct completion, for a supervised warm-start; for a multi-turn
        task, the model's turns (the warm-start plays them through `episode`
        for the replies in between)."""
        return prompt.answer


class _OneStep(Episode):
    def __init__(self, env: Env, prompt: Prompt):
        self.env, self.prompt = env, prompt

    def step(self, action: str) -> Step:
        return Step(reward=self.env.reward(self.prompt, action))


def checked_reward(reward: Any) -> float:
    """A reward from user code, checked: a finite number (TypeError, one line, if not)."""
    if (
        isinstance(reward, bool)
        or not isinstance(reward, (int, float))
        or not math.isfinite(reward)
    ):
        raise TypeError(f"garbage reward {reward!r:.80} (expected a finite number)")
    return float(reward)
