"""Off-the-shelf agent frameworks, unmodified, play an agent task's episodes through
the policy's endpoint (`meshrl.envs.endpoint`): the OpenAI Agents SDK, LangChain,
smolagents and mini-swe-agent (`tests/support/agent_frameworks.py`), each against a
real policy replica on a Monarch proc over a tiny model taught their tool calls.

Each episode is checked three ways: the framework got `tool_calls` back (parsed
from the model's Hermes `<tool_call>` text), ran its tool and sent the result in
its next call; and the row meshrl trains on (`AgentTask.play`, then
`to_completions`, as the collector does) is token for token what the framework's
HTTP client received: the first call's prompt, then each answer's `token_ids`
after the context its call was answered in, the model's tokens trained and the
rest masked."""

from __future__ import annotations

import json

import pytest

from meshrl.config import GenerationConfig, ModelConfig, PolicyConfig, TaskConfig
from meshrl.types import Prompt
from tests.support import agent_frameworks as frameworks

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

TEMPERATURE = 0.05
"""Low: the taught answers are what is sampled."""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One policy replica over the taught model, behind an agent task's endpoint
    (sampling at the run's settings)."""
    from actors.policy import Policy
    from meshrl.envs.endpoint import PolicyServer, Router
    from meshrl.envs.rollout import ChatFormat
    from meshrl.model.tokenizer import context_length, load_tokenizer
    from meshrl.procs.mesh import RoleMeshes

    root = tmp_path_factory.mktemp("frameworks")
    model = ModelConfig(path=str(frameworks.teach(root)))
    rows = [{"prompt": q, "answer": a} for q, a in frameworks.QUESTIONS.items()]
    (root / "questions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer, context = load_tokenizer(model), context_length(model)
    meshes = RoleMeshes({"policy": 1})
    server = None
    try:
        policy = meshes["policy"].spawn("policy", Policy, model, 0, PolicyConfig(), context)
        generation = GenerationConfig(max_new_tokens=120, temperature=TEMPERATURE)
        router = Router(lambda: policy, 1, generation, timeout_s=120)
        server = PolicyServer(router, ChatFormat(tokenizer), context)
        yield server, root
    finally:
        if server is not None:
            server.close()
        meshes.stop()


def play(server, function: str, stream: bool = False):
    """The questions' episodes, played by `function`'s agent as an agent task plays them."""
    from meshrl.envs.agent import AgentTask

    task = AgentTask(
        TaskConfig(name=f"agent:tests.support.agent_frameworks:{function}", max_turns=4)
    )
    prompts = [Prompt(question, answer) for question, answer in frameworks.QUESTIONS.items()]
    frameworks.STREAM["on"] = stream
    try:
        episodes, _ = task.play(prompts, server, f"{function}.{int(stream)}.")
    finally:
        frameworks.STREAM["on"] = False
        task.close()
    return prompts, episodes


def assert_trained_as_received(episode, calls: list[dict], pad_id: int) -> None:
    """The episode's row is the answers as the client received them: each answer's
    context (`meshrl.prompt_token_ids`) then its `token_ids` start the row, the
    last ends it; exactly the answers' tokens are trained, but for an opening
    the endpoint forced to meet `tool_choice` (smolagents sends `required`). So
    is the batch row `to_completions` makes of it."""
    from meshrl.envs.rollout import to_completions

    answered = [c for c in calls if c["status"] == 200]
    assert len(answered) == len(calls) == episode.turns
    row = episode.prompt_ids + episode.tokens
    assert episode.prompt_ids == answered[0]["meshrl"]["prompt_token_ids"]
    trained = [0] * len(row)
    for call in answered:
        context, ids = call["meshrl"]["prompt_token_ids"], call["token_ids"]
        assert ids and row[: len(context) + len(ids)] == context + ids
        forced = call["meshrl"]["sampling"].get("forced_tokens", 0)
        trained[len(context) + forced : len(context) + len(ids)] = [1] * (len(ids) - forced)
    assert len(row) == len(context) + len(ids)
    assert [0] * len(episode.prompt_ids) + episode.loss_mask == trained
    completions, _ = to_completions([episode], pad_id)
    ids = completions.completion_ids[0, : len(episode.tokens)].tolist()
    assert ids == episode.tokens
    assert completions.completion_mask[0, : len(ids)].tolist() == episode.loss_mask


TOOL_MESSAGES = {
    # (the role the framework sends the tool's result in, what the first tool run is)
    "openai_agents": ("tool", "calculator"),
    "langchain": ("tool", "calculator"),
    "smolagents": ("user", "calculator"),
    "mini_swe_agent": ("tool", "bash"),
}


@pytest.mark.parametrize(
    "function, stream",
    [
        ("openai_agents", False),
        ("langchain", False),
        ("smolagents", False),
        ("mini_swe_agent", False),
    ],
)
def test_a_framework_agent_gets_tool_calls_runs_them_and_trains_on_what_it_received(
    served, function, stream
):
    server, _ = served
    prompts, episodes = play(server, function, stream)
    role, tool = TOOL_MESSAGES[function]
    pad_id = server.format.tokenizer.pad_token_id
    for prompt, episode in zip(prompts, episodes, strict=True):
        assert not episode.failed, episode.failed
        assert episode.reward == 1.0, frameworks.RECEIVED.get(episode.key)
        calls = frameworks.RECEIVED[episode.key]
        assert all(c["stream"] == stream for c in calls)
        first = calls[0]["message"]["tool_calls"]
        assert first and first[0]["function"]["name"] == tool
        name, arguments, result = frameworks.TOOL_RUNS[episode.key][0]
        assert name == tool and json.loads(first[0]["function"]["arguments"]) == arguments
        assert prompt.answer in result  # the tool ran: its output holds the answer
        sent = calls[1]["request"]["messages"]
        assert sent[-1]["role"] == role and prompt.answer in json.dumps(sent[-1]["content"])
        assert_trained_as_received(episode, calls, pad_id)


def test_grpo_trains_a_streaming_langchain_agent_on_what_it_received(served, tmp_path):
    """A GRPO run whose agent task is the LangChain agent, streaming: each trained
    episode (the collector's, `last_episodes`) is what the framework's client
    received, and the endpoint's counts are logged per step and documented."""
    from algorithms.grpo import GRPO
    from tests.support.runs import QUIET, configure, undocumented_metrics

    _, root = served
    cfg = configure(
        tmp_path,
        "langchain",
        "steps=2",
        "prompts_per_step=2",
        "group_size=2",
        f"model.path={root / 'model'}",
        "task.name=agent:tests.support.agent_frameworks:langchain",
        f"task.dataset={root / 'questions.jsonl'}",
        f"generation.temperature={TEMPERATURE}",
        "generation.max_new_tokens=120",
        "policy.tool_parser=hermes",
        "warm_start.steps=0",
        "eval.every=0",
        *QUIET,
    )
    # A run's episode keys repeat from run to run in one process (another test file's
    # run may have come before in this worker): what is recorded starts here.
    frameworks.RECEIVED.clear()
    frameworks.TOOL_RUNS.clear()
    frameworks.STREAM["on"] = True
    try:
        algo = GRPO(cfg)
        history = algo.run()
    finally:
        frameworks.STREAM["on"] = False
    assert not undocumented_metrics(history, "algorithms/grpo.md")
    for record in history:
        assert record["reward/mean"] == 1.0 and record["samples/trained"] == 4
        assert record["episodes/tool_call_errors"] == record["episodes/tool_choice_unmet"] == 0
        assert record["episodes/refused_calls"] == 0
    for episode in algo.last_episodes:
        calls = frameworks.RECEIVED[episode.key]
        assert all(c["stream"] for c in calls) and len(calls) == 2
        assert_trained_as_received(episode, calls, algo.tokenizer.pad_token_id)


def test_a_tool_parser_that_is_not_one_is_one_config_error():
    from algorithms.grpo import GRPOConfig
    from meshrl.config import ConfigError, load_config
    from tests.conftest import DEFAULT_CONFIG

    with pytest.raises(ConfigError, match="'policy.tool_parser': 'nope' is not a tool-call parser"):
        load_config(GRPOConfig, DEFAULT_CONFIG, ["policy.tool_parser=nope"])
    assert load_config(GRPOConfig, DEFAULT_CONFIG, ["policy.tool_parser=qwen3"])
