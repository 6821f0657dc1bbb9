"""The embedded default task: reverse a string of digits.

Prompt `471>`, answer `174`. The reward gives partial credit per position:
(number of positions i with completion[i] == answer[i]) / max(len(answer),
len(completion)). A completion that ignores the prompt can match each position
only by chance, so its expected reward is about 0.1; the correct reversal
scores 1.
"""

from __future__ import annotations

import random

from meshrl.envs.base import Env
from meshrl.types import Prompt


class Task(Env):
    """A single-turn task with a verifiable reward: `sample` and `reward`."""


def positional_match(completion: str, answer: str) -> float:
    """Fraction of positions that agree, over the longer of the two strings."""
    length = max(len(answer), len(completion))
    if length == 0:
        return 1.0
    matches = sum(a == b for a, b in zip(completion, answer, strict=False))
    return matches / length


class ReverseDigits(Task):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.num_digits = cfg.num_digits
        self.max_digits = max(cfg.num_digits, getattr(cfg, "max_digits", 0))

    def sample(self, num_prompts: int, rng: random.Random) -> list[Prompt]:
        prompts = []
        for _ in range(num_prompts):
            length = self.num_digits
            if self.max_digits > self.num_digits:
                length = rng.randint(self.num_digits, self.max_digits)
            digits = "".join(rng.choice("0123456789") for _ in range(length))
            prompts.append(Prompt(text=f"{digits}>", answer=digits[::-1]))
        return prompts

    def reward(self, prompt: Prompt, completion: str) -> float:
        return positional_match(completion.strip(), prompt.answer)


def preference_pairs(num_digits: int = 3, seed: int = 0) -> list[dict]:
    """One preference pair per `num_digits`-digit string, for DPO: the chosen
    response is the reversal, the rejected one a plausible mistake (the digits
    copied unreversed, two positions swapped, or one digit changed)."""
    rng = random.Random(seed)
    pairs = []
    for value in range(10**num_digits):
        digits = f"{value:0{num_digits}d}"
        answer = digits[::-1]
        while True:
            kind = rng.choice(("copy", "swap", "change"))
            wrong = list(answer)
            if kind == "copy":
                wrong = list(digits)
            elif kind == "swap":
                i, j = rng.sample(range(num_digits), 2)
                wrong[i], wrong[j] = wrong[j], wrong[i]
            else:
                i = rng.randrange(num_digits)
                wrong[i] = rng.choice([d for d in "0123456789" if d != wrong[i]])
            if "".join(wrong) != answer:
                break
        pairs.append({"prompt": f"{digits}>", "chosen": answer, "rejected": "".join(wrong)})
    rng.shuffle(pairs)
    return pairs
