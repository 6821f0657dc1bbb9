"""The sampler with and without shared prompt prefixes and dropped rows, at
G = 8 and 16 completions per prompt, in one run.

    python benchmarks/generation.py
    python benchmarks/generation.py --prompt 256 --max-new-tokens 64 --hidden 512 --layers 8

`meshrl.model.generation.sample` on one model in this process (the policy replica's
engine, without the actor around it), four ways over the same prompts and
per-row seeds: `plain` (every row prefills its prompt and decodes until the
longest row ends), `share` (each distinct prompt prefilled once), `drop`
(finished rows leave the decode batch) and `both` (what `policy.engine=hf`
does). The tokens are the same four ways (checked here); the time is not.

The model is the embedded Llama at random init, so completions end when a stop
id is drawn: `--stops` ids of the 98 make a completion's length geometric
(mean about 98 / stops tokens, capped at --max-new-tokens), the spread of
lengths that row dropping pays for. Each figure is the best of `--repeats`.
Prints a table, then one JSON object: tokens/s for each way and G, and
`speedup` (both / plain) per G.
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

from meshrl.config import ModelConfig  # noqa: E402
from meshrl.model.generation import sample  # noqa: E402
from meshrl.model.models import load_model  # noqa: E402

WAYS = {
    "plain": (False, False),
    "share": (True, False),
    "drop": (False, True),
    "both": (True, True),
}


def batch(prompts: int, group: int, length: int, seed: int):
    """`prompts` distinct prompts of `length` tokens (a few shorter: left
    padding), each repeated `group` times, and one seed per row."""
    g = torch.Generator().manual_seed(seed)
    B = prompts * group
    ids, mask = torch.zeros(B, length, dtype=torch.long), torch.zeros(B, length)
    for i in range(prompts):
        n = length - i % 3
        prompt = torch.randint(3, 98, (n,), generator=g)
        ids[i * group : (i + 1) * group, length - n :] = prompt
        mask[i * group : (i + 1) * group, length - n :] = 1
    return ids, mask, torch.randint(-(2**62), 2**62, (B,), generator=g)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--groups", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--stops", type=int, default=3, help="stop ids (length spread)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cfg = ModelConfig.sized(args.hidden, args.layers, args.prompt + args.max_new_tokens)
    model = load_model(cfg, seed=0).eval()
    stops = list(range(40, 40 + args.stops))
    figures: dict = {"params": sum(p.numel() for p in model.parameters())}
    print(f"{'G':>3} {'way':<6}{'tokens':>8}{'seconds':>9}{'tokens/s':>10}")
    for group in args.groups:
        ids, mask, seeds = batch(args.prompts, group, args.prompt, seed=group)
        reference = None
        for way, (share, drop) in WAYS.items():
            best = float("inf")
            for _ in range(args.repeats):
                started = time.perf_counter()
                out = sample(
                    model,
                    ids,
                    mask,
                    max_new_tokens=args.max_new_tokens,
                    eos_token_id=stops,
                    pad_token_id=0,
                    seeds=seeds,
                    share_prefix=share,
                    drop_finished=drop,
                )
                best = min(best, time.perf_counter() - started)
            reference = reference if reference is not None else out[0]
            assert torch.equal(out[0], reference), f"{way} sampled other tokens"
            tokens = int(out[2].sum())
            figures[f"G{group}_{way}_tokens_per_s"] = round(tokens / best, 1)
            print(f"{group:>3} {way:<6}{tokens:>8}{best:>9.3f}{tokens / best:>10.1f}")
        figures[f"G{group}_mean_completion"] = round(tokens / len(ids), 1)
        figures[f"G{group}_speedup"] = round(
            figures[f"G{group}_both_tokens_per_s"] / figures[f"G{group}_plain_tokens_per_s"], 2
        )
    figures.update(
        prompts=args.prompts,
        prompt_tokens=args.prompt,
        max_new_tokens=args.max_new_tokens,
        threads=torch.get_num_threads(),
        tokens_equal=True,
    )
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
