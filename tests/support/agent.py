"""Agent functions for tests/e2e/test_agent.py, written against the OpenAI client as a
user's agent would be: each makes chat calls to the policy endpoint, calls a tool
in between and returns the episode's reward."""

from __future__ import annotations

import threading

CALLS: dict[str, list[dict]] = {}
"""Per episode URL, what each chat call answered (as the client saw it)."""
_lock = threading.Lock()
_failures = {"raise": 1, "silent": 1}  # episodes left to fail each way


def partial_credit(answer: str, target: str) -> float:
    return sum(a == b for a, b in zip(answer, target, strict=False)) / len(target)


def digit_check(answer: str, target: str) -> str:
    """The tool: how many leading digits are right (what a test harness would say)."""
    right = 0
    for a, b in zip(answer, target, strict=False):
        if a != b:
            break
        right += 1
    return f"<result>{right} right</result>"


def reverse_with_a_tool(base_url: str, prompt) -> float:
    """Two chat calls with a tool call between them: the model answers (after a
    `<think>` block), the tool checks the answer, the model answers again."""
    from openai import OpenAI  # here, not at the top: collecting the tests costs nothing

    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    target = prompt.text.rstrip(">")[::-1]
    messages = [{"role": "user", "content": prompt.text}]
    reward = 0.0
    for turn in range(2):
        out = client.chat.completions.create(
            model="meshrl-policy", messages=messages, logprobs=True
        )
        choice = out.choices[0]
        answer = choice.message.content
        with _lock:
            CALLS.setdefault(base_url, []).append(
                {
                    "content": answer,
                    "token_ids": choice.model_extra["token_ids"],
                    "logprobs": [t.logprob for t in choice.logprobs.content],
                    "prompt_token_ids": out.model_extra["meshrl"]["prompt_token_ids"],
                    "messages": [dict(m) for m in messages],
                }
            )
        final = answer.split("</think>")[-1]
        reward = partial_credit(final, target)
        if turn == 0:
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "tool", "content": digit_check(final, target)},
            ]
    return reward


def sometimes_failing(base_url: str, prompt) -> float:
    """The run's first episode raises, its third makes no call (two groups of
    two); every other episode plays normally."""
    key = base_url.split("/episodes/")[1].split("/")[0].partition("~")[0]
    index = int(key.rsplit(".", 1)[1])
    kind = {0: "raise", 2: "silent"}.get(index, "")
    with _lock:
        if kind and _failures[kind]:
            _failures[kind] -= 1
        else:
            kind = ""
    if kind == "raise":
        raise RuntimeError("the agent's own bug")
    if kind == "silent":
        return 1.0
    return reverse_with_a_tool(base_url, prompt)


def calculator(base_url: str, prompt) -> float:
    """docs/environments.md's example: the calculator task played by an agent. The
    model may call `<calc>EXPR</calc>` (the agent evaluates it and answers with a
    tool message) and ends with `<answer>N</answer>`; reward 1 for the right N."""
    import re

    from openai import OpenAI

    from meshrl.envs.math import arith

    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": prompt.text}]
    for _ in range(3):
        reply = client.chat.completions.create(model="meshrl-policy", messages=messages)
        text = reply.choices[0].message.content
        answer = re.search(r"<answer>(.*?)</answer>", text)
        if answer:
            return float(answer.group(1).strip() == prompt.answer)
        call = re.search(r"<calc>(.*?)</calc>", text)
        try:
            result = arith(call.group(1))[0] if call else "no tool call"
        except (ValueError, ArithmeticError) as error:
            result = f"error: {error}"
        messages += [
            {"role": "assistant", "content": text},
            {"role": "tool", "content": f" <result>{result}</result> "},
        ]
    return 0.0


def slow_to_start(base_url: str, prompt) -> float:
    """`reverse_with_a_tool`, after a second's wait before its first call: the
    window in which another local process could reach the episode first."""
    import time

    time.sleep(1.0)
    return reverse_with_a_tool(base_url, prompt)
