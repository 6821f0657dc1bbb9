"""Programs against tests: the completion is a Python program (a ```python
block if it has one, else the whole text); it runs once in the sandbox
(`meshrl.envs.sandbox`) followed by each of the task's tests, and the reward is
the fraction of tests that pass.

A dataset row needs the prompt and `tests`: a list of Python statements
(usually `assert ...`). The shipped generator writes small function tasks.

A test of the form `assert EXPR == LITERAL` is judged outside the sandbox:
only EXPR goes in, the sandbox prints `repr` of its value, and this process
compares that, read back as a literal, with LITERAL. The expected value never
enters the program's process, so nothing the program does there (searching
frames or memory for it, rebinding builtins, a custom `__eq__`) passes such a
test without computing the value. Other tests run inside; their pass count
comes back on a line tagged with a random nonce kept out of the program's
reach by name, which a program that searches the harness's frames could
forge. A program that never defines the names the tests call scores 0
without running.
"""

from __future__ import annotations

import ast
import json
import random
import re
import uuid
from typing import Any

from meshrl.envs.base import Env
from meshrl.types import Prompt

_BLOCK = re.compile(r"```(?:python)?\n?(.*?)```", re.DOTALL)

_HARNESS = """
import builtins as _builtins, json as _json, sys as _sys


def _main(_read=_sys.stdin.read, _exec=exec, _exec_eval=eval, _compile=compile,
          _out=_sys.__stdout__, _dumps=_json.dumps, _repr=repr):
    # What the tests need is bound here, before the program runs: a program that
    # rebinds exec, compile or a builtin changes its own scope, not the tests'.
    spec = _json.loads(_read())
    clean = dict(vars(_builtins))
    scope = {"__name__": "solution"}
    try:
        _exec(_compile(spec.pop("program"), "solution.py", "exec"), scope)
    except BaseException as error:
        print("program:", type(error).__name__, error, file=_sys.stderr)
    passed, values = 0, []
    for test in spec["tests"]:
        try:
            _exec(_compile(test, "test.py", "exec"), {**scope, "__builtins__": dict(clean)})
            passed += 1
        except BaseException:
            pass
    for expr in spec["exprs"]:
        try:
            value = _exec_eval(_compile(expr, "test.py", "eval"),
                               {**scope, "__builtins__": dict(clean)})
            values.append(_repr(value))
        except BaseException:
            values.append(None)
    _out.write("\\n" + spec["nonce"] + " " + _dumps([passed, values]) + "\\n")
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


def split_test(test: str) -> tuple[str, Any] | None:
    """`assert EXPR == LITERAL` -> (EXPR's source, LITERAL's value); None for
    any other test."""
    try:
        tree = ast.parse(test)
    except (SyntaxError, ValueError):
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        return None
    check = tree.body[0].test
    if not (isinstance(check, ast.Compare) and len(check.ops) == 1):
        return None
    if not isinstance(check.ops[0], ast.Eq):
        return None
    try:
        return ast.unparse(check.left), ast.literal_eval(check.comparators[0])
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return None


def _equal(printed: str | None, expected: Any) -> bool:
    if printed is None:
        return False
    try:
        return bool(ast.literal_eval(printed) == expected)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False  # not a literal: an object the test could not have meant


def run_tests(program: str, tests: list[str], timeout_s: float = 5.0) -> tuple[int, str]:
    """(tests passed, the sandbox's error or '') for `program`."""
    from meshrl.envs.sandbox import run_python

    missing = undefined_names(program, tests)
    if missing:
        return 0, f"the program does not define {', '.join(missing)}"

    split = [split_test(test) for test in tests]
    inside = [test for test, parts in zip(tests, split, strict=True) if parts is None]
    judged = [parts for parts in split if parts is not None]
    nonce = f"__passed_{uuid.uuid4().hex}__"
    spec = json.dumps(
        {"program": program, "tests": inside, "exprs": [e for e, _ in judged], "nonce": nonce}
    )
    result = run_python(_HARNESS, stdin=spec, timeout_s=timeout_s)
    for line in reversed(result.stdout.splitlines()):
        if line.startswith(nonce):
            try:
                passed, values = json.loads(line[len(nonce) :])
                values = list(values)[: len(judged)]
                passed = min(int(passed), len(inside))
            except (ValueError, TypeError):
                break
            passed += sum(
                _equal(v, expected) for v, (_, expected) in zip(values, judged, strict=False)
            )
            return passed, result.error
    return 0, result.error or "no test result"


class Code(Env):
    sandboxed = True  # runs model-written programs: needs the sandbox's minimum isolation
    threaded = True  # each reward is a sandboxed program: run them side by side

    def generate(self, rng: random.Random) -> Prompt:
        name, arg, what, body = rng.choice(_TASKS)
        k, c = rng.randint(1, 9), rng.choice("abcxyz")
        name, what, body = (t.format(k=k, c=c) for t in (name, what, body))
        # Inputs on which every other constant gives another value: a wrong
        # program fails every test (nonzero x; strings of 10+ characters in which
        # each letter occurs a different number of times).
        if arg == "x":
            inputs = [rng.choice([-1, 1]) * rng.randint(1, 50) for _ in range(4)]
        else:
            inputs = []
            for _ in range(4):
                letters = list("abcxyz")
                rng.shuffle(letters)
                chars = [letter for n, letter in enumerate(letters) for _ in range(n)]
                rng.shuffle(chars)
                inputs.append("".join(chars))
        solution = f"def {name}({arg}):\n    return {body}\n"
        scope: dict = {}
        exec(solution, scope)  # our own generated solution, never model text
        tests = [f"assert {name}({value!r}) == {scope[name](value)!r}" for value in inputs]
        return Prompt(
            text=f"Write a Python function {name}({arg}) that {what}. ",
            answer=solution,
            data={"tests": tests},
        )

    def demonstration(self, prompt: Prompt) -> str:
        """The reference solution on one line (the default tokenizer has no
        newline): a short warm-start on these teaches the shape of a program;
        which constant passes the tests, RL learns."""
        return " ".join(line.strip() for line in prompt.answer.splitlines() if line.strip())

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
