"""The policy endpoint under framework agents: episodes per second and tokens per
second for concurrent LangChain agents (`ChatOpenAI(...).bind_tools`, through an
agent task's endpoint: `tests/support/agent_frameworks.py`), streaming off and on,
beside the same episodes played by meshrl's own multi-turn rollout
(`meshrl.envs.rollout.run_episodes` with the same calculator as an environment,
`HermesCalculator`), in the same run, on the same policy replicas.

The model is the tiny one the framework tests teach (`agent_frameworks.teach`): each
episode is two model turns, a Hermes `<tool_call>` to the calculator and the answer
after its result, so both sides play the same episodes of about the same tokens.
The phases alternate (own, the bare openai client, LangChain off, on; `--rounds` times) and each figure is the median
over its rounds.

    python benchmarks/agent_endpoint.py
    python benchmarks/agent_endpoint.py --agents 16 --rounds 1

Every setting it does not measure is pinned here (the model and what it is taught,
the temperature, the lengths, the seed, the threads). Prints a table and, as its
last line, a JSON object: per phase episodes_s and tokens_s (the model's sampled
tokens per second), in_flight (the share of the wall time each
replica had a batch in flight, as the controller saw it: from sending to the
answer's arrival, so it holds the controller's own waiting too), rows_per_batch (the endpoint's requests per replica batch; 0 for
meshrl's own rollout, which sends each replica its share of the waiting episodes),
reward (the share answered right), and the ratios of each agent
phase's rates to meshrl's own (`*_ratio`: 1 would mean the HTTP path and the
framework cost nothing). `openai_client` plays the same episodes with the bare
`openai` client (no framework): the endpoint's own cost, apart from LangChain's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

PINNED = {
    "temperature": 0.05,  # the taught answers are what is sampled
    "max_new_tokens": 120,
    "max_turns": 3,
    "seed": 0,
    "framework": "langchain",
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=64, help="concurrent episodes")
    parser.add_argument("--replicas", type=int, default=2, help="policy replicas")
    parser.add_argument("--rounds", type=int, default=3, help="times each phase is timed")
    args = parser.parse_args()

    import torch

    from actors.environment import Environment
    from actors.policy import Policy
    from meshrl.config import GenerationConfig, ModelConfig, PolicyConfig, TaskConfig
    from meshrl.envs.agent import AgentTask
    from meshrl.envs.endpoint import PolicyServer, Router
    from meshrl.envs.rollout import ChatFormat, run_episodes
    from meshrl.model.tokenizer import context_length, load_tokenizer
    from meshrl.procs.mesh import RoleMeshes
    from meshrl.types import Prompt
    from tests.support import agent_frameworks as frameworks

    torch.set_num_threads(1)
    questions = list(frameworks.QUESTIONS.items())
    prompts = [Prompt(*questions[i % len(questions)]) for i in range(args.agents)]
    generation = GenerationConfig(
        max_new_tokens=PINNED["max_new_tokens"], temperature=PINNED["temperature"]
    )
    module = "tests.support.agent_frameworks"
    with tempfile.TemporaryDirectory() as root:
        model = ModelConfig(path=str(frameworks.teach(Path(root))))
        tokenizer, context = load_tokenizer(model), context_length(model)
        fmt = ChatFormat(tokenizer)
        meshes = RoleMeshes({"policy": args.replicas, "environment": 1})
        server = None
        try:
            policy = meshes["policy"].spawn(
                "policy", Policy, model, PINNED["seed"], PolicyConfig(), context
            )
            env_cfg = TaskConfig(
                name=f"{module}:HermesCalculator",
                max_turns=PINNED["max_turns"],
                env_workers=args.agents,
            )
            environment = meshes["environment"].spawn("environment", Environment, env_cfg, model)
            router = Router(lambda: policy, args.replicas, generation, timeout_s=300)
            server = PolicyServer(router, fmt, context)

            def agent_task(function: str) -> AgentTask:
                return AgentTask(
                    TaskConfig(
                        name=f"agent:{module}:{function}",
                        max_turns=PINNED["max_turns"],
                        env_workers=args.agents,
                        step_timeout_s=300,
                    )
                )

            agents, plain = agent_task(PINNED["framework"]), agent_task("plain_openai")
            roles = {"policy": policy, "environment": environment}
            batch_rows: dict[str, float] = {}  # per endpoint phase's round: rows per batch

            def own(key: str) -> tuple[list, float]:
                episodes, timing = run_episodes(
                    prompts,
                    lambda role: roles[role],
                    args.replicas,
                    1,
                    fmt,
                    generation,
                    PINNED["max_turns"],
                    context,
                    300,
                    key_prefix=key,
                )
                return episodes, timing["time/episode_generate_s"]

            def through(task: AgentTask, stream: bool = False):
                def play(key: str) -> tuple[list, float]:
                    frameworks.STREAM["on"] = stream
                    batches, rows = router.batches, router.rows
                    episodes, timing = task.play(prompts, server, key)
                    batch_rows[key] = (router.rows - rows) / max(1, router.batches - batches)
                    return episodes, timing["time/episode_generate_s"]

                return play

            phases = {
                "own": own,
                "openai_client": through(plain),
                "stream_off": through(agents, False),
                "stream_on": through(agents, True),
            }
            for name, play in phases.items():  # warm: the first episodes pay for imports
                play(f"warm.{name}.")
            measured: dict[str, list[dict]] = {name: [] for name in phases}
            for round_ in range(args.rounds):
                for name, play in phases.items():
                    started = time.perf_counter()
                    episodes, generating = play(f"{round_}.{name}.")
                    wall = time.perf_counter() - started
                    failed = [e.failed for e in episodes if e.failed]
                    if failed:
                        raise SystemExit(f"{name}: {len(failed)} episodes failed: {failed[0]}")
                    measured[name].append(
                        {
                            "wall_s": wall,
                            "generate_s": generating,
                            "batch_rows": batch_rows.get(f"{round_}.{name}.", 0.0),
                            "tokens": sum(sum(e.loss_mask) for e in episodes),
                            "turns": sum(e.turns for e in episodes) / len(episodes),
                            "reward": sum(e.reward for e in episodes) / len(episodes),
                        }
                    )
            agents.close()
            plain.close()
        finally:
            frameworks.STREAM["on"] = False
            if server is not None:
                server.close()
            meshes.stop()

    result: dict = {"agents": args.agents, "replicas": args.replicas, "rounds": args.rounds}
    print(
        f"{'phase':<15}{'episodes/s':>12}{'tokens/s':>12}{'in flight':>12}{'turns':>8}{'reward':>8}"
    )
    for name, rounds in measured.items():
        wall = statistics.median(r["wall_s"] for r in rounds)
        tokens = statistics.median(r["tokens"] for r in rounds)
        busy = statistics.median(r["generate_s"] / r["wall_s"] for r in rounds)
        turns = statistics.mean(r["turns"] for r in rounds)
        reward = statistics.mean(r["reward"] for r in rounds)
        result[name] = {
            "episodes_s": round(args.agents / wall, 2),
            "tokens_s": round(tokens / wall, 1),
            "in_flight": round(busy / args.replicas, 3),
            "rows_per_batch": round(statistics.median(r["batch_rows"] for r in rounds), 2),
            "turns": round(turns, 2),
            "reward": round(reward, 3),
        }
        print(
            f"{name:<15}{args.agents / wall:>12.2f}{tokens / wall:>12.1f}"
            f"{busy / args.replicas:>12.1%}{turns:>8.2f}{reward:>8.3f}"
        )
    for name in ("openai_client", "stream_off", "stream_on"):
        for rate in ("episodes_s", "tokens_s"):
            result[f"{name}_{rate}_ratio"] = round(result[name][rate] / result["own"][rate], 3)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
