"""Visual tasks with verifiable answers: count the red shapes in a picture
(`vision_count`, one turn), or first zoom into a quarter of it, which a tool
returns as a new picture (`vision_zoom`, two turns).

Each prompt is an image drawn here in code (no files, nothing downloaded): a
`GRID` x `GRID` board of `CELL`-pixel cells on a grey ground, with one to
`MAX_RED` red shapes and up to `MAX_OTHER` green or blue ones, each a filled
square or disc in a cell of its own. The text asks `How many red?`; the answer
is the count as a digit. Reward 1 for the exact count (the completion's first
digit), else 0: a model that cannot see scores 1 / MAX_RED by guessing.
"""

from __future__ import annotations

import random

import numpy as np

from meshrl.envs.base import Episode, Step
from meshrl.envs.digits import Task
from meshrl.types import Prompt

GRID, CELL = 4, 8
MAX_RED, MAX_OTHER = 4, 3
COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 70, 220)}
QUESTION = "How many red?"


def draw_board(shapes: list[tuple[int, int, str, str]], rng: random.Random) -> np.ndarray:
    """An [H, W, 3] uint8 picture of `shapes`: (row, column, colour, kind) with
    kind `square` or `disc`, each jittered a pixel or two inside its cell."""
    side = GRID * CELL
    board = np.full((side, side, 3), 128, dtype=np.uint8)
    yy, xx = np.mgrid[0:CELL, 0:CELL]
    for row, column, colour, kind in shapes:
        size = rng.randint(CELL - 3, CELL - 1)
        dy, dx = rng.randint(0, CELL - size), rng.randint(0, CELL - size)
        if kind == "square":
            inside = (yy >= dy) & (yy < dy + size) & (xx >= dx) & (xx < dx + size)
        else:
            centre, radius = (dy + size / 2 - 0.5, dx + size / 2 - 0.5), size / 2
            inside = (yy - centre[0]) ** 2 + (xx - centre[1]) ** 2 <= radius**2
        cell = board[row * CELL : (row + 1) * CELL, column * CELL : (column + 1) * CELL]
        cell[inside] = COLOURS[colour]
    return board


class VisionCount(Task):
    """`task.name: vision_count` (single turn): count the red shapes."""

    def generate(self, rng: random.Random) -> Prompt:
        red, other = rng.randint(1, MAX_RED), rng.randint(0, MAX_OTHER)
        cells = rng.sample([(r, c) for r in range(GRID) for c in range(GRID)], red + other)
        colours = ["red"] * red + [rng.choice(("green", "blue")) for _ in range(other)]
        shapes = [
            (r, c, colour, rng.choice(("square", "disc")))
            for (r, c), colour in zip(cells, colours, strict=True)
        ]
        return Prompt(text=QUESTION, answer=str(red), images=[draw_board(shapes, rng)])

    def reward(self, prompt: Prompt, completion: str) -> float:
        digits = [ch for ch in completion if ch.isdigit()]
        return float(bool(digits) and digits[0] == prompt.answer)

    def demonstration(self, prompt: Prompt) -> str:
        return prompt.answer


ZOOM_QUESTION = "How many red? Zoom 1-4 first."


def quarter(board: np.ndarray, which: int) -> np.ndarray:
    """Quarter `which` (1 top left, 2 top right, 3 bottom left, 4 bottom right) of
    `board`, enlarged 2x to the board's size (each pixel repeated)."""
    half = board.shape[0] // 2
    row, column = divmod(which - 1, 2)
    part = board[row * half : (row + 1) * half, column * half : (column + 1) * half]
    return part.repeat(2, axis=0).repeat(2, axis=1)


class VisionZoom(VisionCount):
    """`task.name: vision_zoom` (two turns): the model names a quarter (its first
    digit 1-4; 1 otherwise), the tool answers with that quarter enlarged as a new
    picture, and the model's second turn gives the count of the whole board."""

    max_turns = 2

    def generate(self, rng: random.Random) -> Prompt:
        prompt = super().generate(rng)
        prompt.text = ZOOM_QUESTION
        return prompt

    def episode(self, prompt: Prompt) -> Episode:
        return _Zoom(self, prompt)

    def demonstration(self, prompt: Prompt) -> list[str]:
        return ["1", prompt.answer]


class _Zoom(Episode):
    def __init__(self, task: VisionZoom, prompt: Prompt):
        self.task, self.prompt, self.zoomed = task, prompt, False

    def step(self, action: str) -> Step:
        if self.zoomed:
            return Step(reward=self.task.reward(self.prompt, action), done=True)
        self.zoomed = True
        which = next((int(ch) for ch in action if ch in "1234"), 1)
        board = np.asarray(self.prompt.images[0])
        return Step(observation=f" zoom {which}:", done=False, images=[quarter(board, which)])
