"""Agents built on off-the-shelf frameworks, each used as its documentation shows
and unmodified, for tests/e2e/test_agent_frameworks.py and
benchmarks/agent_endpoint.py: the OpenAI Agents SDK (its chat-completions model),
LangChain (`ChatOpenAI(...).bind_tools`), smolagents (`ToolCallingAgent` with
`OpenAIServerModel`) and mini-swe-agent (`DefaultAgent` with its litellm model and a
local shell). Each is an agent task's function, `(base_url, prompt) -> reward`: it
solves "What is 3*4?" with a calculator tool (mini-swe-agent: with `echo $((3*4))`
in its shell) and scores 1 for the right number.

What the framework's HTTP client sent and received travels through `Recorder`, a
transport under the framework's own `openai`/httpx client (the framework's code is
untouched): the test compares the trained rows with what the client received, and
`TOOL_RUNS` says which tools the framework ran, with what, per episode.

A tiny model is taught the answers these agents need (`teach`), so that sampling
at a low temperature gives them: the calculator call in Hermes `<tool_call>` JSON
(the format the template, `TEMPLATE`, teaches), then the final answer once the
tool's result is in the conversation. `teach_some_calls` teaches instead a model
that calls the calculator in only some episodes, for RL to lift
(tests/learning/test_agent_learning.py).
"""

from __future__ import annotations

import json
import os
import random
import re
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from meshrl.envs.base import Env, Episode, Step
from meshrl.envs.tool_calls import parse

# --- what the frameworks' clients saw ---------------------------------------------------------

RECEIVED: dict[str, list[dict]] = {}
"""Per episode key, each call as the client made and received it: `request` (the
JSON body sent), `token_ids` (the answer's, joined over a stream's chunks),
`meshrl` (the answer's meshrl field), `message` (the answer's message, a stream's
deltas joined) and `stream`."""
TOOL_RUNS: dict[str, list[tuple[str, dict, str]]] = {}
"""Per episode key, the tools the framework ran: (name, arguments, result)."""
_lock = threading.Lock()


def episode_key(url: str) -> str:
    """The episode key in an episode URL (`.../episodes/<key>~<secret>/v1...`)."""
    return str(url).split("/episodes/")[1].split("/")[0].partition("~")[0]


def _answer(body: bytes, stream: bool) -> dict:
    """An answer's token ids, meshrl field and message, from its JSON or its stream."""
    if not stream:
        out = json.loads(body)
        choice = out["choices"][0]
        return {
            "token_ids": choice["token_ids"],
            "meshrl": out["meshrl"],
            "message": choice["message"],
        }
    ids: list[int] = []
    meshrl: dict = {}
    content, calls = "", []
    for line in body.decode().splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: ") :])
        meshrl = chunk.get("meshrl", meshrl)
        for choice in chunk["choices"]:
            ids += choice.get("token_ids", [])
            delta = choice.get("delta") or {}
            content += delta.get("content") or ""
            calls += delta.get("tool_calls") or []
    return {
        "token_ids": ids,
        "meshrl": meshrl,
        "message": {"content": content, "tool_calls": calls},
    }


def _record(request: httpx.Request, status: int, body: bytes) -> None:
    if "/episodes/" not in str(request.url) or not request.content:
        return
    sent = json.loads(request.content)
    entry = {"request": sent, "status": status, "stream": bool(sent.get("stream"))}
    if status == 200:
        entry |= _answer(body, entry["stream"])
    with _lock:
        RECEIVED.setdefault(episode_key(request.url), []).append(entry)


class Recorder(httpx.BaseTransport):
    """httpx's own transport, keeping a copy of each episode call and its answer."""

    def __init__(self):
        self.inner = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        body = response.read()
        _record(request, response.status_code, body)
        return httpx.Response(
            response.status_code, headers=response.headers, content=body, request=request
        )


class AsyncRecorder(httpx.AsyncBaseTransport):
    """`Recorder` for async clients (the Agents SDK's AsyncOpenAI)."""

    def __init__(self):
        self.inner = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        body = await response.aread()
        _record(request, response.status_code, body)
        return httpx.Response(
            response.status_code, headers=response.headers, content=body, request=request
        )


def _ran(base_url: str, name: str, arguments: dict, result: str) -> str:
    with _lock:
        TOOL_RUNS.setdefault(episode_key(base_url), []).append((name, arguments, result))
    return result


def calculate(expression: str) -> str:
    """The calculator every agent's tool runs: meshrl's exact arithmetic."""
    from meshrl.envs.math import arith

    try:
        value = arith(expression)[0]
    except (ValueError, ArithmeticError) as error:
        return f"error: {error}"
    return str(value)


def _score(text: Any, prompt: Any) -> float:
    numbers = re.findall(r"-?\d+", str(text or ""))
    return float(bool(numbers) and numbers[-1] == str(prompt.answer))


STREAM = {"on": False}
"""Whether the agents that can stream do (benchmarks/agent_endpoint.py sets it)."""


# --- the agents -------------------------------------------------------------------------------

INSTRUCTIONS = "Use the calculator tool, then answer with the number."


CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression such as 3*4.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


def plain_openai(base_url: str, prompt: Any) -> float:
    """No framework: the `openai` client's chat calls, the tool run by hand (the
    benchmark's measure of the endpoint alone)."""
    from openai import OpenAI

    with httpx.Client(transport=Recorder(), timeout=120) as http:
        client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, http_client=http)
        messages: list[dict] = [{"role": "user", "content": prompt.text}]
        for _ in range(3):
            answer = client.chat.completions.create(
                model="meshrl-policy", messages=messages, tools=[CALCULATOR], stream=False
            )
            message = answer.choices[0].message
            if not message.tool_calls:
                return _score(message.content, prompt)
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                expression = json.loads(call.function.arguments).get("expression", "")
                result = _ran(
                    base_url, "calculator", {"expression": expression}, calculate(expression)
                )
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0


def openai_agents(base_url: str, prompt: Any) -> float:
    """The OpenAI Agents SDK: an `Agent` with a `function_tool`, its model
    `OpenAIChatCompletionsModel` on an `AsyncOpenAI` client at the episode's URL,
    run by `Runner` (streamed with `STREAM`)."""
    import asyncio

    from agents import Agent, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool
    from openai import AsyncOpenAI

    @function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression such as 3*4."""
        return _ran(base_url, "calculator", {"expression": expression}, calculate(expression))

    async def play() -> Any:
        async with httpx.AsyncClient(transport=AsyncRecorder(), timeout=120) as http:
            client = AsyncOpenAI(
                base_url=base_url, api_key="unused", max_retries=0, http_client=http
            )
            agent = Agent(
                name="calculator",
                instructions=INSTRUCTIONS,
                tools=[calculator],
                model=OpenAIChatCompletionsModel(model="meshrl-policy", openai_client=client),
            )
            # No tracing: the SDK would export traces to OpenAI's servers.
            config = RunConfig(tracing_disabled=True)
            if STREAM["on"]:
                run = Runner.run_streamed(agent, prompt.text, max_turns=3, run_config=config)
                async for _ in run.stream_events():
                    pass
                return run.final_output
            result = await Runner.run(agent, prompt.text, max_turns=3, run_config=config)
            return result.final_output

    return _score(asyncio.run(play()), prompt)


def langchain(base_url: str, prompt: Any) -> float:
    """LangChain: `ChatOpenAI(...).bind_tools([calculator])`, its tool calls run
    and answered with `ToolMessage`s until it answers in text (streamed with
    `STREAM`: the chunks added up, as LangChain joins them)."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression such as 3*4."""
        return _ran(base_url, "calculator", {"expression": expression}, calculate(expression))

    with httpx.Client(transport=Recorder(), timeout=120) as http:
        model = ChatOpenAI(
            model="meshrl-policy",
            base_url=base_url,
            api_key="unused",
            max_retries=0,
            http_client=http,
            streaming=STREAM["on"],
        ).bind_tools([calculator])
        messages: list[Any] = [HumanMessage(prompt.text)]
        for _ in range(3):
            answer = model.invoke(messages)
            messages.append(answer)
            if not answer.tool_calls:
                return _score(answer.content, prompt)
            for call in answer.tool_calls:
                try:
                    result = calculator.invoke(call["args"])
                except ValueError as error:  # arguments the tool's schema refuses: said back
                    result = f"error: {error}"
                messages.append(ToolMessage(result, tool_call_id=call["id"]))
    return 0.0


def smolagents(base_url: str, prompt: Any) -> float:
    """smolagents: a `ToolCallingAgent` with a `@tool` calculator, its model
    `OpenAIServerModel` at the episode's URL; it ends by calling its
    `final_answer` tool."""
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    @tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: the expression, such as 3*4.
        """
        return _ran(base_url, "calculator", {"expression": expression}, calculate(expression))

    with httpx.Client(transport=Recorder(), timeout=120) as http:
        model = OpenAIServerModel(
            model_id="meshrl-policy",
            api_base=base_url,
            api_key="unused",
            client_kwargs={"http_client": http, "max_retries": 0},
        )
        agent = ToolCallingAgent(tools=[calculator], model=model, max_steps=3, verbosity_level=-1)
        return _score(agent.run(prompt.text), prompt)


MINI_SYSTEM = "You run bash commands."


def mini_swe_agent(base_url: str, prompt: Any) -> float:
    """mini-swe-agent: its `DefaultAgent` with `LitellmModel` (litellm's OpenAI
    route at the episode's URL) and `LocalEnvironment`, a local shell in a fresh
    directory. The model computes with the shell (`echo $((3*4))`) and submits
    with mini-swe-agent's own marker line; the submission is scored."""
    # litellm fetches its model price list from the network at import unless told not to;
    # mini-swe-agent makes and reads a config directory in the user's home unless told
    # where (a fresh one: no keys or settings of the user's reach the test).
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    os.environ.setdefault("MSWEA_GLOBAL_CONFIG_DIR", tempfile.mkdtemp(prefix="mini-config-"))
    os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
    import litellm
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models.litellm_model import LitellmModel

    _litellm_client(litellm)
    with tempfile.TemporaryDirectory(prefix="mini-") as cwd:
        shell = _RecordedShell(base_url, LocalEnvironment(cwd=cwd, timeout=10))
        model = LitellmModel(
            model_name="openai/meshrl-policy",
            model_kwargs={"api_base": base_url, "api_key": "unused"},
            cost_tracking="ignore_errors",
        )
        agent = DefaultAgent(
            model,
            shell,
            system_template=MINI_SYSTEM,
            instance_template="{{task}}",
            step_limit=3,
            cost_limit=0,
        )
        result = agent.run(prompt.text)
    return _score(result.get("submission", ""), prompt)


_client_lock = threading.Lock()


def _litellm_client(litellm: Any) -> None:
    """litellm's shared sync httpx client (`litellm.client_session`, which its
    OpenAI route uses when set) through the `Recorder`: set once per process."""
    with _client_lock:
        if litellm.client_session is None:
            litellm.client_session = httpx.Client(transport=Recorder(), timeout=120)


class _RecordedShell:
    """mini-swe-agent's `LocalEnvironment`, each command and its output noted in
    `TOOL_RUNS` (mini-swe-agent takes any object with its environment's methods)."""

    def __init__(self, base_url: str, inner: Any):
        self.base_url, self.inner = base_url, inner

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict:
        try:
            output = self.inner.execute(action, cwd, timeout=timeout)
        except BaseException as submitted:  # minisweagent's Submitted ends the run
            _ran(self.base_url, "bash", {"command": action.get("command")}, str(submitted))
            raise
        _ran(self.base_url, "bash", {"command": action.get("command")}, output.get("output", ""))
        return output

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


AGENTS: dict[str, Callable[[str, Any], float]] = {
    "plain_openai": plain_openai,
    "openai_agents": openai_agents,
    "langchain": langchain,
    "smolagents": smolagents,
    "mini_swe_agent": mini_swe_agent,
}


# --- the model they drive ---------------------------------------------------------------------

# Hermes-like (`<tool_call>` JSON: `meshrl.envs.tool_calls` picks the hermes parser from
# it), in the char tokenizer's alphabet: newlines become spaces, content parts are
# joined. The tools are named, not described, and system messages are left out: a tiny
# model's context could not hold smolagents' system prompt.
TEMPLATE = (
    "{%- macro flat(c) -%}{%- if c is string -%}{{ c | replace('\\n', ' ') }}"
    "{%- elif c -%}{%- for p in c -%}{{ (p.text or '') | replace('\\n', ' ') }}{%- endfor -%}"
    "{%- endif -%}{%- endmacro -%}"
    "{%- if tools -%}[tools]{%- for t in tools -%}{{ t.function.name }};{%- endfor -%}</s>"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}"
    "{%- elif m.role == 'assistant' and m.tool_calls -%}[assistant]{{ flat(m.content) }}"
    '{%- for c in m.tool_calls -%}<tool_call>{"name": "{{ c.function.name }}", '
    '"arguments": {{ c.function.arguments | tojson }}}</tool_call>{%- endfor -%}</s>'
    "{%- else -%}[{{ m.role }}]{{ flat(m.content) }}</s>{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}[assistant]{%- endif -%}"
)

QUESTIONS = {"What is 6*7?": "42", "What is 9-4?": "5", "What is 8*8?": "64", "What is 3+9?": "12"}
"""The prompts the agents are tested on, and their answers."""


def call(name: str, **arguments: Any) -> str:
    """A Hermes tool call as the model is taught to write it."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def lessons() -> list[tuple[list[tuple[str, str]], list[str]]]:
    """What the model is taught: per framework and question, (the conversation as
    (role, text) turns, then the tools' names) and its answers in order, each
    after the conversation so far and the tool's result as that framework sends it."""
    taught = []
    for question, answer in QUESTIONS.items():
        expression = question.removeprefix("What is ").rstrip("?")
        calculator = call("calculator", expression=expression)
        taught += [
            # The Agents SDK and LangChain: the tool's result as a tool message, then text.
            ([("user", question), ("tool", answer)], ["calculator"], [calculator, answer]),
            # smolagents: its task wrapped, the observation as a user message, and the end
            # a call of its final_answer tool.
            (
                [("user", f"New task: {question}"), ("user", f"Observation: {answer}")],
                ["calculator", "final_answer"],
                [calculator, call("final_answer", answer=answer)],
            ),
            # meshrl's own environment (`HermesCalculator`): the prompt without tools.
            ([("user", question), ("tool", answer)], [], [calculator, answer]),
            # mini-swe-agent: a shell command, its observation, then the submission.
            (
                [
                    ("user", question),
                    ("tool", f"<returncode>0</returncode> <output> {answer} </output>"),
                ],
                ["bash"],
                [
                    call("bash", command=f"echo $(({expression}))"),
                    call(
                        "bash",
                        command=f"echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo {answer}",
                    ),
                ],
            ),
        ]
    return taught


def teach(root: Path, steps: int = 400) -> Path:
    """Save under `root/model` a tiny Llama and a char tokenizer with TEMPLATE,
    trained (at most `steps` full batches) until sampling at a low temperature
    gives each of `lessons()`' answers (then EOS) after its conversation. Returns
    the model's directory."""
    import torch

    tok, model = _tiny_model()
    inputs, labels = _batch(tok, lessons())
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    taught = labels[:, 1:] != -100
    for _ in range(steps):
        out = model(input_ids=inputs, labels=labels)
        # Done when every taught token has probability > 0.9 at temperature 1: then a
        # low sampling temperature (0.05) gives the taught answers, never a near miss.
        with torch.no_grad():
            probs = out.logits[:, :-1].float().softmax(-1)
            picked = probs.gather(-1, labels[:, 1:].clamp(min=0).unsqueeze(-1)).squeeze(-1)
            if picked[taught].min() > 0.9:
                break
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    else:
        raise RuntimeError(f"the model did not learn its lessons in {steps} steps")
    return _save(tok, model, root)


def _tiny_model() -> tuple[Any, Any]:
    """The char tokenizer with TEMPLATE and a fresh tiny Llama (seeded)."""
    import torch
    from transformers import AutoModelForCausalLM

    from meshrl.config import ModelConfig
    from meshrl.model.models import embedded_config
    from meshrl.model.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    tok.chat_template = TEMPLATE
    torch.manual_seed(0)
    cfg = ModelConfig(
        hidden_size=64, num_layers=2, num_heads=4, intermediate_size=256, max_positions=2048
    )
    return tok, AutoModelForCausalLM.from_config(embedded_config(cfg, len(tok)))


def _batch(tok: Any, taught_lessons: list) -> tuple[Any, Any]:
    """Lessons (as `lessons()` gives them) as one padded batch: the input ids, and
    labels that are the answers' ids (each with EOS) and -100 elsewhere."""
    import torch

    rows = []  # per lesson: its ids, and which of them are taught (the answers, each with EOS)
    for turns, names, answers in taught_lessons:
        tools = [{"type": "function", "function": {"name": n, "parameters": {}}} for n in names]
        messages: list[dict] = []
        ids: list[int] = []
        taught: list[bool] = []
        for (role, text), answer in zip(turns, answers, strict=True):
            messages.append({"role": role, "content": text})
            prompt = tok.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=True, tokenize=False
            )
            before = tok(prompt, add_special_tokens=False).input_ids
            assert before[: len(ids)] == ids  # the conversation goes on from the answers
            target = tok(answer, add_special_tokens=False).input_ids + [tok.eos_token_id]
            taught += [False] * (len(before) - len(ids)) + [True] * len(target)
            ids = before + target
            messages.append({"role": "assistant", "content": answer})
        rows.append((ids, taught))
    width = max(len(ids) for ids, _ in rows)
    inputs = torch.full((len(rows), width), tok.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    for i, (ids, taught) in enumerate(rows):
        inputs[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(ids)] = torch.where(torch.tensor(taught), torch.tensor(ids), -100)
    return inputs, labels


def _save(tok: Any, model: Any, root: Path) -> Path:
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    return root / "model"


# --- a model that calls the calculator only at times, for RL to lift -------------------------


def multiplications(count: int, seed: int) -> dict[str, str]:
    """`count` questions "What is 37*58?" (two 2-digit factors, a 4-digit
    product: more than a tiny model works out in its head) and their answers,
    drawn with `seed`."""
    rng = random.Random(seed)
    questions: dict[str, str] = {}
    while len(questions) < count:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if a * b >= 1000:
            questions[f"What is {a}*{b}?"] = str(a * b)
    return questions


def teach_some_calls(
    root: Path, questions: dict[str, str], share: float = 0.25, steps: int = 200, seed: int = 0
) -> Path:
    """`teach`'s model, taught instead the LangChain agent's episodes on
    `questions` as a warm start leaves a model for RL (as the built-in
    calculator's, `meshrl.envs.tools.Calculator.demonstration`): the format
    known, the calculator called in some episodes, its result then copied; a
    guess in the rest (a product of two other numbers, drawn afresh each step:
    never learned, so nearly always wrong). Each step (`steps` of them, the whole
    batch) teaches every question's whole call and a guess, but the call's opening
    (its first token) in just enough of them that a `share` of the taught
    openings are calls: the call itself is learned (with only 16 questions, by
    heart: a tiny model takes far longer to learn to copy any expression), whether
    it is made is left to RL. Returns the model's directory."""
    import torch

    tok, model = _tiny_model()
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    calls = []
    for question, answer in questions.items():
        expression = question.removeprefix("What is ").rstrip("?")
        turns = [("user", question), ("tool", answer)]
        calls.append((turns, ["calculator"], [call("calculator", expression=expression), answer]))
    call_inputs, call_labels = _batch(tok, calls)
    opening = (call_labels[:, 1:] != -100).int().argmax(1) + 1  # each call's first token
    opened = round(len(calls) * share / (1 - share))  # against len(calls) guesses: `share`
    for _ in range(steps):
        guesses = [
            ([("user", q)], ["calculator"], [str(rng.randint(32, 99) * rng.randint(32, 99))])
            for q in questions
        ]
        guess_inputs, guess_labels = _batch(tok, guesses)
        labels = call_labels.clone()
        unopened = torch.tensor(
            rng.sample(range(len(calls)), len(calls) - opened), dtype=torch.long
        )
        labels[unopened, opening[unopened]] = -100
        loss, count = 0.0, 0
        for inputs, targets in ((call_inputs, labels), (guess_inputs, guess_labels)):
            logits = model(input_ids=inputs).logits[:, :-1].float()
            targets = targets[:, 1:]
            loss = loss + torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum"
            )
            count += int((targets != -100).sum())
        optimizer.zero_grad()
        (loss / count).backward()
        optimizer.step()
    return _save(tok, model, root)


# --- the same episodes, played by meshrl's own rollout ----------------------------------------


class HermesCalculator(Env):
    """The agents' task as a meshrl environment (`task.name=
    tests.support.agent_frameworks:HermesCalculator`): a `<tool_call>` to the
    calculator is answered with its result; a turn without one ends the episode,
    scored as the agents score it. For benchmarks/agent_endpoint.py, beside the
    framework agents."""

    max_turns = 3

    def episode(self, prompt: Any) -> Episode:
        return _CalculatorEpisode(prompt)


class _CalculatorEpisode(Episode):
    def __init__(self, prompt: Any):
        self.prompt = prompt

    def step(self, action: str) -> Step:
        calls = parse("hermes", action).calls
        if calls:
            expression = json.loads(calls[0].arguments).get("expression", "")
            return Step(observation=calculate(str(expression)), done=False)
        return Step(reward=_score(action, self.prompt))
