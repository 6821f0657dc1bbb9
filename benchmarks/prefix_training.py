"""The trainer's step time with each prompt forwarded once per group (tree),
without padding (packed), and as the rectangular batch (padded), in one run.

    python benchmarks/prefix_training.py
    python benchmarks/prefix_training.py --prompt 256 --completion 32 --hidden 512 --layers 8

Three real `Trainer` actors (one per `trainer.layout`) on one trainer proc,
each given the same GRPO batch: `--prompts` prompts of `--prompt` tokens, G =
`--group` completions of each, `--completion` tokens long, GRPO's loss with a
KL term. Each `train_step` (forward, backward, AdamW step) is timed at the
caller; the first is left out (warm-up) and the rest averaged. The three
trainers start from the same weights; their first steps' gradient norms are
printed as a check that they computed the same step.

Prints a table, then one JSON object: each layout's step seconds and
`speedup_tree` (padded / tree), `speedup_packed` (padded / packed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from actors.trainer import Trainer  # noqa: E402
from algorithms.base import HookLoss  # noqa: E402
from algorithms.grpo import GRPO, GRPOConfig  # noqa: E402
from meshrl.config import ModelConfig, OptimConfig  # noqa: E402
from meshrl.model.models import load_model  # noqa: E402
from meshrl.procs.mesh import RoleMeshes, wait  # noqa: E402
from meshrl.types import TrainBatch  # noqa: E402

LAYOUTS = ("padded", "packed", "tree")


def grpo_batch(prompts: int, group: int, prompt: int, completion: int) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    B, T = prompts * group, completion
    ids = torch.randint(3, 98, (B, prompt + T), generator=g)
    ids[:, :prompt] = ids[torch.arange(B) // group * group, :prompt]  # groups share a prompt
    return TrainBatch(
        input_ids=ids,
        attention_mask=torch.ones(B, prompt + T),
        completion_mask=torch.ones(B, T),
        old_logprobs=-4.6 + 0.1 * torch.randn(B, T, generator=g),
        advantages=torch.randn(B, generator=g),
        ref_logprobs=-4.6 + 0.1 * torch.randn(B, T, generator=g),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--completion", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    model = ModelConfig.sized(args.hidden, args.layers, args.prompt + args.completion)
    loss = HookLoss(GRPO(GRPOConfig(kl_coef=0.01)))
    batch = grpo_batch(args.prompts, args.group, args.prompt, args.completion)
    figures: dict = {}
    # One layout trains at a time: the proc may use every core.
    with RoleMeshes({"trainer": 1}, threads_per_proc=os.cpu_count()) as meshes:
        print(f"{'layout':<8}{'step s':>9}{'grad norm (step 1)':>20}")
        for layout in LAYOUTS:
            trainer = meshes.spawn(
                "trainer", layout, Trainer, model, OptimConfig(lr=1e-5), loss, 100, layout=layout
            )
            times, norms = [], []
            for _ in range(args.steps):
                started = time.perf_counter()
                metrics = wait(trainer.train_step.call_one(batch), "train_step", 600)
                times.append(time.perf_counter() - started)
                norms.append(metrics["train/grad_norm"])
            figures[f"{layout}_step_s"] = round(sum(times[1:]) / len(times[1:]), 3)
            figures[f"{layout}_grad_norm"] = round(norms[0], 6)
            print(f"{layout:<8}{figures[f'{layout}_step_s']:>9.3f}{norms[0]:>20.6f}")
    figures["speedup_tree"] = round(figures["padded_step_s"] / figures["tree_step_s"], 2)
    figures["speedup_packed"] = round(figures["padded_step_s"] / figures["packed_step_s"], 2)
    figures.update(
        prompts=args.prompts,
        group=args.group,
        prompt_tokens=args.prompt,
        completion_tokens=args.completion,
        timed_steps=args.steps - 1,
        params=sum(p.numel() for p in load_model(model).parameters()),
    )
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
