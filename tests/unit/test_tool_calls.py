"""Tool-call parsers per model family (`meshrl.envs.tool_calls`): each family's
format as its models write it, content around the calls, malformed text kept
as content with its reason, the parser a chat template implies, and the checks
of a request's tools and tool_choice. Also the endpoint's stop-string cut and
the sampler's greedy step and top log-probs (pure functions), and the opening
a forced tool_choice puts before an answer, read from each family's way of
writing a call in a chat template."""

from __future__ import annotations

import json

import pytest
import torch

from meshrl.envs import tool_calls as T

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def calls(parsed: T.Parsed) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


# --- Hermes / Qwen2.5 / Qwen3 ---------------------------------------------------------------


def test_hermes_reads_each_block_and_keeps_the_text_around_them():
    text = (
        "<think>I need two cities.</think>Checking.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    parsed = T.parse("hermes", text)
    assert calls(parsed) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
    assert parsed.content == "<think>I need two cities.</think>Checking." and not parsed.malformed


def test_hermes_takes_an_unclosed_last_block_string_arguments_and_no_arguments():
    parsed = T.parse("qwen3", '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}')
    assert calls(parsed) == [("f", {"x": 1})] and parsed.content is None
    assert calls(T.parse("qwen2.5", '<tool_call>{"name": "now"}</tool_call>')) == [("now", {})]


def test_text_without_calls_is_content():
    for name in ("hermes", "llama3_json", "mistral", "harmony"):
        parsed = T.parse(name, "  The answer is 4.  ")
        assert parsed == T.Parsed("The answer is 4.")
    assert T.parse("hermes", "").content is None


# --- Llama 3.x JSON -------------------------------------------------------------------------


def test_llama3_reads_json_calls_with_or_without_the_python_tag():
    one = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert calls(T.parse("llama3_json", one)) == [("get_weather", {"city": "Paris"})]
    two = '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"k": 2}}'
    parsed = T.parse("llama3", two)
    assert calls(parsed) == [("a", {}), ("b", {"k": 2})] and parsed.content is None


def test_llama3_json_content_that_is_no_call_stays_content():
    assert T.parse("llama3_json", '{"answer": 4}') == T.Parsed('{"answer": 4}')
    assert T.parse("llama3_json", 'Sure: {"name": "a"}').calls == []


# --- Mistral --------------------------------------------------------------------------------


def test_mistral_reads_the_list_form_and_keeps_its_ids():
    text = 'Let me see.[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}, "id": "abcDEF123"}]'
    parsed = T.parse("mistral", text)
    assert calls(parsed) == [("f", {"a": 1})] and parsed.content == "Let me see."
    assert parsed.calls[0].id == "abcDEF123"


def test_mistral_reads_the_name_args_form_of_newer_tokenizers():
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now[CALL_ID]a1b2c3d4e[ARGS]{}'
    parsed = T.parse("mistral", text)
    assert calls(parsed) == [("get_weather", {"city": "Paris"}), ("now", {})]
    assert [c.id for c in parsed.calls] == ["", "a1b2c3d4e"]


# --- Harmony (gpt-oss) ----------------------------------------------------------------------


def test_harmony_reads_a_commentary_call_with_its_reasoning_apart():
    text = (
        "<|channel|>analysis<|message|>The user wants the weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}<|call|>'
    )
    parsed = T.parse("harmony", text)
    assert calls(parsed) == [("get_weather", {"city": "Paris"})]
    assert parsed.reasoning == "The user wants the weather." and parsed.content is None


def test_harmony_reads_a_recipient_in_the_role_header_and_a_final_answer():
    call = (
        "<|start|>assistant to=functions.lookup<|channel|>commentary json"
        '<|message|>{"q": "x"}<|call|>'
    )
    assert calls(T.parse("harmony", call)) == [("lookup", {"q": "x"})]
    final = (
        "<|channel|>analysis<|message|>easy<|end|><|start|>assistant<|channel|>final<|message|>4"
    )
    parsed = T.parse("harmony", final)
    assert parsed.calls == [] and parsed.content == "4" and parsed.reasoning == "easy"


# --- malformed calls, every family ----------------------------------------------------------


MALFORMED = {
    "hermes": {
        "bad-json": '<tool_call>{"name": get</tool_call>',
        "no-name": '<tool_call>{"arguments": {}}</tool_call>',
        "list-arguments": '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>',
        "not-an-object": '<tool_call>["f"]</tool_call>',
    },
    "llama3_json": {
        "bad-json": '{"name": "a", "parameters": {"x": }',
        "trailing-text": '{"name": "a", "parameters": {}} and then some',
        "builtin-tool": "<|python_tag|>brave_search.call(query='x')",
        "tagged-without-name": '<|python_tag|>{"parameters": {}}',
    },
    "mistral": {
        "bad-list": "[TOOL_CALLS][{]",
        "empty-list": "[TOOL_CALLS][]",
        "not-a-list": "[TOOL_CALLS]f{}",
        "trailing-text": '[TOOL_CALLS][{"name": "f"}] more',
    },
    "harmony": {"bad-json": "<|channel|>commentary to=functions.f<|message|>{not json<|call|>"},
}


@pytest.mark.parametrize(
    "name, text",
    [(name, text) for name, cases in MALFORMED.items() for text in cases.values()],
    ids=[f"{name}-{case}" for name, cases in MALFORMED.items() for case in cases],
)
def test_malformed_calls_are_content_with_their_reason(name, text):
    parsed = T.parse(name, text)
    assert parsed.calls == [] and parsed.content == text.strip()
    assert parsed.malformed.startswith(f"{name}:")


# --- choosing a parser, checking a request --------------------------------------------------


@pytest.mark.parametrize(
    "template, name",
    [
        ("{% for t in tools %}<tools>{{ t }}</tools>{% endfor %}<tool_call>", "hermes"),
        ("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}", "mistral"),
        ('<|python_tag|>{"name": ..., "parameters": ...}', "llama3_json"),
        ("<|start|>assistant<|channel|>final<|message|>", "harmony"),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", None),
        (None, None),
    ],
)
def test_the_chat_template_implies_the_parser(template, name):
    assert T.parser_for_template(template) == name


def test_parser_names_and_aliases():
    assert T.parser_name("Qwen3") == "hermes" and T.parser_name("llama3") == "llama3_json"
    with pytest.raises(ValueError, match="'pythonic' is not a tool-call parser"):
        T.parser_name("pythonic")


def test_ids_look_like_openais_or_mistrals():
    assert T.new_id("hermes").startswith("call_") and len(T.new_id("hermes")) == 29
    mistral = T.new_id("mistral")
    assert len(mistral) == 9 and mistral.isalnum()


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}


@pytest.mark.parametrize(
    "tools, choice, expected",
    [
        ([WEATHER], None, "auto"),
        ([WEATHER], "none", None),
        ([WEATHER], "required", "required"),
        ([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, "get_weather"),
        (None, None, None),
        (None, "none", None),
    ],
)
def test_tool_choice(tools, choice, expected):
    assert T.check_tools(tools, choice)[1] == expected


@pytest.mark.parametrize(
    "tools, choice, says",
    [
        ([{"type": "function"}], None, r"tools\[0\] must be"),
        ([{"type": "code_interpreter"}], None, r"tools\[0\] must be"),
        ([{"function": {"name": "f", "parameters": []}}], None, "parameters must be"),
        ([WEATHER], {"type": "function", "function": {"name": "g"}}, "'g', which is not one"),
        ([WEATHER], "always", "tool_choice must be"),
        (None, "required", "needs tools"),
    ],
)
def test_bad_tools_are_one_line(tools, choice, says):
    with pytest.raises(T.ToolError, match=says):
        T.check_tools(tools, choice)


def test_chosen_says_what_an_answer_misses():
    call = T.ToolCall("get_weather", "{}")
    assert T.chosen(T.Parsed(None, [call]), "required") == ""
    assert "called no tool" in T.chosen(T.Parsed("hi"), "required")
    assert T.chosen(T.Parsed(None, [call]), "get_weather") == ""
    assert "['get_weather']" in T.chosen(T.Parsed(None, [call]), "get_time")
    assert T.chosen(T.Parsed("hi"), "auto") == ""


# --- the endpoint's stop cut and the sampler's greedy step (pure) ---------------------------


def test_stop_cut_keeps_the_tokens_up_to_the_match():
    from meshrl.envs.endpoint import stop_cut

    pieces = ["ab", "c1", "de", "f"]  # a token that runs past the match stays whole

    def decode(tokens):
        return "".join(pieces[t] for t in tokens)

    assert stop_cut([0, 1, 2, 3], ["1", "e"], decode) == (2, "abc", "1")
    assert stop_cut([0, 1, 2, 3], ["de"], decode) == (3, "abc1", "de")
    assert stop_cut([0, 1, 2, 3], ["x"], decode) is None


def test_greedy_takes_the_argmax_under_temperature_one_and_top_logprobs_are_sorted():
    from meshrl.model.generation import _next_tokens, top_logprobs

    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0], [0.5, 0.1, 0.2, 0.4]])
    seeds = torch.tensor([1, 2])
    token, behaviour, logp, probs = _next_tokens(logits.clone(), 0, 0.0, None, 0.5, seeds)
    assert token.tolist() == [1, 0]
    assert torch.allclose(behaviour, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])
    values, ids = top_logprobs(logp, probs, 3, 0.0, 0.5)
    assert ids[:, 0].tolist() == [1, 0] and torch.all(values[:, :-1] >= values[:, 1:])
    # Sampled with top-p: the alternatives are the nucleus's, renormalized (-inf outside).
    _, _, logp, probs = _next_tokens(logits.clone(), 0, 1.0, None, 0.6, seeds)
    values, ids = top_logprobs(logp, probs, 2, 1.0, 0.6)
    # (row 0's most likely token holds 0.66 of the mass: the nucleus is that one)
    assert ids[0, 0] == 1 and values[0, 0] == 0.0 and values[0, 1] == -float("inf")


# Each family's way of writing an assistant's call, in templates written for this test
# (Qwen2.5's newline after <tool_call>; Llama 3's bare JSON with "parameters";
# Mistral's [TOOL_CALLS] list).
FAMILY_TEMPLATES = {
    "hermes": (
        "{%- for m in messages -%}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{%- for c in m.tool_calls or [] -%}\n<tool_call>\n"
        '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
        "\n</tool_call>{%- endfor -%}<|im_end|>\n{%- endfor -%}"
    ),
    "llama3_json": (
        "{%- for m in messages -%}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
        "{%- for c in m.tool_calls or [] -%}"
        '{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}'
        "{%- else -%}{{ m.content }}{%- endfor -%}<|eot_id|>{%- endfor -%}"
    ),
    "mistral": (
        "{%- for m in messages -%}{%- if m.role == 'user' -%}[INST]{{ m.content }}[/INST]"
        "{%- elif m.tool_calls -%}[TOOL_CALLS][{%- for c in m.tool_calls -%}"
        '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
        "{%- endfor -%}]</s>{%- endif -%}{%- endfor -%}"
    ),
}


@pytest.mark.parametrize(
    "parser, required, named",
    [
        ("hermes", '<tool_call>\n{"name": "', '<tool_call>\n{"name": "f", "arguments": '),
        ("llama3_json", '{"name": "', '{"name": "f", "parameters": '),
        ("mistral", '[TOOL_CALLS][{"name": "', '[TOOL_CALLS][{"name": "f", "arguments": '),
    ],
)
def test_a_forced_tool_choice_opens_the_call_as_the_template_writes_one(parser, required, named):
    from meshrl.model.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = FAMILY_TEMPLATES[parser]
    assert T.forced_prefix(tokenizer, parser, "required") == required
    assert T.forced_prefix(tokenizer, parser, "f") == named
    assert T.forced_prefix(tokenizer, parser, "auto") is None
    assert T.forced_prefix(tokenizer, "harmony", "required") is None  # checked, not forced
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert T.forced_prefix(tokenizer, parser, "required") is None  # no calls in its template
