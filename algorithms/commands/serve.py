"""`meshrl serve MODEL --config FILE [key=value ...]`: the policy's OpenAI-compatible
endpoint (`meshrl.envs.endpoint`) for any saved model, with no training.

MODEL is an HF directory, a run directory or a checkpoint (as for `meshrl
eval`). FILE is any algorithm's config: its `model`, `generation`, `policy`
and `placement` sections are read. `placement.policy` replicas answer
`/v1/chat/completions`, `/v1/completions` and `/v1/models` at
http://127.0.0.1:PORT/v1 (`policy.serve_port`, else 8000), each request at
its own sampling settings (temperature, 0 for greedy; top_p; seed; n; stop
strings; top_logprobs; stream), up to `generation.max_new_tokens` tokens; with
`tools`, the model's tool calls come back as `tool_calls`, read by the parser
`policy.tool_parser` names, or its chat template implies (auto: `meshrl.envs.tool_calls`;
docs/environments.md).
Callers send the token printed at start (also in `<run dir>/status.json`) as
`Authorization: Bearer TOKEN`, the OpenAI client's `api_key`.
Every answer is appended to `<run dir>/requests.jsonl` (prompt and completion
ids, log-probs, weight version). Ctrl-C stops the server and the procs.

    meshrl serve runs/grpo-20261124-101500 --config algorithms/configs/grpo_default.yaml
"""

from __future__ import annotations

import os
import sys
import threading

from algorithms.commands.eval import EvaluateConfig, model_command
from meshrl.loop.export import start_from

USAGE = "usage: meshrl serve MODEL_OR_RUN_DIR --config FILE [key=value ...]"


class ServeConfig(EvaluateConfig):
    """`meshrl eval`'s sections; `task` and `eval` are not used."""

    def validate(self) -> None:
        for section in (self.generation, self.policy, self.placement):
            section.validate()


def serve(cfg: ServeConfig) -> None:
    """Spawn the policy mesh for `cfg.model` and serve it until Ctrl-C; the procs
    are stopped on the way out."""
    from actors.policy import Policy
    from meshrl.envs.endpoint import PolicyServer, Router
    from meshrl.envs.rollout import ChatFormat
    from meshrl.loop.run import Run
    from meshrl.loop.state import LoopState
    from meshrl.loop.supervisor import Supervisor
    from meshrl.model.tokenizer import context_length, load_tokenizer

    start_from(cfg.model, "model.path")
    tokenizer, context = load_tokenizer(cfg.model), context_length(cfg.model)
    with Run(cfg, "serve", {"policy": cfg.placement.policy}) as run:
        policy = run.spawn(
            "policy", Policy, cfg.model, cfg.run.seed, cfg.policy, context, run.shm_prefix
        )
        sup = Supervisor(run, cfg.faults, LoopState())
        sup.on_respawn("policy")  # its weights are the saved model's: loaded again
        router = Router(
            lambda: policy.actors, policy.size, cfg.generation, sup.timeout_s, sup.recover
        )
        name = os.path.basename(os.path.normpath(cfg.model.path or "meshrl-policy"))
        server = PolicyServer(
            router,
            ChatFormat(tokenizer),
            context,
            cfg.policy.serve_port or 8000,
            model_name=name,
            sampling="request",
            record_path=f"{run.dir}/requests.jsonl",
            tool_parser=cfg.policy.tool_parser,
        )
        print(f"serving {name} at {server.access()}; requests in {run.dir}/requests.jsonl")
        run.status.extra.update(server.status_fields())
        sys.stdout.flush()
        try:
            threading.Event().wait()  # until Ctrl-C
        except KeyboardInterrupt:
            print("stopping")
        finally:
            server.close()


def main(argv: list[str]) -> int:
    return model_command(argv, USAGE, ServeConfig, serve)[0]
