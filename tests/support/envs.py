"""Environments that misbehave on purpose, importable by the environment procs
(`task.name=tests.support.envs:Flaky`)."""

import itertools
import os
import tempfile
import time

from meshrl.envs import Env, Episode, Step
from meshrl.envs.digits import ReverseDigits
from meshrl.envs.vision import VisionZoom


class Flaky(ReverseDigits):
    """Multi-turn reverse-digits whose first three episodes fail: one raises, one
    hangs past the step timeout, one returns garbage. Later ones run 2 turns:
    a reply, then the reward."""

    max_turns = 2

    def __init__(self, cfg):
        super().__init__(cfg)
        self.calls = itertools.count()  # per environment actor

    def episode(self, prompt):
        return _FlakyEpisode(next(self.calls), prompt)


class _FlakyEpisode(Episode):
    def __init__(self, number, prompt):
        self.number, self.prompt, self.turns = number, prompt, 0

    def step(self, action):
        self.turns += 1
        if self.number == 0:
            raise RuntimeError("the tool crashed")
        if self.number == 1:
            time.sleep(1.5)
        if self.number == 2:
            return "not a step"
        if self.turns == 1:
            return Step(observation=" <result>again</result> ", done=False, info={"tool_calls": 1})
        return Step(reward=1.0 if action.strip() == self.prompt.answer else 0.0)


class FlakyScore(ReverseDigits):
    """Single-turn, run inline (not threaded): reward call number `fail_at`
    (counted per environment actor, from 0) raises; the others score as
    reverse-digits."""

    fail_at = 0

    def __init__(self, cfg):
        super().__init__(cfg)
        self.calls = itertools.count()

    def reward(self, prompt, completion):
        if next(self.calls) == self.fail_at:
            raise ValueError("reward server unreachable")
        return super().reward(prompt, completion)


class FailsAtCall520(FlakyScore):
    fail_at = 520


class FailsAtCall130(FlakyScore):
    fail_at = 130


class BrokenZoom(VisionZoom):
    """`vision_zoom` whose tool, the first time it zooms on each environment
    proc, returns a corrupt image file (the controller cannot read it)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.zooms = itertools.count()

    def episode(self, prompt):
        episode = super().episode(prompt)
        step = episode.step

        def broken_step(action):
            out = step(action)
            if out.images and next(self.zooms) == 0:
                path = os.path.join(tempfile.gettempdir(), "meshrl_corrupt_zoom.png")
                with open(path, "wb") as f:
                    f.write(b"\x89PNG but not really")
                out.images = [path]
            return out

        episode.step = broken_step
        return episode


__all__ = ["BrokenZoom", "Env", "FailsAtCall130", "FailsAtCall520", "Flaky", "FlakyScore"]
