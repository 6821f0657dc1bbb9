"""meshrl's GRPO against TRL's `GRPOTrainer`, on the same model, task and
settings, on this machine's CPU, in one run.

    pip install -e '.[bench]'          # TRL (make bench does it)
    python benchmarks/grpo_vs_trl.py   # 6 steps each
    python benchmarks/grpo_vs_trl.py --steps 20 --max-new-tokens 32

Both train the same ~34M-parameter Llama built from one config (hidden 512, 8
layers, the project's character tokenizer), from the same random init, on
reverse_digits: `--prompts` prompts x `--group` completions per step of up to
`--max-new-tokens` tokens, learning rate `--lr`, no KL term, temperature 1.
meshrl runs its default placement (a policy, a trainer and an environment
proc, one role computing at a time, so each proc gets every core); TRL runs its
trainer in this process (generation and training in turn). `--staleness 1`
overlaps meshrl's generation with training instead (the cores then split
between them: slower on 2 cores, measured 0.86x of the synchronous loop).

Completion tokens per second count every generated token (EOS included) over
the timed steps; each side's first step is left out (start-up). Prints a
table, then one JSON object: meshrl_tokens_per_s, trl_tokens_per_s,
tokens_per_s_ratio, meshrl_final_reward, trl_final_reward (mean reward of the
last two steps).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from algorithms.grpo import GRPO, GRPOConfig  # noqa: E402
from meshrl.config import TaskConfig, load_config  # noqa: E402
from meshrl.envs import make_task  # noqa: E402
from meshrl.models import build_char_tokenizer, load_model  # noqa: E402

MODEL = ["model.hidden_size=512", "model.num_layers=8", "model.num_heads=8"]
MODEL += ["model.intermediate_size=2048"]


def run_meshrl(args, run_dir: str) -> dict:
    cfg = load_config(
        GRPOConfig,
        os.path.join(REPO, "algorithms", "configs", "grpo_default.yaml"),
        [
            *MODEL,
            f"steps={args.steps}",
            f"prompts_per_step={args.prompts}",
            f"group_size={args.group}",
            f"generation.max_new_tokens={args.max_new_tokens}",
            f"optim.lr={args.lr}",
            "warm_start.steps=0",
            "kl_coef=0",
            f"max_staleness={args.staleness}",
            f"placement.threads_per_proc={args.threads}",
            f"run.dir={run_dir}",
            "run.name=meshrl",
            "run.progress=false",
            "run.save_final=false",
        ],
    )
    history = GRPO(cfg).run()
    timed = history[1:]
    tokens = sum(r["tokens/generated"] for r in timed)
    seconds = sum(r["time/step_s"] for r in timed)
    return {
        "tokens_per_s": tokens / seconds,
        "step_s": seconds / len(timed),
        "final_reward": sum(r["reward/mean"] for r in history[-2:]) / 2,
        "params": sum(p.numel() for p in load_model(cfg.model).parameters()),
    }


def run_trl(args, run_dir: str) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer

    from meshrl.config import ModelConfig

    tokenizer = build_char_tokenizer()
    model_cfg = load_config(GRPOConfig, None, MODEL).model
    assert isinstance(model_cfg, ModelConfig)
    model = load_model(model_cfg, seed=0)
    task = make_task(TaskConfig())
    prompts = task.sample(args.prompts * (args.steps + 1), random.Random(0))
    dataset = Dataset.from_dict(
        {"prompt": [p.text for p in prompts], "answer": [p.answer for p in prompts]}
    )
    tokens_per_step: list[int] = []
    rewards_per_step: list[float] = []

    def reward(prompts, completions, completion_ids, answer, **_):
        tokens_per_step.append(sum(len(ids) for ids in completion_ids))
        from meshrl.types import Prompt

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
        "final_reward": sum(rewards_per_step[-2:]) / 2,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--staleness", type=int, default=0, help="meshrl max_staleness")
    parser.add_argument("--threads", type=int, default=0, help="meshrl threads per proc")
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be >= 3 (the first step of each is not timed)")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as run_dir:
        meshrl = run_meshrl(args, run_dir)
        trl = run_trl(args, run_dir + "/trl")
    figures = {
        "meshrl_tokens_per_s": round(meshrl["tokens_per_s"], 1),
        "trl_tokens_per_s": round(trl["tokens_per_s"], 1),
        "tokens_per_s_ratio": round(meshrl["tokens_per_s"] / trl["tokens_per_s"], 2),
        "meshrl_final_reward": round(meshrl["final_reward"], 4),
        "trl_final_reward": round(trl["final_reward"], 4),
        "meshrl_step_s": round(meshrl["step_s"], 3),
        "trl_step_s": round(trl["step_s"], 3),
        "model_params": meshrl["params"],
        "steps": args.steps,
        "completions_per_step": args.prompts * args.group,
        "max_new_tokens": args.max_new_tokens,
    }
    print(f"\n{'':<8}{'tokens/s':>10}{'step s':>9}{'final reward':>14}")
    for side in ("meshrl", "trl"):
        print(
            f"{side:<8}{figures[f'{side}_tokens_per_s']:>10.1f}{figures[f'{side}_step_s']:>9.2f}"
            f"{figures[f'{side}_final_reward']:>14.3f}"
        )
    print(f"ratio   {figures['tokens_per_s_ratio']:>10.2f}  (meshrl / TRL)")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
