"""The OpenEnv adapter (`task.name=openenv:...`) against openenv-core's own server
on 127.0.0.1, which meshrl starts: GRPO trains on a multi-turn OpenEnv
environment written here (tests/support/openenv_env.py), a server that dies
mid-episode fails only its episodes, and bad names get one line."""

import contextlib
import glob
import math
import os
import threading
import time

import pytest

from algorithms.grpo import GRPO, GRPOConfig
from meshrl.config import ConfigError, TaskConfig, load_config
from meshrl.envs import make_task
from meshrl.types import Prompt
from tests.conftest import DEFAULT_CONFIG, descendants
from tests.support import other_user
from tests.support.runs import grpo

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

ENV = "openenv:tests.support.openenv_env"


def openenv_env():
    """tests/support/openenv_env.py, imported when a test needs it: it imports
    openenv-core, which each pytest worker would otherwise import to collect this file."""
    from meshrl.envs.openenv_server import import_openenv

    import_openenv()  # without gradio, as meshrl's own imports of it
    from tests.support import openenv_env

    return openenv_env


SHORT = ["warm_start.steps=0", "generation.max_new_tokens=6", "eval.every=0"]


def openenv_servers() -> set[int]:
    """Pids of the openenv servers meshrl started in this test process or its procs."""
    found = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"openenv_server.py" in f.read():
                    found.add(int(entry))
        except OSError:
            continue  # it ended meanwhile
    return found & descendants(os.getpid())


def assert_no_servers_left(timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while openenv_servers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not openenv_servers(), "openenv servers outlived the run"


def turns_of(episode):
    """An episode's token stream cut where the loss mask changes: (mask, ids) runs."""
    runs, start = [], 0
    for i in range(1, len(episode.tokens) + 1):
        if i == len(episode.tokens) or episode.loss_mask[i] != episode.loss_mask[start]:
            runs.append((episode.loss_mask[start], episode.tokens[start:i]))
            start = i
    return runs


def test_grpo_trains_on_an_openenv_environment(tmp_path, no_stray_procs):
    """Every episode is the env's own account of it: the model's turns (loss mask
    1), the server's observations between them (mask 0, exactly their text) and
    the summed step rewards as the reward; one server on the environment proc
    played them all, and no server is left afterwards."""
    algo, history = grpo(tmp_path, "grpo_default.yaml", f"task.name={ENV}:Reverse", *SHORT)
    tok = algo.tokenizer
    assert len(history) == 2
    for record in history:
        assert record["samples/trained"] == 8 and math.isfinite(record["train/loss"])
        assert record.get("episodes/failed", 0) == 0
        assert record["tokens/environment"] > 0  # observations were in the batch
    assert sum(r.get("env/openenv_server_starts", 0) for r in history) == 1
    assert any(r["reward/mean"] > 0 for r in history)
    for episode in algo.last_episodes:
        assert not episode.failed
        runs = turns_of(episode)
        model_turns = [ids for mask, ids in runs if mask == 1]
        observations = [tok.decode(ids) for mask, ids in runs if mask == 0]
        actions = [tok.decode(ids, skip_special_tokens=True) for ids in model_turns]
        replies, total, done = openenv_env().play(episode.prompt.text, actions)
        assert done and len(model_turns) == episode.turns in (1, 2)
        assert observations == episode.replies == replies
        assert episode.reward == pytest.approx(total)
    assert any(episode.turns == 2 for episode in algo.last_episodes)
    assert_no_servers_left()


def test_a_server_that_dies_mid_episode_fails_its_episodes_and_restarts(
    tmp_path, no_stray_procs, caplog
):
    """The environment proc's first server exits at its first step: the episodes
    it was playing fail and are counted, their groups are played again on a new
    server, and every step trains a full batch."""
    started, markers = time.time(), openenv_env().MARKERS
    try:
        algo, history = grpo(tmp_path, "grpo_default.yaml", f"task.name={ENV}:DiesOnce", *SHORT)
    finally:  # this run's marker (DiesOnce) and those of runs beside it: they die again
        for marker in glob.glob(os.path.join(markers, "*")):
            if os.path.getmtime(marker) >= started:
                os.unlink(marker)
        with contextlib.suppress(OSError):  # empty now, unless a run beside it is at work
            os.rmdir(markers)
    assert history[0]["episodes/failed"] >= 1
    assert sum(r.get("env/openenv_server_starts", 0) for r in history) == 2
    for record in history:
        assert record["samples/trained"] == 8 and math.isfinite(record["train/loss"])
    assert "died mid-episode (exit code 3)" in caplog.text
    assert_no_servers_left()


def test_bad_names_get_one_line(tmp_path, no_stray_procs, capsys):
    """A module that does not import is a config error naming task.name (no proc
    started); an unreachable server stops the run at its first prompt with one
    line naming the URL."""
    with pytest.raises(ConfigError, match=r"'task.name': cannot import 'nosuchmodule'"):
        load_config(GRPOConfig, DEFAULT_CONFIG, ["task.name=openenv:nosuchmodule:Env"])
    with pytest.raises(ConfigError, match=r"'task.name': .*not an openenv Environment"):
        load_config(GRPOConfig, DEFAULT_CONFIG, [f"task.name={ENV}:play"])
    from algorithms.commands.train import main

    url = "http://127.0.0.1:9"  # nothing listens on the discard port
    code = main(
        GRPO,
        GRPOConfig,
        [
            "--config",
            DEFAULT_CONFIG,
            f"task.name=openenv:{url}",
            f"run.dir={tmp_path}",
            "run.progress=false",
            "warm_start.steps=0",
        ],
    )
    error = capsys.readouterr().err.strip().splitlines()[0]
    assert code == 1
    assert error.startswith(f"error: openenv server {url} is unreachable: "), error


def test_a_class_without_concurrent_sessions_gets_a_server_per_episode():
    """`Solo` (SUPPORTS_CONCURRENT_SESSIONS False): two episodes at once play on
    two servers; with task.env_workers=2 there is no third (the reason says
    why); a server whose episode ended plays the next one; close() stops them."""
    task = make_task(TaskConfig(name=f"{ENV}:Solo", env_workers=2))
    try:
        prompt = Prompt(text="", answer="", data={"seed": 1})  # the server says "291>"
        episodes = [task.episode(prompt) for _ in range(2)]
        steps = [None, None]
        threads = [
            threading.Thread(target=lambda i=i: steps.__setitem__(i, episodes[i].step("1")))
            for i in range(2)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert [s.done for s in steps] == [False, False]
        assert len(task.servers.live) == 2
        with pytest.raises(RuntimeError, match="SUPPORTS_CONCURRENT_SESSIONS"):
            task.servers.acquire(wait_s=0.1)  # what a third episode's first step raises
        assert episodes[0].step("1").done
        again = task.episode(prompt)  # waits for the session that ended to close
        assert not again.step("1").done and len(task.servers.live) == 2
        again.close()
        episodes[1].close()
    finally:
        task.close()
    assert_no_servers_left()


AS_ANOTHER_USER = """
import json, os, socket, sys, urllib.error, urllib.request
address, pid = sys.argv[1], int(sys.argv[2])
seen = {"uid": os.getuid()}
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
for path, body in [("/health", None), ("/reset", b'{"seed": 1}'), ("/schema", None)]:
    request = urllib.request.Request(address + path, body, {"Content-Type": "application/json"})
    try:
        seen[path] = opener.open(request, timeout=10).status
    except urllib.error.HTTPError as error:
        seen[path] = error.code
host, port = address.split("//")[1].split(":")
with socket.create_connection((host, int(port)), timeout=10) as conn:
    conn.sendall(
        f"GET /ws HTTP/1.1\\r\\nHost: {host}:{port}\\r\\nUpgrade: websocket\\r\\n"
        "Connection: Upgrade\\r\\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\\r\\n"
        "Sec-WebSocket-Version: 13\\r\\n\\r\\n".encode()
    )
    seen["/ws"] = int(conn.recv(4096).split()[1])
try:
    open(f"/proc/{pid}/environ", "rb").read()
    seen["environ"] = "read"
except OSError as error:
    seen["environ"] = type(error).__name__
seen["cmdline"] = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
print(json.dumps(seen))
"""


def test_a_server_meshrl_starts_answers_only_with_its_token():
    """An openenv server meshrl starts answers its own URL (the token in its
    path): openenv-core's client plays through it. A call without the token gets
    403, HTTP and WebSocket alike, before the environment runs; from another
    user (nobody) too, which cannot read the token from the server's command
    line or environment either."""
    import json
    import urllib.error
    import urllib.request
    from urllib.parse import urlsplit

    from meshrl.envs.openenv_server import Server, import_openenv

    server = Server(f"{ENV.partition(':')[2]}:Reverse", 4)
    server.start()
    try:
        address = f"http://{urlsplit(server.url).netloc}"  # the URL without the token
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

        def status(url: str, body: bytes | None = None) -> int:
            request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
            try:
                return opener.open(request, timeout=10).status
            except urllib.error.HTTPError as error:
                return error.code

        assert status(server.url + "/health") == 200
        assert status(server.url + "/reset", b'{"seed": 1}') == 200
        for url in (address, f"{address}/not-the-token", server.url[:-1]):
            assert status(url + "/health") == 403
            assert status(url + "/reset", b'{"seed": 1}') == 403
        import_openenv()
        from openenv.core.generic_client import GenericEnvClient

        client = GenericEnvClient(base_url=server.url).sync()
        client.connect()
        assert client.reset(seed=1).observation["text"] == "291>"
        client.close()
        stranger = GenericEnvClient(base_url=address).sync()
        with pytest.raises(ConnectionError, match="HTTP 403"):
            stranger.connect()
        if other_user.available():
            out = other_user.as_nobody(AS_ANOTHER_USER, address, str(server.proc.pid), timeout=30)
            assert out.returncode == 0, out.stderr[-2000:]
            seen = json.loads(out.stdout)
            token = urlsplit(server.url).path.strip("/")
            assert token not in seen.pop("cmdline")
            assert seen == {
                "uid": 65534,
                "/health": 403,
                "/reset": 403,
                "/schema": 403,
                "/ws": 403,
                "environ": "PermissionError",
            }
    finally:
        server.stop()
    assert_no_servers_left()
