"""Math answer checking (GSM8K-style) and countdown, both single-turn.

`math`: a word problem; the completion's answer is read from `\\boxed{...}`,
else from `#### ...` (GSM8K's format), else the last number in the text. The
gold answer is read the same way, so a GSM8K `answer` field ("... #### 42")
works as it is. The two are compared by HF `math-verify` (the `math` extra):
symbolic and numeric equality of what it parses (`\\frac{1}{2}` = `0.5`,
`1,234` = `1234`). Without it, or for an answer it cannot parse, they are
compared as exact fractions after normalization (commas, `$`, `%`, spaces and
a trailing period dropped), else as lower-case text.

`countdown`: reach a target from given numbers with + - * / (each number at
most once). The expression is parsed and evaluated by a small exact
arithmetic interpreter (`arith`): model text is never given to `eval`.
"""

from __future__ import annotations

import ast
import logging
import random
import re
from collections import Counter
from fractions import Fraction

from meshrl.envs.base import Env
from meshrl.types import Prompt

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def extract_answer(text: str) -> str | None:
    """The final answer in a completion: \\boxed{..} (the last), #### .., or the last number."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        return tail.splitlines()[0] if tail else None
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def normalize_number(text: str | None) -> Fraction | str | None:
    """'1,234' -> 1234, '$5.50' -> 11/2, '50%' -> 50, '3/4' -> 3/4; text that is
    not a number -> its stripped lower-case form."""
    if text is None:
        return None
    cleaned = text.strip().replace(",", "").replace("$", "").replace("%", "").replace(" ", "")
    cleaned = cleaned.rstrip(".").removeprefix("\\$")
    for wrapper in ("\\text{", "\\mathrm{"):
        if cleaned.startswith(wrapper) and cleaned.endswith("}"):
            cleaned = cleaned[len(wrapper) : -1]
    frac = re.fullmatch(r"\\d?frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", cleaned)
    if frac:
        cleaned = f"{frac.group(1)}/{frac.group(2)}"
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return text.strip().lower()


def answers_match(completion: str, gold: str) -> bool:
    predicted = extract_answer(completion)
    expected = extract_answer(gold) if "####" in gold or "\\boxed" in gold else gold
    if predicted is None or expected is None:
        return False
    verified = math_verify(predicted, expected)
    if verified is not None:
        return verified
    return normalize_number(predicted) == normalize_number(expected)


def math_verify(predicted: str, expected: str) -> bool | None:
    """HF math-verify's verdict on two extracted answers, or None when it is not
    installed or parses nothing in one of them. Its signal-based timeouts are off
    (they need the main thread); the environment's `task.step_timeout_s` bounds
    the reward instead (MathAnswer runs in the environment procs' threads)."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled", per call

    def parsed(answer: str) -> list:
        bare = answer.strip().removeprefix("\\$").lstrip("$")  # a currency sign, not math mode
        return parse("$" + bare + "$", parsing_timeout=None)

    gold, prediction = parsed(expected), parsed(predicted)
    if not gold or not prediction:
        return None
    return bool(verify(gold, prediction, timeout_seconds=None))


# --- exact arithmetic on model text (no eval) ----------------------------------------

_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


class ArithmeticError_(ValueError):
    """Not an arithmetic expression meshrl evaluates."""


def arith(expression: str, max_length: int = 200) -> tuple[Fraction, list[int]]:
    """Evaluate + - * / ( ) over integer literals exactly; returns the value and
    the literals used. Anything else (names, calls, powers, huge input) raises."""
    if len(expression) > max_length:
        raise ArithmeticError_(f"expression longer than {max_length} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ArithmeticError_("not an arithmetic expression") from None
    literals: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            if abs(node.value) > 10**12:
                raise ArithmeticError_("number too large")
            literals.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = walk(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and type(node.op) in (*_OPS, ast.Div):
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div):
                if right == 0:
                    raise ArithmeticError_("division by zero")
                return left / right
            return _OPS[type(node.op)](left, right)
        raise ArithmeticError_(f"'{type(node).__name__}' is not allowed")

    return walk(tree.body), literals


def format_number(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6g}"


# --- the environments ------------------------------------------------------------------

_ITEMS = ["apples", "books", "coins", "marbles", "stamps", "cards"]
_NAMES = ["Ann", "Ben", "Cal", "Dee", "Eve", "Finn"]


class MathAnswer(Env):
    """Word problems with numeric answers (GSM8K-style `#### N`)."""

    threaded = True  # math-verify's sympy work is bounded by task.step_timeout_s there

    def generate(self, rng: random.Random) -> Prompt:
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        a, b, c = rng.randint(2, 30), rng.randint(2, 30), rng.randint(2, 5)
        kind = rng.randrange(3)
        if kind == 0:
            text = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have?"
            value, why = a + b, f"{a} + {b} = {a + b}"
        elif kind == 1:
            total = a + b
            text = f"{name} had {total} {item} and gave away {b}. How many are left?"
            value, why = a, f"{total} - {b} = {a}"
        else:
            text = f"{name} buys {c} boxes with {a} {item} each. How many {item} is that?"
            value, why = a * c, f"{c} * {a} = {a * c}"
        return Prompt(text=f"{text} Answer: ", answer=f"{why} #### {value}")

    def reward(self, prompt: Prompt, completion: str) -> float:
        return 1.0 if answers_match(completion, prompt.answer) else 0.0

    def demonstration(self, prompt: Prompt) -> str:
        return prompt.answer


class Countdown(Env):
    """Reach the target with the given numbers and + - * /, each at most once."""

    def generate(self, rng: random.Random) -> Prompt:
        numbers = [rng.randint(1, 10) for _ in range(rng.randint(3, 4))]
        expression = str(numbers[0])
        for n in numbers[1:]:
            expression = f"({expression}{rng.choice('+-*')}{n})"
        target = int(arith(expression)[0])
        shown = sorted(numbers)
        text = f"Use {shown} with + - * / to make {target}. Expression: "
        return Prompt(
            text=text,
            answer=expression,
            data={"numbers": shown, "target": target},
        )

    def from_row(self, row: dict) -> Prompt:
        prompt = super().from_row(row)
        prompt.data = {"numbers": list(row["numbers"]), "target": int(row["target"])}
        return prompt

    def reward(self, prompt: Prompt, completion: str) -> float:
        expression = completion.strip().split("=")[0]
        try:
            value, used = arith(expression)
        except ArithmeticError_:
            return 0.0
        allowed = Counter(prompt.data["numbers"])
        if Counter(used) - allowed:  # a number not given, or used too often
            return 0.0
        return 1.0 if value == prompt.data["target"] else 0.0
