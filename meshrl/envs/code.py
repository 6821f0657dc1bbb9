"""Programs against tests: the completion is a Python program (a ```python
block if it has one, else the whole text); it runs once in the sandbox
(`meshrl.envs.sandbox`) followed by each of the task's tests, and the reward is
the fraction of tests that pass.

A dataset row needs the prompt and `tests`: a list of Python statements
(usually `assert ...`). The shipped generator writes small function tasks.

The tests' pass count comes back on a line tagged with a random nonce, read
from stdin before the program runs and kept out of the program's reach by
name (not in `__main__`). A program that never defines the names the tests
call scores 0 without running, and tests run with the builtins as they were
before the program (so rebinding `exec` or `AssertionError` passes nothing).
A program that searches the harness's frames for the nonce can still forge
it: reward hacking is bounded by that, not excluded (the sandbox's kernel
limits are what stop a program from reaching outside).
"""

from __future__ import annotations

import ast
import json
import random
import re
import uuid

from meshrl.envs.base import Env
from meshrl.types import Prompt

_BLOCK = re.compile(r"```(?:python)?\n?(.*?)```", re.DOTALL)

_HARNESS = """
import builtins as _builtins, json as _json, sys as _sys


def _main(_read=_sys.stdin.read, _exec=exec, _compile=compile, _out=_sys.__stdout__):
    # What the tests need is bound here, before the program runs: a program that
    # rebinds exec, compile or a builtin changes its own scope, not the tests'.
    spec = _json.loads(_read())
    clean = dict(vars(_builtins))
    scope = {"__name__": "solution"}
    try:
        _exec(_compile(spec.pop("program"), "solution.py", "exec"), scope)
    except BaseException as error:
        print("program:", type(error).__name__, error, file=_sys.stderr)
    passed = 0
    for test in spec["tests"]:
        try:
            _exec(_compile(test, "test.py", "exec"), {**scope, "__builtins__": dict(clean)})
            passed += 1
        except BaseException:
            pass
    _out.write("\\n" + spec["nonce"] + " " + str(passed) + "\\n")
    _out.flush()


_main()
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


def undefined_names(program: str, tests: list[str]) -> list[str]:
    """The names the tests call that `program` never binds at its top level
    (a def, a class, an assignment or an import), builtins aside. A program
    that defines nothing the tests call cannot pass them honestly: it scores 0
    before it runs. One that does not parse defines nothing."""
    import builtins

    called = {
        node.func.id
        for test in tests
        for node in ast.walk(ast.parse(test))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    } - set(vars(builtins))
    try:
        tree = ast.parse(program)
    except (SyntaxError, ValueError):
        return sorted(called)
    bound = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        else:
            for target in ast.walk(node):
                if isinstance(target, ast.Name) and isinstance(target.ctx, ast.Store):
                    bound.add(target.id)
    return sorted(called - bound)


def run_tests(program: str, tests: list[str], timeout_s: float = 5.0) -> tuple[int, str]:
    """(tests passed, the sandbox's error or '') for `program`."""
    from meshrl.envs.sandbox import run_python

    missing = undefined_names(program, tests)
    if missing:
        return 0, f"the program does not define {', '.join(missing)}"

    nonce = f"__passed_{uuid.uuid4().hex}__"
    spec = json.dumps({"program": program, "tests": list(tests), "nonce": nonce})
    result = run_python(_HARNESS, stdin=spec, timeout_s=timeout_s)
    for line in reversed(result.stdout.splitlines()):
        if line.startswith(nonce):
            return min(int(line.split()[-1]), len(tests)), result.error
    return 0, result.error or "no test result"


class Code(Env):
    sandboxed = True  # runs model-written programs: needs the sandbox's minimum isolation
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
