"""What continues an agent episode (`meshrl.envs.endpoint._resent`): the conversation
so far sent unchanged, or an answer's tool calls resent as the client's own text
(smolagents' `Calling tools: [...]`) when that text names each call and its values;
anything edited is refused."""

from __future__ import annotations

import json

import pytest

from meshrl.envs.endpoint import _message, _resent

pytestmark = pytest.mark.unit

USER = {"role": "user", "content": "What is 3*4?"}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "calculator", "arguments": json.dumps({"expression": "3*4"})},
}
ANSWER = {"role": "assistant", "content": None, "tool_calls": [CALL]}
RESULT = {"role": "user", "content": "Observation:\n12"}


def recorded(*messages: dict) -> list[tuple]:
    return [_message(m) for m in messages]


def smolagents_text(call: dict) -> dict:
    """The answer as smolagents resends it: its calls as Python writes them."""
    arguments = json.loads(call["function"]["arguments"])
    listed = [{**call, "function": {**call["function"], "arguments": arguments}}]
    return {"role": "assistant", "content": [{"type": "text", "text": f"Calling tools:\n{listed}"}]}


def test_the_conversation_sent_unchanged_continues():
    sent = [USER, ANSWER, RESULT]
    assert _resent(sent, recorded(USER, ANSWER)) == 2
    # the arguments re-serialized, another id: the same call
    other = {
        **CALL,
        "id": "x",
        "function": {"name": "calculator", "arguments": '{"expression":"3*4"}'},
    }
    assert _resent([USER, {**ANSWER, "tool_calls": [other]}, RESULT], recorded(USER, ANSWER)) == 2


def test_tool_calls_resent_as_the_clients_own_text_continue():
    assert _resent([USER, smolagents_text(CALL), RESULT], recorded(USER, ANSWER)) == 2
    # An answer with text and calls: smolagents sends the text, then the calls.
    spoken = {**ANSWER, "content": "Let me compute."}
    said = {"role": "assistant", "content": "Let me compute."}
    sent = [USER, said, smolagents_text(CALL), RESULT]
    assert _resent(sent, recorded(USER, spoken)) == 3


@pytest.mark.parametrize(
    "edited",
    [
        # another value, as text or as a call
        smolagents_text(
            {**CALL, "function": {"name": "calculator", "arguments": '{"expression": "3*5"}'}}
        ),
        {**ANSWER, "tool_calls": [{**CALL, "function": {"name": "calculator", "arguments": "{}"}}]},
        # another function
        smolagents_text(
            {**CALL, "function": {"name": "search", "arguments": '{"expression": "3*4"}'}}
        ),
        # no answer at all
        {"role": "user", "content": "calculator 3*4"},
    ],
)
def test_an_edited_answer_is_refused(edited):
    assert _resent([USER, edited, RESULT], recorded(USER, ANSWER)) is None


def test_a_text_answer_must_come_back_as_it_was():
    answer = {"role": "assistant", "content": "12"}
    assert _resent([USER, answer, RESULT], recorded(USER, answer)) == 2
    edited = {"role": "assistant", "content": "12!"}
    assert _resent([USER, edited, RESULT], recorded(USER, answer)) is None
    assert _resent([{"role": "user", "content": "?"}, answer], recorded(USER, answer)) is None
