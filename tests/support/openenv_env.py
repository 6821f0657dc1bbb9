"""OpenEnv environments for tests/e2e/test_openenv.py, served by openenv-core's own
server, which meshrl starts (`task.name=openenv:tests.support.openenv_env:Reverse`).

`Reverse`: the prompt is 3 digits and '>' ("471>"); the model should answer
them reversed ("174"). Each of its 2 turns earns `score(digits, action) / 2`:
partial credit (a quarter for writing digits, the rest for digits in place),
so that even an untrained model earns some. After the first turn the
observation says how many were in place (" 1/3 "); the second ends the episode.
"""

from __future__ import annotations

import os
import random
import tempfile
from typing import Any

from openenv.core.env_server import Action, Environment, Observation, State

TURNS = 2


class ReverseAction(Action):
    text: str


class ReverseObservation(Observation):
    text: str = ""
    turn: int = 0  # not text: the adapter shows only the single string field


class ReverseState(State):
    digits: str = ""


def score(digits: str, action: str) -> float:
    """In [0, 1]: digits written (up to 3) count 1 each, digits of the reversal
    in place 3 each, out of 12."""
    guess = action.strip()
    in_place = sum(a == b for a, b in zip(guess, digits[::-1], strict=False))
    written = min(3, sum(c.isdigit() for c in guess))
    return (written + 3 * in_place) / 12


def in_place(digits: str, action: str) -> int:
    return sum(a == b for a, b in zip(action.strip(), digits[::-1], strict=False))


def play(prompt: str, actions: list[str]) -> tuple[list[str], float, bool]:
    """What `Reverse` answers to `actions` after `prompt`: the replies, the return
    and whether the episode is done (the test's own account of it)."""
    digits, replies, total = prompt.rstrip(">"), [], 0.0
    for turn, action in enumerate(actions, 1):
        total += score(digits, action) / TURNS
        if turn >= TURNS or in_place(digits, action) == 3:
            return replies, total, True
        replies.append(f" {in_place(digits, action)}/3 ")
    return replies, total, False


class Reverse(Environment[ReverseAction, ReverseObservation, ReverseState]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = ReverseState()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any):
        rng = random.Random(seed)
        digits = "".join(rng.choice("0123456789") for _ in range(3))
        self._state = ReverseState(episode_id=episode_id, step_count=0, digits=digits)
        return ReverseObservation(text=f"{digits}>")

    def step(self, action: ReverseAction, timeout_s: float | None = None, **kwargs: Any):
        self._state.step_count += 1
        digits, turn = self._state.digits, self._state.step_count
        right = in_place(digits, action.text)
        done = turn >= TURNS or right == 3
        return ReverseObservation(
            text="" if done else f" {right}/3 ",
            turn=turn,
            reward=score(digits, action.text) / TURNS,
            done=done,
        )

    @property
    def state(self) -> ReverseState:
        return self._state


MARKERS = os.path.join(tempfile.gettempdir(), "meshrl-openenv-test-deaths")


def _parent_marker() -> str:
    """A file named after this server's parent process (its pid and start time,
    which no later process shares)."""
    parent = os.getppid()
    with open(f"/proc/{parent}/stat") as f:
        started = f.read().rsplit(")", 1)[1].split()[19]
    return os.path.join(MARKERS, f"{parent}-{started}")


class DiesOnce(Reverse):
    """`Reverse`, except that the first server a process starts for it dies
    (exit code 3) at its first step, mid-episode; the servers started after it play on."""

    def step(self, action: ReverseAction, timeout_s: float | None = None, **kwargs: Any):
        marker = _parent_marker()
        if not os.path.exists(marker):
            os.makedirs(MARKERS, exist_ok=True)
            open(marker, "w").close()
            os._exit(3)
        return super().step(action, timeout_s, **kwargs)


class Solo(Reverse):
    """`Reverse` without concurrent sessions: a server plays one episode at a time."""

    SUPPORTS_CONCURRENT_SESSIONS = False


class NotTyped(Environment):
    """An Environment that does not say its Action and Observation classes."""

    def reset(self, seed=None, episode_id=None, **kwargs):
        return Observation()

    def step(self, action, timeout_s=None, **kwargs):
        return Observation(done=True)

    @property
    def state(self):
        return State()
