"""Programs against tests: the completion is a Python program (a ```python
block if it has one, else the whole text); it runs once in the sandbox
(`meshrl.envs.sandbox`) followed by each of the task's tests, and the reward is
the fraction of tests that pass.

A dataset row needs the prompt and `tests`: a list of Python statements
(usually `assert ...`). The shipped generator writes small function tasks.

The tests' pass count comes back on a line tagged with a random nonce, read
from stdin before the program runs. A program that searches the harness's
frames for the nonce can still forge it: reward hacking is bounded by that,
not excluded.
"""

from __future__ import annotations

import json
import random
import re
import uuid

from meshrl.envs.base import Env
from meshrl.types import Prompt

_BLOCK = re.compile(r"```(?:python)?\n?(.*?)```", re.DOTALL)

_HARNESS = """
import json as _json, sys as _sys
_spec = _json.loads(_sys.stdin.read())
_passed = 0
_scope = {"__name__": "solution"}
try:
    exec(compile(_spec["program"], "solution.py", "exec"), _scope)
except BaseException as _error:
    print("program:", type(_error).__name__, _error, file=_sys.stderr)
for _test in _spec["tests"]:
    try:
        exec(compile(_test, "test.py", "exec"), dict(_scope))
        _passed += 1
    except BaseException:
        pass
print("\\n" + _spec["nonce"], _passed)
"""

_TASKS = [
    ("add_{k}", "x", "returns x plus {k}", "x + {k}"),
    ("times_{k}", "x", "returns x times {k}", "x * {k}"),
    ("last_{k}", "s", "returns the last {k} characters of the string s", "s[-{k}:]"),
    ("count_{c}", "s", "returns how many times the character '{c}' occurs in s", "s.count('{c}')"),
]


def extract_program(completion: str) -> str:
    blocks = _BLOCK.findall(completion)
    return blocks[-1] if blocks else completion


def run_tests(program: str, tests: list[str], timeout_s: float = 5.0) -> tuple[int, str]:
    """(tests passed, the sandbox's error or '') for `program`."""
    from meshrl.envs.sandbox import run_python

    nonce = f"__passed_{uuid.uuid4().hex}__"
    spec = json.dumps({"program": program, "tests": list(tests), "nonce": nonce})
    result = run_python(_HARNESS, stdin=spec, timeout_s=timeout_s)
    for line in reversed(result.stdout.splitlines()):
        if line.startswith(nonce):
            return min(int(line.split()[-1]), len(tests)), result.error
    return 0, result.error or "no test result"


class Code(Env):
    threaded = True  # each reward is a sandboxed program: run them side by side

    def generate(self, rng: random.Random) -> Prompt:
        name, arg, what, body = rng.choice(_TASKS)
        k, c = rng.randint(1, 9), rng.choice("abcxyz")
        name, what, body = (t.format(k=k, c=c) for t in (name, what, body))
        if arg == "x":
            inputs = [rng.randint(-50, 50) for _ in range(4)]
        else:
            inputs = [
                "".join(rng.choice("abcxyz") for _ in range(rng.randint(3, 9))) for _ in range(4)
            ]
        solution = f"def {name}({arg}):\n    return {body}\n"
        scope: dict = {}
        exec(solution, scope)  # our own generated solution, never model text
        tests = [f"assert {name}({value!r}) == {scope[name](value)!r}" for value in inputs]
        return Prompt(
            text=f"Write a Python function {name}({arg}) that {what}. ",
            answer=solution,
            data={"tests": tests},
        )

    def from_row(self, row: dict) -> Prompt:
        prompt = super().from_row(row)
        if not isinstance(row.get("tests"), list):
            raise ValueError(f"code task row needs a list 'tests', got {row.get('tests')!r}")
        return prompt

    def reward(self, prompt: Prompt, completion: str) -> float:
        tests = prompt.data["tests"]
        passed, _ = run_tests(
            extract_program(completion), tests, getattr(self.cfg, "tool_timeout_s", 5.0)
        )
        return passed / len(tests)
