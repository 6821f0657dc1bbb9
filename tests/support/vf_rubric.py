"""What tests/unit/test_verifiers.py and tests/e2e/test_verifiers.py share: the name of the
tests' taskset (tests/support/vf_taskset.py), its rubric written again, and a JSONL reader.
No verifiers import here: the test files skip themselves without the extra."""

import json
import re

NAME = "verifiers:tests.support.vf_taskset"


def rubric(prompt: str, completion: str) -> float:
    """The test taskset's rubric, written again: 0.75 per-position credit + 0.25 exact."""
    answer = re.fullmatch(r"(\d{3})>", prompt).group(1)[::-1]
    reply = completion.strip()
    positions = sum(a == b for a, b in zip(reply, answer, strict=False)) / max(3, len(reply))
    return 0.75 * positions + 0.25 * (reply == answer)


def read_jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]
