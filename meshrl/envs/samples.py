"""Writes the sample datasets shipped in `meshrl/envs/data/` (synthetic, from
each environment's own generator, seeded):

    python -m meshrl.envs.samples          # rewrite them
    python -m meshrl.envs.samples --check  # exit 1 if a file differs

- math.jsonl: `question`, `answer` (GSM8K's "... #### N"); use
  `task.prompt_field=question`.
- countdown.jsonl: `prompt`, `answer`, `numbers`, `target`.
- calculator.jsonl: `prompt`, `answer`.
- code.jsonl: `prompt`, `answer` (a reference solution), `tests`.
"""

from __future__ import annotations

import json
import os
import random
import sys

ROWS = 200
DATA_DIR = os.path.join(os.path.dirname(__file__), "data")


def rows(name: str, count: int = ROWS, seed: int = 0) -> list[dict]:
    from meshrl.config import TaskConfig
    from meshrl.envs import make_task

    env, rng = make_task(TaskConfig(name=name)), random.Random(seed)
    out = []
    for _ in range(count):
        prompt = env.generate(rng)
        text_key = "question" if name == "math" else "prompt"
        out.append({text_key: prompt.text, "answer": prompt.answer, **(prompt.data or {})})
    return out


def files() -> dict[str, str]:
    """File name -> contents of every shipped sample dataset."""
    return {
        f"{name}.jsonl": "".join(json.dumps(row) + "\n" for row in rows(name))
        for name in ("math", "countdown", "calculator", "code")
    }


def main(argv: list[str]) -> int:
    stale = []
    for name, text in files().items():
        path = os.path.join(DATA_DIR, name)
        if "--check" in argv:
            with open(path) as f:
                if f.read() != text:
                    stale.append(path)
            continue
        with open(path, "w") as f:
            f.write(text)
        print(f"wrote {path}")
    for path in stale:
        print(f"{path} differs from its generator", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
