"""Agent tasks through the policy's OpenAI-compatible endpoint (`meshrl.envs.endpoint`): an
agent written against the `openai` client trains GRPO, and what meshrl trains on
is token for token what the sampler produced, across a chat template that
rewrites earlier turns."""

import json
import random
import re
import time
import urllib.error
import urllib.request

import pytest

from algorithms.grpo import GRPO, GRPOConfig
from meshrl.config import ConfigError, ModelConfig, load_config
from tests.conftest import DEFAULT_CONFIG
from tests.support import agent
from tests.support.runs import configure

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

# Qwen3-like: an assistant turn that is not the last is rendered without its
# <think> block. EOS closes each message.
TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' and not loop.last -%}"
    "[assistant]{{ m['content'].split('</think>')[-1] }}</s>"
    "{%- else -%}[{{ m['role'] }}]{{ m['content'] }}</s>{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}[assistant]{%- endif -%}"
)


@pytest.fixture(scope="module")
def agent_data(tmp_path_factory):
    """A tiny Llama and a char tokenizer with TEMPLATE (saved as HF would), and a
    dataset of digit strings whose demonstrations think first."""
    import torch
    from transformers import AutoModelForCausalLM

    from meshrl.model.models import embedded_config
    from meshrl.model.tokenizer import build_char_tokenizer

    root = tmp_path_factory.mktemp("agent")
    tok = build_char_tokenizer()
    tok.chat_template = TEMPLATE
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=256)
    AutoModelForCausalLM.from_config(embedded_config(cfg, len(tok))).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    rng = random.Random(0)
    rows = []
    for _ in range(64):
        digits = "".join(rng.choice("0123456789") for _ in range(3))
        rows.append({"prompt": f"{digits}>", "answer": f"<think>{digits}</think>{digits[::-1]}"})
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def agent_run(root, tmp_path, function, *overrides):
    cfg = configure(
        tmp_path,
        "run",
        "steps=2",
        "prompts_per_step=4",
        "group_size=2",
        f"model.path={root / 'model'}",
        f"task.name=agent:tests.support.agent:{function}",
        f"task.dataset={root / 'prompts.jsonl'}",
        "generation.max_new_tokens=24",
        "warm_start.steps=40",
        "eval.every=0",
        *overrides,
        "run.save_final=false",
    )
    algo = GRPO(cfg)
    return algo, algo.run()


def test_an_agent_trains_on_exactly_the_tokens_it_was_served(agent_data, tmp_path, no_stray_procs):
    """Each episode is two chat calls with a tool call between. The trained row is
    the first call's prompt, the model's tokens as served (token ids and
    log-probs), the tool message's tokens (masked), the second answer; the
    second call's context is that row, not the template's re-rendering (which
    drops the first answer's <think> block). The first episode's agent raises
    and the second makes no call: both fail, are counted, and their groups are
    played again."""
    agent.CALLS.clear()
    algo, history = agent_run(
        agent_data,
        tmp_path,
        "sometimes_failing",
        "eval.every=2",
        "eval.sets.heldout.prompts=2",
        "eval.sets.heldout.k=2",
    )
    assert 0 <= history[-1]["eval/heldout/reward"] <= 1  # held-out episodes, the agent's too
    assert history[0]["episodes/failed"] == 2 and history[0]["samples/dropped_env_failed"] == 4
    assert all(record["samples/trained"] == 8 for record in history)
    assert all(record["time/generate_s"] > 0 for record in history)  # the router's batches
    assert max(r["sampling/logprob_abs_diff"] for r in history) < 1e-3  # trainer == sampler
    tok = algo.tokenizer
    rewritten = 0
    for episode in algo.last_episodes:
        url = next(u for u in agent.CALLS if f"/episodes/{episode.key}~" in u)
        first, second = agent.CALLS[url]
        assert episode.prompt_ids == first["prompt_token_ids"] and episode.turns == 2
        n1, n2 = len(first["token_ids"]), len(second["token_ids"])
        assert episode.tokens[:n1] == first["token_ids"]
        assert episode.logprobs[:n1] == pytest.approx(first["logprobs"], abs=1e-6)
        assert episode.tokens[len(episode.tokens) - n2 :] == second["token_ids"]
        assert episode.loss_mask == [1] * n1 + [0] * (len(episode.tokens) - n1 - n2) + [1] * n2
        tool = tok.decode(episode.tokens[n1 : len(episode.tokens) - n2])
        assert second["messages"][-1]["content"] in tool and tool.endswith("[assistant]")
        assert second["prompt_token_ids"] == episode.prompt_ids + episode.tokens[: -n2 or None]
        assert episode.reward == agent.partial_credit(
            second["content"].split("</think>")[-1], episode.prompt.text[:3][::-1]
        )
    # Over every two-call episode of the run (the last step's are a few, and whether a
    # first answer thinks is up to the sampler): the second call's context goes on
    # from the first answer's tokens as served, where the template's re-rendering
    # differs from it (drops a <think> block) at least once.
    for first, second in (calls for calls in agent.CALLS.values() if len(calls) == 2):
        served = first["prompt_token_ids"] + first["token_ids"]
        assert second["prompt_token_ids"][: len(served)] == served
        rendered = tok.apply_chat_template(
            second["messages"], add_generation_prompt=True, tokenize=False
        )
        rewritten += (
            tok(rendered, add_special_tokens=False).input_ids != (second["prompt_token_ids"])
        )
    assert rewritten, "no first answer had a <think> block for the template to drop"


def test_a_local_process_that_guesses_episode_urls_trains_on_none_of_its_calls(
    agent_data, tmp_path, no_stray_procs
):
    """Another local process knows the endpoint's port and how episode keys are
    made (`<version>.<attempt>.<i>`), and posts its own prompt to every key while
    the agents wait a second before their first call. Without each episode's
    secret every call gets 404 and is counted; what trains is the agents'.
    With `task.max_turns=1` the agents' second calls come after the episode's
    end: answered empty ("length"), the episodes kept, truncated at one turn."""
    import socket
    import threading

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stop, answered, refused = threading.Event(), [], []
    body = json.dumps(
        {"model": "meshrl-policy", "messages": [{"role": "user", "content": "hijacked"}]}
    )

    def guess():
        while not stop.is_set():
            for key in [f"{v}.{a}.{i}" for v in range(3) for a in range(2) for i in range(8)]:
                for segment in (key, f"{key}~", f"{key}~AAAAAAAAAAAAAAAAAAAAAA"):
                    url = f"http://127.0.0.1:{port}/episodes/{segment}/v1/chat/completions"
                    request = urllib.request.Request(url, body.encode(), method="POST")
                    try:
                        with urllib.request.urlopen(request, timeout=5) as answer:
                            answered.append(answer.status)
                    except urllib.error.HTTPError as error:
                        refused.append(error.code)
                    except OSError:
                        time.sleep(0.05)  # not listening yet, or gone
            time.sleep(0.01)

    guesser = threading.Thread(target=guess, daemon=True)
    guesser.start()
    try:
        algo, history = agent_run(
            agent_data,
            tmp_path,
            "slow_to_start",
            "warm_start.steps=0",
            "generation.max_new_tokens=8",
            f"policy.serve_port={port}",
            "task.max_turns=1",
        )
    finally:
        stop.set()
        guesser.join(timeout=10)
    assert not answered, f"{len(answered)} guessed calls were answered"
    assert refused and set(refused) == {404}
    assert sum(r["episodes/refused_calls"] for r in history) > 0
    assert all(r["samples/trained"] == 8 and r["episodes/truncated"] == 8 for r in history)
    assert all(e.turns == 1 and e.truncated for e in algo.last_episodes)
    for episode in algo.last_episodes:
        assert "hijacked" not in algo.tokenizer.decode(episode.prompt_ids + episode.tokens)


def test_the_endpoint_answers_clients_and_refuses_what_it_cannot_record(
    agent_data, tmp_path, no_stray_procs
):
    """`policy.serve_port` serves the replicas while the run trains: the plain
    routes answer a client with the run's token (printed, and in status.json)
    and refuse one without; an episode route refuses a conversation that
    changed an earlier message, and an unknown episode."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = configure(
        tmp_path,
        "endpoint",
        "steps=2",
        "prompts_per_step=2",
        "group_size=2",
        "warm_start.steps=0",
        "eval.every=0",
        f"policy.serve_port={port}",
        "run.save_final=false",
    )
    algo = GRPO(cfg)
    try:
        algo.train(1)  # the meshes stay up
        from openai import AuthenticationError, BadRequestError, NotFoundError, OpenAI

        token = algo.collector.endpoint().token
        status = json.loads((tmp_path / "endpoint" / "status.json").read_text())
        assert status["endpoint_token"] == token
        assert status["endpoint_url"] == f"http://127.0.0.1:{port}/v1"
        stranger = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        with pytest.raises(AuthenticationError, match="a wrong token"):
            stranger.models.list()
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=token, max_retries=0)
        assert [m.id for m in client.models.list()] == ["meshrl-policy"]
        out = client.completions.create(
            model="meshrl-policy", prompt="12>", max_tokens=3, logprobs=1
        )
        assert len(out.choices[0].model_extra["token_ids"]) <= 3
        assert len(out.choices[0].logprobs.token_logprobs) == len(
            out.choices[0].model_extra["token_ids"]
        )
        chat = client.chat.completions.create(
            model="meshrl-policy", messages=[{"role": "user", "content": "12>"}], max_tokens=4
        )
        assert chat.choices[0].finish_reason in ("stop", "length")
        server = algo.collector.endpoint()
        server.open("e1", 4)
        episode = OpenAI(base_url=server.episode_url("e1"), api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "34>"}]
        answer = episode.chat.completions.create(model="meshrl-policy", messages=messages)
        edited = [
            *messages,
            {"role": "assistant", "content": answer.choices[0].message.content + "!"},
        ]
        with pytest.raises(BadRequestError, match="do not continue the episode"):
            episode.chat.completions.create(
                model="meshrl-policy", messages=[*edited, {"role": "user", "content": "again"}]
            )
        with pytest.raises(BadRequestError, match="n must be 1 in an episode"):
            episode.chat.completions.create(model="meshrl-policy", messages=messages, n=2)
        gone = OpenAI(base_url=server.episode_url("nope"), api_key="x", max_retries=0)
        with pytest.raises(NotFoundError, match="no open episode"):
            gone.chat.completions.create(model="meshrl-policy", messages=messages)
    finally:
        algo.stop(save=False)
    with pytest.raises(urllib.error.URLError):  # the endpoint stopped with the run
        urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["task.name=agent:tests.support.agent:nope", "task.dataset=X"], "task.name"),
        (["task.name=agent:no_such_module:solve"], "task.name"),
        (["task.name=agent:tests.support.agent:reverse_with_a_tool"], "task.dataset"),
        (["policy.serve_port=70000"], "policy.serve_port"),
    ],
)
def test_bad_agent_config_is_one_clear_error(overrides, key):
    with pytest.raises(ConfigError, match=key):
        load_config(GRPOConfig, DEFAULT_CONFIG, overrides)


def test_meshrl_serve_answers_records_and_stops_on_ctrl_c(agent_data, tmp_path, no_stray_procs):
    """`meshrl serve MODEL --config FILE`: a policy mesh behind the endpoint, its
    token printed and kept in status.json (0600); a caller without it is refused;
    each answer is a line of requests.jsonl; SIGINT stops the server and the procs."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    from openai import AuthenticationError, OpenAI

    from tests.conftest import REPO

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "algorithms.commands", "serve", str(agent_data / "model")]
    command += ["--config", DEFAULT_CONFIG, f"policy.serve_port={port}", f"run.dir={tmp_path}"]
    command += ["run.name=serve"]
    proc = subprocess.Popen(
        command,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # A background shell starts children with SIGINT ignored; a user's terminal does not.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 120
        while "serving" not in (line := proc.stdout.readline()):
            assert line and time.monotonic() < deadline, "meshrl serve did not come up"
        # The line says how to call it: the URL, and the token as a Bearer header.
        token = re.search(r"Authorization: Bearer ([\w-]+)'", line).group(1)
        assert f"at http://127.0.0.1:{port}/v1 " in line
        status_path = tmp_path / "serve" / "status.json"
        while "endpoint_token" not in (
            status_path.read_text() if status_path.exists() else ""
        ):  # written every run.status_every_s
            assert time.monotonic() < deadline, "status.json has no endpoint_token"
            time.sleep(0.5)
        assert json.loads(status_path.read_text())["endpoint_token"] == token
        assert status_path.stat().st_mode & 0o777 == 0o600
        stranger = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        with pytest.raises(AuthenticationError):
            stranger.chat.completions.create(
                model="model", messages=[{"role": "user", "content": "12>"}]
            )
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=token, max_retries=0)
        out = client.chat.completions.create(
            model="model", messages=[{"role": "user", "content": "12>"}], temperature=0.7
        )
        lines = (tmp_path / "serve" / "requests.jsonl").read_text().splitlines()
        (record,) = [json.loads(x) for x in lines]
        assert record["completion_ids"] == out.choices[0].model_extra["token_ids"]
        assert record["prompt_ids"] == out.model_extra["meshrl"]["prompt_token_ids"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
