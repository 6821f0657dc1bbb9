"""meshrl's GRPO against TRL's `GRPOTrainer`, on the same model, task and
settings, on this machine's CPU, in one run.

    pip install -e '.[bench]'          # TRL (make bench does it)
    python benchmarks/grpo_vs_trl.py   # 6 steps each
    python benchmarks/grpo_vs_trl.py --steps 20 --max-new-tokens 32 --aggregation token-mean
    python benchmarks/grpo_vs_trl.py --model 4M --prompt-tokens 256
    python benchmarks/grpo_vs_trl.py --sweep   # 4M and 34M, short and long prompts

Both train the same Llama built from one config (`--model`: 34M is hidden 512,
8 layers; 4M is hidden 256, 4 layers; the project's character tokenizer), from
the same random init, on reverse_digits: `--prompts` prompts x `--group`
completions per step of exactly `--max-new-tokens` tokens, learning rate
`--lr`, temperature 1. With `--prompt-tokens N` the prompt is chat-templated:
the model directory's tokenizer carries a chat template whose system text
makes each prompt N tokens or more (as chat-templated reasoning prompts are),
and both sides take the prompt as a user message through it.

TRL is configured as its experts would for this model on a CPU: float32, no
gradient checkpointing (TRL turns it on by default: a memory saving that costs
a second forward, pointless at 34M parameters), `loss_type` matching meshrl's
`loss_aggregation` (grpo, dapo or dr_grpo), `num_iterations=1` (so neither side
computes old log-probs in an extra pass: meshrl runs with
`trainer.recompute_old_logprobs=false`), beta 0 (no reference model).

Equal work: EOS cannot be sampled before `--max-new-tokens` on either side
(`generation.min_new_tokens`, TRL's `min_new_tokens`), so every completion is
full length and both sides train the same number of tokens. Threads: meshrl's
default placement (a policy, a trainer and an environment proc; one role
computes at a time, so each gets every core) against TRL's trainer in this
process with every core. `--staleness 1` overlaps meshrl's generation with
training instead.

The headline is the step time: `step_time_ratio` = TRL's / meshrl's (> 1: meshrl
is faster), over the timed steps (each side's first step is left out:
start-up). Prints a table, then one JSON object with both sides' step time,
tokens per second and final reward (the mean of the last two steps), the steps
and the tokens per step. `--sweep` runs the four cells (4M and 34M, each with
the task's short prompt and a 256-token one) each in its own process and ends
with one JSON object whose `step_time_ratio` is keyed 4M_short, 4M_long,
34M_short and 34M_long.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from algorithms.grpo import GRPO, GRPOConfig  # noqa: E402
from benchmarks.common import arguments  # noqa: E402
from benchmarks.pins import grpo_config  # noqa: E402
from meshrl.config import TaskConfig, load_config  # noqa: E402
from meshrl.envs import make_task  # noqa: E402
from meshrl.model.models import load_model  # noqa: E402
from meshrl.model.tokenizer import build_char_tokenizer  # noqa: E402

MODELS = {
    "34M": ["model.hidden_size=512", "model.num_layers=8", "model.num_heads=8"]
    + ["model.intermediate_size=2048"],
    "4M": ["model.hidden_size=256", "model.num_layers=4", "model.num_heads=4"]
    + ["model.intermediate_size=1024"],
}
SWEEP = {  # cell -> (model, prompt tokens, completion tokens)
    "4M_short": ("4M", 0, 16),
    "4M_long": ("4M", 256, 16),
    "34M_short": ("34M", 0, 32),
    "34M_long": ("34M", 256, 32),
}
SYSTEM = "You reverse digit strings. Read the digits, then write them back in reverse order. "


def model_dir(args, directory: str) -> str:
    """The model and tokenizer both sides load: the tiny Llama of `--model`, its
    tokenizer given a chat template whose system text is `--prompt-tokens` long."""
    cfg = load_config(GRPOConfig, None, [*MODELS[args.model], "model.max_positions=1024"]).model
    tokenizer = build_char_tokenizer()
    system = (SYSTEM * (1 + args.prompt_tokens // len(SYSTEM)))[: args.prompt_tokens]
    tokenizer.chat_template = (
        "{{ '" + system + "' }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    load_model(cfg, seed=0).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


TRL_LOSS = {
    "seq-mean-token-mean": "grpo",
    "token-mean": "dapo",
    "seq-mean-token-sum-norm": "dr_grpo",
}
"""meshrl's loss_aggregation -> TRL's loss_type of the same normalisation."""


def run_meshrl(args, run_dir: str) -> dict:
    cfg = grpo_config(
        *([f"model.path={args.model_dir}"] if args.prompt_tokens else MODELS[args.model]),
        f"steps={args.steps}",
        f"prompts_per_step={args.prompts}",
        f"group_size={args.group}",
        f"generation.max_new_tokens={args.max_new_tokens}",
        f"optim.lr={args.lr}",
        "warm_start.steps=0",
        "kl_coef=0",
        f"loss_aggregation={args.aggregation}",
        f"generation.min_new_tokens={args.max_new_tokens}",
        "trainer.recompute_old_logprobs=false",
        f"max_staleness={args.staleness}",
        f"placement.threads_per_proc={args.threads}",
        f"run.dir={run_dir}",
        "run.name=meshrl",
        "run.progress=false",
        "run.save_final=false",
    )
    history = GRPO(cfg).run()
    timed = history[1:]
    tokens = sum(r["tokens/generated"] for r in timed)
    seconds = sum(r["time/step_s"] for r in timed)
    return {
        "tokens_per_s": tokens / seconds,
        "step_s": seconds / len(timed),
        "tokens_per_step": tokens / len(timed),
        "final_reward": sum(r["reward/mean"] for r in history[-2:]) / 2,
        "params": sum(p.numel() for p in load_model(cfg.model).parameters()),
    }


def run_trl(args, run_dir: str) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer

    from meshrl.config import ModelConfig

    if args.prompt_tokens:
        model_cfg = ModelConfig(path=args.model_dir)
        tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    else:
        model_cfg = load_config(GRPOConfig, None, MODELS[args.model]).model
        tokenizer = build_char_tokenizer()
    model = load_model(model_cfg, seed=0)
    task = make_task(TaskConfig())
    prompts = task.sample(args.prompts * (args.steps + 1), random.Random(0))
    as_prompt = (lambda t: [{"role": "user", "content": t}]) if args.prompt_tokens else str
    dataset = Dataset.from_dict(
        {"prompt": [as_prompt(p.text) for p in prompts], "answer": [p.answer for p in prompts]}
    )
    tokens_per_step: list[int] = []
    rewards_per_step: list[float] = []

    def reward(prompts, completions, completion_ids, answer, **_):
        tokens_per_step.append(sum(len(ids) for ids in completion_ids))
        from meshrl.types import Prompt

        if args.prompt_tokens:  # conversations: the user message, the assistant's reply
            prompts = [p[-1]["content"] for p in prompts]
            completions = [c[-1]["content"] for c in completions]
        scores = [
            task.reward(Prompt(text=p, answer=a), c)
            for p, c, a in zip(prompts, completions, answer, strict=True)
        ]
        rewards_per_step.append(sum(scores) / len(scores))
        return scores

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []

        def on_step_begin(self, *_, **__):
            self.started = time.perf_counter()

        def on_step_end(self, *_, **__):
            self.times.append(time.perf_counter() - self.started)

    timer = StepTimes()
    trl_args = TRLConfig(
        output_dir=run_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group,
        max_completion_length=args.max_new_tokens,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        beta=0.0,
        temperature=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=0,
        dataloader_num_workers=0,
        gradient_checkpointing=False,
        loss_type=TRL_LOSS[args.aggregation],
        num_iterations=1,
        generation_kwargs={"min_new_tokens": args.max_new_tokens},
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=trl_args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.train()
    tokens = sum(tokens_per_step[1:])
    seconds = sum(timer.times[1:])
    return {
        "tokens_per_s": tokens / seconds,
        "step_s": seconds / len(timer.times[1:]),
        "tokens_per_step": tokens / len(tokens_per_step[1:]),
        "final_reward": sum(rewards_per_step[-2:]) / 2,
    }


def main() -> int:
    parser = arguments(__doc__, steps=6, prompts=8, group=8, max_new_tokens=32, lr=1e-4)
    parser.add_argument("--staleness", type=int, default=0, help="meshrl max_staleness")
    parser.add_argument("--threads", type=int, default=0, help="meshrl threads per proc")
    parser.add_argument("--aggregation", choices=sorted(TRL_LOSS), default="seq-mean-token-mean")
    parser.add_argument("--model", choices=sorted(MODELS), default="34M")
    parser.add_argument("--prompt-tokens", type=int, default=0, help="0: the task's own prompt")
    parser.add_argument("--sweep", action="store_true", help="the four cells, one process each")
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be >= 3 (the first step of each is not timed)")
    if args.sweep:
        return sweep(args)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as run_dir:
        if args.prompt_tokens:
            args.model_dir = model_dir(args, os.path.join(run_dir, "model"))
        meshrl = run_meshrl(args, run_dir)
        trl = run_trl(args, run_dir + "/trl")
    figures = {
        "meshrl_step_s": round(meshrl["step_s"], 3),
        "trl_step_s": round(trl["step_s"], 3),
        "step_time_ratio": round(trl["step_s"] / meshrl["step_s"], 2),
        "meshrl_tokens_per_s": round(meshrl["tokens_per_s"], 1),
        "trl_tokens_per_s": round(trl["tokens_per_s"], 1),
        "tokens_per_s_ratio": round(meshrl["tokens_per_s"] / trl["tokens_per_s"], 2),
        "meshrl_final_reward": round(meshrl["final_reward"], 4),
        "trl_final_reward": round(trl["final_reward"], 4),
        "meshrl_tokens_per_step": round(meshrl["tokens_per_step"], 1),
        "trl_tokens_per_step": round(trl["tokens_per_step"], 1),
        "steps": args.steps,
        "timed_steps": args.steps - 1,
        "aggregation": args.aggregation,
        "trl_loss_type": TRL_LOSS[args.aggregation],
        "model_params": meshrl["params"],
        "model": args.model,
        "prompt_tokens": args.prompt_tokens,
        "completions_per_step": args.prompts * args.group,
        "max_new_tokens": args.max_new_tokens,
        "threads": torch.get_num_threads(),
    }
    print(f"\n{'':<8}{'step s':>9}{'tokens/step':>13}{'tokens/s':>10}{'final reward':>14}")
    for side in ("meshrl", "trl"):
        print(
            f"{side:<8}{figures[f'{side}_step_s']:>9.2f}{figures[f'{side}_tokens_per_step']:>13.0f}"
            f"{figures[f'{side}_tokens_per_s']:>10.1f}{figures[f'{side}_final_reward']:>14.3f}"
        )
    print(f"step time ratio {figures['step_time_ratio']:.2f} (TRL / meshrl; > 1: meshrl faster)")
    print(json.dumps(figures))
    return 0


def sweep(args) -> int:
    """Each cell of SWEEP in its own process (a fresh TRL and torch state)."""
    cells = {}
    for cell, (model, prompt_tokens, new_tokens) in SWEEP.items():
        command = [sys.executable, os.path.abspath(__file__), "--model", model]
        command += ["--prompt-tokens", str(prompt_tokens), "--max-new-tokens", str(new_tokens)]
        command += ["--steps", str(args.steps), "--prompts", str(args.prompts)]
        command += ["--group", str(args.group), "--aggregation", args.aggregation]
        print(f"--- {cell}: {' '.join(command[1:])}", flush=True)
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            print(done.stdout[-2000:], done.stderr[-4000:])
            raise SystemExit(f"{cell} failed (exit {done.returncode})")
        cells[cell] = json.loads(done.stdout.strip().splitlines()[-1])
        print("\n".join(done.stdout.strip().splitlines()[-5:-1]), flush=True)
    print(
        json.dumps(
            {
                "step_time_ratio": {c: f["step_time_ratio"] for c, f in cells.items()},
                "meshrl_step_s": {c: f["meshrl_step_s"] for c, f in cells.items()},
                "trl_step_s": {c: f["trl_step_s"] for c, f in cells.items()},
                "final_reward": {
                    c: [f["meshrl_final_reward"], f["trl_final_reward"]] for c, f in cells.items()
                },
                "prompt_tokens": {c: SWEEP[c][1] for c in cells},
                "max_new_tokens": {c: SWEEP[c][2] for c in cells},
                "steps": args.steps,
                "completions_per_step": args.prompts * args.group,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
