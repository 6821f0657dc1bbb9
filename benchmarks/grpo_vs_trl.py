"""meshrl's GRPO against TRL's `GRPOTrainer`, on the same model, task and
settings, on this machine's CPU, in one run.

    pip install -e '.[bench]'          # TRL (make bench does it)
    python benchmarks/grpo_vs_trl.py   # 6 steps each
    python benchmarks/grpo_vs_trl.py --steps 20 --max-new-tokens 32 --aggregation token-mean

Both train the same ~34M-parameter Llama built from one config (hidden 512, 8
layers, the project's character tokenizer), from the same random init, on
reverse_digits: `--prompts` prompts x `--group` completions per step of
exactly `--max-new-tokens` tokens, learning rate `--lr`, temperature 1.

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
and the tokens per step.
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
TRL_LOSS = {
    "seq-mean-token-mean": "grpo",
    "token-mean": "dapo",
    "seq-mean-token-sum-norm": "dr_grpo",
}
"""meshrl's loss_aggregation -> TRL's loss_type of the same normalisation."""


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
            f"loss_aggregation={args.aggregation}",
            f"generation.min_new_tokens={args.max_new_tokens}",
            "trainer.recompute_old_logprobs=false",
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
        "tokens_per_step": tokens / len(timed),
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--staleness", type=int, default=0, help="meshrl max_staleness")
    parser.add_argument("--threads", type=int, default=0, help="meshrl threads per proc")
    parser.add_argument("--aggregation", choices=sorted(TRL_LOSS), default="seq-mean-token-mean")
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be >= 3 (the first step of each is not timed)")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as run_dir:
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


if __name__ == "__main__":
    sys.exit(main())
