"""The OpenAI surface of the policy endpoint (`meshrl.envs.endpoint`), with the real
`openai` client against a real policy replica on a Monarch proc: greedy decoding,
seeds, several samples, stop strings, top log-probs, streaming, tool calls parsed
from the model's text, errors shaped as OpenAI's, the run's sampling winning
where it trains, and an episode that goes on after a tool call with the model's
tokens kept as sampled.

The model is taught a few answers by heart first (`tests.support.openai_surface`),
so that greedy decoding gives known text: a Hermes tool call, a malformed one,
`abc1def`, and a reply after the tool's result."""

from __future__ import annotations

import json
import math

import pytest

from meshrl.config import GenerationConfig, ModelConfig, PolicyConfig
from tests.support.openai_surface import ANSWERS, CALL, WEATHER, teach

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

WEATHER_Q = [{"role": "user", "content": "weather?"}]
BROKEN_Q = [{"role": "user", "content": "broken?"}]
COUNT_Q = [{"role": "user", "content": "count"}]
RUN_TEMPERATURE = 0.01
"""The run's temperature where it trains: low, so that its samples are the taught answers."""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One policy replica over the taught model, and two endpoints on it: one
    that honours each request's sampling (`meshrl serve`'s), one that samples
    at the run's (an agent task's), each with the openai client."""
    from openai import OpenAI

    from actors.policy import Policy
    from meshrl.envs.endpoint import PolicyServer, Router
    from meshrl.envs.rollout import ChatFormat
    from meshrl.model.tokenizer import context_length, load_tokenizer
    from meshrl.procs.mesh import RoleMeshes

    model = ModelConfig(path=str(teach(tmp_path_factory.mktemp("surface"))))
    tokenizer, context = load_tokenizer(model), context_length(model)
    meshes = RoleMeshes({"policy": 1})
    servers = []
    try:
        policy = meshes["policy"].spawn("policy", Policy, model, 0, PolicyConfig(), context)
        for sampling, temperature in (("request", 1.0), ("run", RUN_TEMPERATURE)):
            generation = GenerationConfig(max_new_tokens=96, temperature=temperature)
            router = Router(lambda: policy, 1, generation, timeout_s=120)
            servers.append(PolicyServer(router, ChatFormat(tokenizer), context, sampling=sampling))
        clients = [
            OpenAI(base_url=s.base_url, api_key=s.token, max_retries=0, timeout=120)
            for s in servers
        ]
        yield {
            "server": servers[0],
            "client": clients[0],
            "run": servers[1],
            "run_client": clients[1],
        }
    finally:
        for server in servers:
            server.close()
        meshes.stop()


def chat(client, messages, **fields):
    return client.chat.completions.create(model="meshrl-policy", messages=messages, **fields)


def test_greedy_is_the_argmax_and_its_top_logprobs_are_real(served):
    """temperature 0: the taught answer, the same every time; each token is the
    first of its top_logprobs (under the temperature-1 distribution), which come
    sorted, with finite log-probs whose probabilities sum to at most 1."""
    first = chat(served["client"], COUNT_Q, temperature=0, logprobs=True, top_logprobs=5)
    again = chat(served["client"], COUNT_Q, temperature=0)
    choice = first.choices[0]
    assert choice.message.content == again.choices[0].message.content == "abc1def"
    assert choice.finish_reason == "stop"
    assert first.model_extra["meshrl"]["sampling"]["temperature"] == 0
    for entry in choice.logprobs.content:
        top = entry.top_logprobs
        assert len(top) == 5 and top[0].token == entry.token
        assert top[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
        values = [t.logprob for t in top]
        assert values == sorted(values, reverse=True) and all(math.isfinite(v) for v in values)
        assert sum(math.exp(v) for v in values) <= 1 + 1e-5


def test_stop_max_tokens_seed_and_n(served):
    client = served["client"]
    stopped = chat(client, COUNT_Q, temperature=0, stop=["1", "zz"])
    choice = stopped.choices[0]
    assert choice.message.content == "abc" and choice.finish_reason == "stop"
    # The row keeps what was sampled up to the stop string: "abc1".
    assert (
        choice.model_extra["token_ids"]
        == served["server"].format.tokenizer("abc1", add_special_tokens=False).input_ids
    )
    # The replica itself stopped there: it decoded no token past the "1" (without the
    # stop string the greedy answer runs on, "abc1def" and its end).
    policy, prompt = served["server"].router.actors(), stopped.model_extra["meshrl"]
    greedy = GenerationConfig(max_new_tokens=96, temperature=0)
    kept = choice.model_extra["token_ids"]
    done, _ = policy.generate_top.call_one(
        [prompt["prompt_token_ids"]], greedy, None, 0, ["zz", "1"]
    ).get()
    assert done.completion_ids[0].tolist() == kept
    assert len(whole_ids(policy, prompt)) > len(kept) + 2
    short = chat(client, COUNT_Q, temperature=0, max_completion_tokens=2)
    assert short.choices[0].message.content == "ab" and short.choices[0].finish_reason == "length"
    # A seed fixes the samples; n samples of one prompt, each its own (at a temperature
    # that leaves the taught model some doubt).
    hot = {"temperature": 3.0, "max_tokens": 12}
    seeded = [chat(client, WEATHER_Q, seed=11, n=3, **hot) for _ in range(2)]
    ids = [[c.model_extra["token_ids"] for c in s.choices] for s in seeded]
    assert ids[0] == ids[1] and [c.index for c in seeded[0].choices] == [0, 1, 2]
    assert seeded[0].usage.completion_tokens == sum(len(i) for i in ids[0])
    assert len(set(map(tuple, ids[0]))) > 1
    legacy = client.completions.create(
        model="meshrl-policy", prompt="count", max_tokens=4, logprobs=3, temperature=0.5
    )
    logprobs = legacy.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs)
    assert all(len(top) == 3 for top in logprobs.top_logprobs)


def whole_ids(policy, prompt) -> list[int]:
    """The greedy answer's tokens, as the replica samples them with no stop string."""
    greedy = GenerationConfig(max_new_tokens=96, temperature=0)
    done, _ = policy.generate_top.call_one([prompt["prompt_token_ids"]], greedy).get()
    return done.completion_ids[0][done.completion_mask[0].bool()].tolist()


def test_streaming_sends_what_the_answer_holds(served):
    """Server-sent events as OpenAI sends them: the role first, the text token by
    token as the replica draws it (joined, the non-streamed answer; a stop string
    never shows), the finish reason, then with include_usage a last chunk with no
    choices and the usage."""
    import time

    client = served["client"]
    # A long answer (a seeded sample at a high temperature), streamed: its pieces
    # come while the replica samples, not all at once after it, and join into
    # the answer the same seed gives unstreamed.
    hot = {"temperature": 3.0, "seed": 5, "max_tokens": 96}
    whole = chat(client, WEATHER_Q, **hot).choices[0]
    arrived, pieces = [], []
    for c in chat(client, WEATHER_Q, stream=True, **hot):
        if c.choices and c.choices[0].delta.content:
            arrived.append(time.perf_counter())
            pieces.append(c.choices[0].delta.content)
    assert "".join(pieces) == whole.message.content
    assert len(whole.model_extra["token_ids"]) >= 24 and len(pieces) >= 12
    assert arrived[-1] - arrived[0] > 0.02, "the pieces came at once"
    stop = whole.message.content[10:12]
    cut = list(chat(client, WEATHER_Q, stream=True, stop=[stop], **hot))
    text = "".join(c.choices[0].delta.content or "" for c in cut if c.choices)
    assert text == whole.message.content[: whole.message.content.index(stop)]
    assert cut[-1].choices[0].finish_reason == "stop"
    whole = chat(client, COUNT_Q, temperature=0)
    chunks = list(
        chat(
            client,
            COUNT_Q,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            logprobs=True,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(
        whole.choices[0].model_extra["token_ids"]
    )
    streamed = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert len(streamed) == len(whole.choices[0].model_extra["token_ids"])
    legacy = list(
        client.completions.create(
            model="meshrl-policy", prompt="count", max_tokens=5, stream=True, seed=3
        )
    )
    assert legacy[-1].choices[0].finish_reason == "length"
    assert len("".join(c.choices[0].text for c in legacy)) >= 1


def test_tool_calls_are_parsed_from_the_models_text(served):
    """With tools, the model's `<tool_call>` JSON comes back as message.tool_calls
    (an id, the name, the arguments as a JSON string) and finish_reason
    tool_calls, streamed or not; tool_choice none leaves it as text; `required`
    and a named function start the answer with the call's opening (forced, as the
    template writes it); malformed call text comes back as content (counted, and
    said in the meshrl field), never a 500."""
    client, server = served["client"], served["server"]
    answer = chat(client, WEATHER_Q, tools=[WEATHER], temperature=0)
    choice = answer.choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    chunks = list(chat(client, WEATHER_Q, tools=[WEATHER], temperature=0, stream=True))
    (streamed,) = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert streamed.function.name == "get_weather" and streamed.id.startswith("call_")
    assert json.loads(streamed.function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    plain = chat(client, WEATHER_Q, tools=[WEATHER], tool_choice="none", temperature=0)
    assert plain.choices[0].message.content == CALL and not plain.choices[0].message.tool_calls

    named = chat(
        client,
        WEATHER_Q,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
    )
    assert named.choices[0].message.tool_calls[0].function.name == "get_weather"
    # `required` where the model would answer in words: the answer starts with the
    # call's opening as the template writes it (forced: not sampled), and the model
    # writes the rest.
    errors = server.tool_call_errors
    required = chat(client, COUNT_Q, tools=[WEATHER], tool_choice="required", temperature=0)
    opening = '<tool_call>{"name": "'
    assert required.model_extra["meshrl"]["sampling"]["forced"] == opening
    tokenizer = server.format.tokenizer
    forced = tokenizer(opening, add_special_tokens=False).input_ids
    assert required.choices[0].model_extra["token_ids"][: len(forced)] == forced
    # This model, taught one call and one broken call, finishes it broken: the text
    # comes back as content, counted, never a 500.
    assert required.choices[0].message.content.startswith(opening)
    assert server.tool_call_errors == errors + 1
    assert required.model_extra["meshrl"]["tool_call_errors"][0]["error"].startswith("hermes:")

    errors = server.tool_call_errors
    broken = chat(client, BROKEN_Q, tools=[WEATHER], temperature=0)
    assert broken.choices[0].message.content == ANSWERS[1][2]
    assert not broken.choices[0].message.tool_calls and broken.choices[0].finish_reason == "stop"
    assert server.tool_call_errors == errors + 1


def test_a_conversation_with_an_earlier_tool_call_renders_as_the_template_expects(served):
    """A stateless request that carries an earlier tool call as the client sends
    it (arguments as JSON text): the template gets the arguments as an object, so
    the prompt is the taught one and greedy decoding gives the taught reply."""
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        *WEATHER_Q,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    answer = chat(served["client"], messages, tools=[WEATHER], temperature=0)
    assert answer.choices[0].message.content == ANSWERS[-1][2]
    assert answer.choices[0].finish_reason == "stop"


def test_refusals_are_one_line_and_shaped_as_openais(served):
    from openai import BadRequestError

    client = served["client"]
    assert [m.id for m in client.models.list()] == ["meshrl-policy"]
    for fields, says, param in [
        ({"presence_penalty": 1.0}, "presence_penalty is not supported here", "presence_penalty"),
        ({"extra_body": {"min_p": 0.1}}, "unrecognized request argument: min_p", "min_p"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop must be", "stop"),
    ]:
        with pytest.raises(BadRequestError) as caught:
            chat(client, COUNT_Q, **fields)
        error = caught.value.body
        assert set(error) >= {"message", "type", "param", "code"} and says in error["message"]
        assert error["param"] == param
        assert error["type"] == "invalid_request_error" and "\n" not in error["message"]


def test_an_agent_tasks_endpoint_samples_at_the_runs_settings_and_says_so(served):
    """Where the run trains on the answers, its temperature, top_p and seeds win
    (the trainer scores tokens at the run's temperature); the answer says which
    of the request's it overrode. Stop strings and top_logprobs are honoured."""
    answer = chat(
        served["run_client"], COUNT_Q, temperature=0, top_p=0.5, seed=3, stop=["zz"], max_tokens=6
    )
    said = answer.model_extra["meshrl"]["sampling"]
    assert said["temperature"] == RUN_TEMPERATURE and said["top_p"] == 1.0
    assert said["seed"] is None
    assert said["overridden"] == ["temperature", "top_p", "seed"]
    plain = chat(served["run_client"], COUNT_Q, max_tokens=2)
    assert plain.model_extra["meshrl"]["sampling"]["overridden"] == []


def test_an_episode_goes_on_after_a_tool_call_with_the_tokens_as_sampled(served):
    """An agent's episode: the model calls the tool, the agent sends back the
    assistant message (as the client parsed it) and the tool's result, the
    model answers. The recorded row is the first prompt, the tool call's tokens
    as sampled (not a re-rendering of the parsed call), the tool message's
    tokens (masked: only they were tokenized) and the last answer's tokens. A
    continuation that changes the call is refused."""
    from openai import BadRequestError, OpenAI

    server, tokenizer = served["run"], served["run"].format.tokenizer
    server.open("tools.e1", 4)
    client = OpenAI(base_url=server.episode_url("tools.e1"), api_key="x", max_retries=0)
    first = chat(client, WEATHER_Q, tools=[WEATHER], max_tokens=80)
    message = first.choices[0].message
    assistant = message.model_dump(exclude_none=True)
    tool = {"role": "tool", "tool_call_id": "", "content": "sunny"}
    assert message.tool_calls and first.choices[0].finish_reason == "tool_calls"
    tool["tool_call_id"] = message.tool_calls[0].id
    edited = json.loads(json.dumps(assistant))
    edited["tool_calls"][0]["function"]["arguments"] = '{"city": "Rome"}'
    with pytest.raises(BadRequestError, match="do not continue the episode"):
        chat(client, [*WEATHER_Q, edited, tool], tools=[WEATHER])
    second = chat(client, [*WEATHER_Q, assistant, tool], tools=[WEATHER], max_tokens=40)
    transcript = server.close_episode("tools.e1")
    sampled = first.choices[0].model_extra["token_ids"]
    last = second.choices[0].model_extra["token_ids"]
    n1, n2 = len(sampled), len(last)
    assert transcript.prompt_ids == first.model_extra["meshrl"]["prompt_token_ids"]
    assert transcript.tokens[:n1] == sampled and transcript.tokens[-n2:] == last
    tool_ids = server.format.after_turn([tool], sampled, [WEATHER])
    assert transcript.tokens[n1:-n2] == tool_ids
    assert transcript.loss_mask == [1] * n1 + [0] * len(tool_ids) + [1] * n2
    assert (
        second.model_extra["meshrl"]["prompt_token_ids"]
        == transcript.prompt_ids + sampled + tool_ids
    )
    assert tokenizer.decode(tool_ids) == "[tool]sunny</s>[assistant]"
    # A named tool_choice in an episode: the call's opening is in the row, masked (not
    # sampled), and the model's tokens after it are trained.
    server.open("tools.e2", 4)
    client = OpenAI(base_url=server.episode_url("tools.e2"), api_key="x", max_retries=0)
    named = {"type": "function", "function": {"name": "get_weather"}}
    called = chat(client, WEATHER_Q, tools=[WEATHER], tool_choice=named, max_tokens=80)
    transcript = server.close_episode("tools.e2")
    opening = called.model_extra["meshrl"]["sampling"]["forced"]
    assert opening == '<tool_call>{"name": "get_weather", "arguments": '
    f = len(tokenizer(opening, add_special_tokens=False).input_ids)
    ids = called.choices[0].model_extra["token_ids"]
    assert called.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert transcript.tokens == ids and transcript.loss_mask == [0] * f + [1] * (len(ids) - f)
