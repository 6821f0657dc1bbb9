"""Tool calls in a model's text, per model family: what the policy endpoint
(`meshrl.envs.endpoint`) returns as `message.tool_calls` when a request has `tools`.

Each family writes a call its own way, as its chat template teaches it:

| parser | families | a call |
|---|---|---|
| `hermes` | Hermes, Qwen2.5, Qwen3 | `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` |
| `llama3_json` | Llama 3.1-3.3 (JSON tool calling) | `{"name": ..., "parameters": {...}}`, `;` between calls, after an optional `<|python_tag|>` |
| `mistral` | Mistral, Mixtral, Ministral | `[TOOL_CALLS][{"name": ..., "arguments": {...}}]`, or `[TOOL_CALLS]name[ARGS]{...}` (newer tokenizers) |
| `harmony` | gpt-oss | a message `to=functions.NAME` on the commentary channel, its arguments the message, ended by `<|call|>` |

`parser_for_template` picks one from a chat template (the text that teaches the
format); `parse(name, text)` reads a completion's text (decoded with its special
tokens: `[TOOL_CALLS]`, `<|python_tag|>` and Harmony's markers are special tokens)
into the content outside the calls and the calls. Text that starts a call but
does not parse as one (bad JSON, no name) is `malformed`: the endpoint then
returns the whole text as content and counts it, so a model that has not learnt
the format yet costs its agent nothing but a turn.

Everything here is a pure function of its text. To add a family: a function
`text -> Parsed`, an entry in `PARSERS`, and the marker its template carries in
`_TEMPLATE_MARKERS`; its tests go beside the others in tests/unit/test_tool_calls.py.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from meshrl.config.policy import TOOL_PARSER_ALIASES, TOOL_PARSERS


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str
    """The arguments as JSON text (an object), as OpenAI's `function.arguments`."""
    id: str = ""
    """The model's own id for the call, where its format has one (Mistral's
    `[CALL_ID]`); else the endpoint draws one."""


@dataclass
class Parsed:
    content: str | None
    """The text outside the calls (None when there is none)."""
    calls: list[ToolCall] = field(default_factory=list)
    malformed: str = ""
    """Why the text's tool-call markup does not parse ('' when it does, or has none)."""
    reasoning: str | None = None
    """Reasoning the format keeps apart from the answer (Harmony's analysis channel)."""


class ToolError(ValueError):
    """A request's `tools` or `tool_choice` that the endpoint cannot serve."""


def _arguments(value: Any) -> str:
    """A call's arguments as JSON text of an object; ValueError when they are not one."""
    if isinstance(value, str):  # some models write the object as a JSON string
        value = json.loads(value)
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ValueError("the arguments are not a JSON object")
    return json.dumps(value, ensure_ascii=False)


def _call(obj: Any, arguments_key: str = "arguments") -> ToolCall:
    """`{"name": ..., arguments_key: {...}}` -> a ToolCall, or ValueError."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ValueError("a call is not an object with a string 'name'")
    arguments = obj.get(arguments_key, obj.get("arguments", obj.get("parameters")))
    return ToolCall(obj["name"], _arguments(arguments))


def _content(text: str) -> str | None:
    return text.strip() or None


def _malformed(text: str, why: str) -> Parsed:
    return Parsed(_content(text), malformed=why)


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> Parsed:
    """`<tool_call>{json}</tool_call>` blocks (the last may be unclosed: the model
    stopped right after its JSON); the content is the text around them."""
    if "<tool_call>" not in text:
        return Parsed(_content(text))
    calls = []
    for body in _HERMES.findall(text):
        try:
            calls.append(_call(json.loads(body.strip())))
        except ValueError as error:  # json.JSONDecodeError is one
            return _malformed(text, f"hermes: {error}")
    return Parsed(_content(_HERMES.sub("", text)), calls)


def parse_llama3_json(text: str) -> Parsed:
    """Llama 3.x's JSON tool calling: the answer is `{"name": ..., "parameters":
    {...}}` (several separated by `;`), after an optional `<|python_tag|>`. Text
    that does not start with an object is content; an object without a string
    `name` is content too (the model answered in JSON), unless the python tag
    announced a call."""
    body = text.strip()
    tagged = body.startswith("<|python_tag|>")
    if tagged:
        body = body[len("<|python_tag|>") :].strip()
    if not body.startswith("{"):
        if tagged:  # (Llama's built-in tools, `brave_search.call(...)`, are not parsed)
            return _malformed(text, "llama3_json: <|python_tag|> without a JSON call")
        return Parsed(_content(text))
    decoder, calls, at = json.JSONDecoder(), [], 0
    try:
        while at < len(body):
            obj, end = decoder.raw_decode(body, at)
            if not (isinstance(obj, dict) and "name" in obj) and not tagged:
                return Parsed(_content(text))  # JSON content, not a call
            calls.append(_call(obj, "parameters"))
            at = end
            rest = body[at:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            elif rest:
                raise ValueError(f"text after a call: {rest[:40]!r}")
            at = len(body) - len(rest)
    except ValueError as error:
        return _malformed(text, f"llama3_json: {error}")
    return Parsed(None, calls)


_MISTRAL_NAMED = re.compile(r"\s*([\w.-]+)(?:\[CALL_ID\]([A-Za-z0-9]+))?\[ARGS\]", re.DOTALL)


def parse_mistral(text: str) -> Parsed:
    """`[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` (Mistral v3
    tokenizers), or one or more `[TOOL_CALLS]name[ARGS]{json}` (newer ones,
    `[CALL_ID]id` optional before `[ARGS]`); the content is the text before the
    first `[TOOL_CALLS]`."""
    if "[TOOL_CALLS]" not in text:
        return Parsed(_content(text))
    before, _, after = text.partition("[TOOL_CALLS]")
    decoder, calls = json.JSONDecoder(), []
    try:
        if after.lstrip().startswith("["):
            items, end = decoder.raw_decode(after.lstrip())
            if not isinstance(items, list) or not items:
                raise ValueError("[TOOL_CALLS] is not followed by a list of calls")
            for item in items:
                call = _call(item)
                own = item.get("id")
                calls.append(
                    ToolCall(call.name, call.arguments, own if isinstance(own, str) else "")
                )
            if after.lstrip()[end:].strip():
                raise ValueError("text after the list of calls")
        else:
            for part in after.split("[TOOL_CALLS]"):
                named = _MISTRAL_NAMED.match(part)
                if not named:
                    raise ValueError("a call is not name[ARGS]{...}")
                obj, end = decoder.raw_decode(part, named.end())
                if part[end:].strip():
                    raise ValueError("text after a call's arguments")
                call = _call({"name": named.group(1), "arguments": obj})
                calls.append(ToolCall(call.name, call.arguments, named.group(2) or ""))
    except ValueError as error:
        return _malformed(text, f"mistral: {error}")
    return Parsed(_content(before), calls)


_HARMONY_MESSAGE = re.compile(
    r"(?:<\|start\|>)?(?P<head>[^<]*(?:<\|(?:channel|constrain)\|>[^<]*)*)<\|message\|>"
    r"(?P<body>.*?)(?:<\|end\|>|<\|call\|>|<\|return\|>|(?=<\|start\|>)|$)",
    re.DOTALL,
)


def parse_harmony(text: str) -> Parsed:
    """gpt-oss's Harmony messages (the text after the generation prompt
    `<|start|>assistant`): a message whose recipient (`to=functions.NAME`, in its
    role or channel header) is a function is a call, its body the arguments; the
    final channel's messages are the content, the analysis channel's the
    reasoning. Text without Harmony markers is content."""
    if "<|message|>" not in text:
        return Parsed(_content(text))
    calls, final, analysis = [], [], []
    for match in _HARMONY_MESSAGE.finditer(text):
        head, body = match.group("head"), match.group("body")
        channel = re.search(r"<\|channel\|>\s*(\w+)", head)
        recipient = re.search(r"to=([^\s<]+)", head)
        if recipient and recipient.group(1).startswith("functions."):
            try:
                calls.append(_call({"name": recipient.group(1)[10:], "arguments": body.strip()}))
            except ValueError as error:
                return _malformed(text, f"harmony: {error}")
        elif channel and channel.group(1) == "analysis":
            analysis.append(body)
        else:
            final.append(body)
    return Parsed(_content("".join(final)), calls, reasoning=_content("".join(analysis)))


PARSERS: dict[str, Callable[[str], Parsed]] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
    "mistral": parse_mistral,
    "harmony": parse_harmony,
}
ALIASES = TOOL_PARSER_ALIASES  # (the names a config key takes live with the key)
assert tuple(PARSERS) == TOOL_PARSERS, "meshrl.config.policy.TOOL_PARSERS names each parser"

_TEMPLATE_MARKERS = (
    ("harmony", ("<|channel|>",)),
    ("mistral", ("[TOOL_CALLS]",)),
    ("hermes", ("<tool_call>",)),
    ("llama3_json", ("<|python_tag|>", '"parameters"')),
)
"""What a chat template that teaches each format writes (checked in this order:
Harmony's and Mistral's templates may mention the others' words)."""


def parser_name(name: str) -> str:
    """A parser's name as `PARSERS` keys it; ValueError naming the choices."""
    name = ALIASES.get(name.lower(), name.lower())
    if name not in PARSERS:
        choices = ", ".join([*PARSERS, *ALIASES])
        raise ValueError(f"'{name}' is not a tool-call parser (one of {choices})")
    return name


def parser_for_template(template: str | None) -> str | None:
    """The parser a chat template implies (the format it teaches), or None."""
    if not template or not isinstance(template, str):
        return None
    for name, markers in _TEMPLATE_MARKERS:
        if any(marker in template for marker in markers):
            return name
    return None


def parse(name: str, text: str) -> Parsed:
    return PARSERS[parser_name(name)](text)


_CALL_STARTS = {"hermes": "<tool_call>", "llama3_json": '{"name"', "mistral": "[TOOL_CALLS]"}
"""Where a call starts in each format's text (Harmony's calls are not forced)."""
_NAME = "meshrl_forced_fn"
_ARGUMENT = "meshrl_forced_arg"


def forced_prefix(tokenizer: Any, parser: str, choice: str | None) -> str | None:
    """The text an answer must start with to meet `tool_choice` (`required`: a
    call's opening up to its name; a named function: up to its arguments, the
    name written), as this model's chat template writes a call, so that the
    endpoint can put it before what the replica samples; None when there is
    nothing to force or the template does not show it (the choice is then
    checked, not forced)."""
    start = _CALL_STARTS.get(parser)
    if start is None or choice in (None, "auto"):
        return None
    call = {"name": _NAME, "arguments": {_ARGUMENT: 1}}
    messages = [
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "call_0", "type": "function", "function": call}],
        },
    ]
    try:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that renders no calls: check only
        return None
    at = rendered.find(start)
    name = rendered.find(_NAME, at)
    arguments = rendered.find("{", name)
    if at < 0 or name < 0 or _ARGUMENT not in rendered[arguments:]:
        return None
    if choice == "required":
        return rendered[at:name]
    return rendered[at:name] + choice + rendered[name + len(_NAME) : arguments]


def new_id(parser: str) -> str:
    """An id for a call the model gave none: OpenAI's shape (`call_` and 24
    characters), or 9 letters and digits for Mistral, whose templates check it."""
    alphabet = string.ascii_letters + string.digits
    if parser == "mistral":
        return "".join(secrets.choice(alphabet) for _ in range(9))
    return "call_" + "".join(secrets.choice(alphabet) for _ in range(24))


def check_tools(tools: Any, tool_choice: Any) -> tuple[list[str], str | None]:
    """A request's `tools` and `tool_choice` -> (the function names, the choice:
    None for "none", "auto", "required", or a function's name); ToolError, one
    line, when they are malformed or name a function not in `tools`."""
    names = []
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (
            isinstance(tool, dict)
            and tool.get("type", "function") == "function"
            and isinstance(function, dict)
            and isinstance(function.get("name"), str)
            and function["name"]
        ):
            raise ToolError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}"
            )
        if not isinstance(function.get("parameters", {}), dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object")
        names.append(function["name"])
    if tool_choice is None:
        choice = "auto" if names else None
    elif tool_choice in ("none", "auto", "required"):
        choice = None if tool_choice == "none" else tool_choice
    elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        choice = tool_choice["function"].get("name")
        if choice not in names:
            raise ToolError(f"tool_choice names {choice!r}, which is not one of the tools")
    else:
        raise ToolError(
            "tool_choice must be 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}"
        )
    if choice is not None and not names:
        raise ToolError(f"tool_choice {tool_choice!r} needs tools")
    return names, choice


def chosen(parsed: Parsed, choice: str | None) -> str:
    """'' when `parsed` meets `tool_choice` (None, "auto", "required", a function
    name), else what it misses: an answer that misses it (a format whose calls
    `forced_prefix` cannot start, or a forced call the model did not finish)
    comes back as it is."""
    if choice == "required" and not parsed.calls:
        return "tool_choice 'required': the model called no tool"
    if choice not in (None, "auto", "required"):
        other = [c.name for c in parsed.calls if c.name != choice]
        if not parsed.calls or other:
            return f"tool_choice {choice!r}: the model called {other or 'no tool'}"
    return ""
