"""Writes the sample datasets shipped in `meshrl/envs/data/` (synthetic, from
each environment's own generator, seeded):

    python -m meshrl.envs.samples OUT_DIR            # write them into OUT_DIR
    python -m meshrl.envs.samples --check            # exit 1 if a shipped file differs
    python -m meshrl.envs.samples --overwrite-shipped  # rewrite the shipped files

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

from meshrl.config.generated import write_or_check

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
    """Write the datasets into the directory given, check the shipped ones
    (`--check`), or rewrite them (`--overwrite-shipped`, and only then)."""
    check, overwrite = "--check" in argv, "--overwrite-shipped" in argv
    targets = [a for a in argv if not a.startswith("--")]
    if not check and not overwrite and len(targets) != 1:
        print(
            "usage: python -m meshrl.envs.samples OUT_DIR | --check | --overwrite-shipped "
            f"(the shipped files are in {DATA_DIR})",
            file=sys.stderr,
        )
        return 2
    out_dir = DATA_DIR if check or overwrite else targets[0]
    paths = {os.path.join(out_dir, name): text for name, text in files().items()}
    return write_or_check(paths, check, "python -m meshrl.envs.samples --overwrite-shipped")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
