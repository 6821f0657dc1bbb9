"""Multi-turn tool use: a calculator and a Python tool, and a latency probe.

The tool-call format (documented in the prompt the model sees):

- `<calc>EXPRESSION</calc>`: + - * / ( ) on integers, evaluated exactly
  (`meshrl.envs.math.arith`, never `eval`).
- `<python>CODE</python>`: runs in the sandbox (`meshrl.envs.sandbox`); its
  stdout comes back (or the error's last line).
- `<answer>VALUE</answer>`: ends the episode. The reward is 1 when VALUE equals
  the answer as a number, else 0 (`env/correct` counts them).

Each tool call's output returns as ` <result>...</result> `, one line, at most
200 characters. A turn with neither a call nor an answer gets ` <result>no
call</result> `. The episode ends at the answer or after `max_turns` model turns
(default 3, `task.max_turns`), with reward 0 if no answer was given.

`slow_tool` measures rollout concurrency: every step sleeps
`task.tool_latency_s` (a tool's latency; a prompt's `data["latency_s"]`
overrides it) and the episode ends after `max_turns` turns with reward 1.
"""

from __future__ import annotations

import random
import re
import time

from meshrl.envs.base import Env, Episode, Step
from meshrl.envs.math import ArithmeticError_, arith, format_number, normalize_number
from meshrl.types import Prompt

_CALL = re.compile(r"<(calc|python|answer)>(.*?)</\1>", re.DOTALL)
MAX_RESULT_CHARS = 200
FORMAT = "Tools: <calc>1+2</calc>, <python>print(3)</python>. Reply <answer>N</answer>."


def one_line(text: str) -> str:
    """Tool output as one short line (newlines become ' | ')."""
    text = " | ".join(line.strip() for line in text.strip().splitlines() if line.strip())
    return text[:MAX_RESULT_CHARS]


class Calculator(Env):
    """4-digit products of two 2-digit numbers, which a small model cannot work out in
    its head: it must call the calculator and copy the result into its answer.
    `task.tools` lists the tools that work (`[]`: the ablation, every call
    answers that the tool is disabled)."""

    sandboxed = True  # runs model-written programs: needs the sandbox's minimum isolation
    max_turns = 3
    demo_calls = 0.25
    """The share of warm-start traces that call the calculator."""

    def generate(self, rng: random.Random) -> Prompt:
        # A 4-digit product whose first and last digits are drawn uniformly,
        # then one of its factorizations: each digit near uniform, so that no
        # constant answer earns partial credit.
        product = rng.choice(_PRODUCTS[rng.choice(sorted(_PRODUCTS))])
        a = rng.choice([a for a in range(10, 100) if product % a == 0 and product // a < 100])
        expression = f"{a} * {product // a}"
        return Prompt(
            text=f"What is {expression}? {FORMAT} ",
            answer=str(product),
            data={"expression": expression},
        )

    def episode(self, prompt: Prompt) -> Episode:
        return ToolEpisode(
            prompt,
            timeout_s=getattr(self.cfg, "tool_timeout_s", 5.0),
            tools=getattr(self.cfg, "tools", TOOLS),
        )

    def demonstration(self, prompt: Prompt) -> list[str]:
        """A trace made in code on a random question: a share (`demo_calls`)
        call the calculator and copy its result, the rest answer at once (as a
        model that could multiply in its head would). A short warm-start on
        these teaches the format, and the copy in part; that calling pays, RL
        learns."""
        rng = self._demo_rng = getattr(self, "_demo_rng", None) or random.Random(0)
        answer = f"<answer>{prompt.answer}</answer>"
        if rng.random() >= self.demo_calls:
            return [answer]
        expression = (prompt.data or {}).get("expression") or prompt.text
        return [f"<calc>{expression}</calc>", answer]


TOOLS = ("calc", "python")
_PRODUCTS: dict[str, list[int]] = {}
for _p in sorted({a * b for a in range(10, 100) for b in range(10, 100) if a * b >= 1000}):
    _PRODUCTS.setdefault(str(_p)[0] + str(_p)[-1], []).append(_p)


class ToolEpisode(Episode):
    def __init__(self, prompt: Prompt, timeout_s: float = 5.0, tools=TOOLS):
        self.prompt, self.timeout_s, self.tools = prompt, timeout_s, tuple(tools)

    def step(self, action: str) -> Step:
        match = _CALL.search(action)
        if match is None:
            return Step(observation=" <result>no call</result> ", done=False)
        tool, body = match.group(1), match.group(2)
        if tool == "answer":
            correct = normalize_number(body) == normalize_number(self.prompt.answer)
            return Step(reward=float(correct), info={"answers": 1, "correct": int(correct)})
        if tool not in self.tools:
            output = f"error: {tool} is disabled"
        elif tool == "calc":
            try:
                output = format_number(arith(body)[0])
            except ArithmeticError_ as error:
                output = f"error: {error}"
        else:
            from meshrl.envs.sandbox import run_python

            result = run_python(body, timeout_s=self.timeout_s)
            output = result.stdout if result.ok else f"error: {result.error}"
        return Step(
            observation=f" <result>{one_line(output)}</result> ",
            done=False,
            info={"tool_calls": 1},
        )


class SlowTool(Env):
    """Every step waits `task.tool_latency_s`, as a slow tool would."""

    max_turns = 4

    def generate(self, rng: random.Random) -> Prompt:
        digits = "".join(rng.choice("0123456789") for _ in range(3))
        return Prompt(text=f"{digits}>", answer=digits[::-1])

    def episode(self, prompt: Prompt) -> Episode:
        latency = (prompt.data or {}).get("latency_s", getattr(self.cfg, "tool_latency_s", 0.1))
        return _Sleepy(latency, self.turns)


class _Sleepy(Episode):
    def __init__(self, latency_s: float, turns: int):
        self.latency_s, self.turns, self.taken = latency_s, turns, 0

    def step(self, action: str) -> Step:
        time.sleep(self.latency_s)
        self.taken += 1
        if self.taken >= self.turns:
            return Step(reward=1.0, info={"tool_calls": 1})
        return Step(observation=" <result>ok</result> ", done=False, info={"tool_calls": 1})
