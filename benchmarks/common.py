"""What several benchmarks share: their command line's start (`arguments`) and the
synthetic GRPO batch and loss the trainer benchmarks time (`grpo_batch`, `grpo_loss`)."""

from __future__ import annotations

import argparse


def arguments(doc: str, **defaults: int | float | str) -> argparse.ArgumentParser:
    """A benchmark's parser: its docstring's first paragraph as the description, then
    one option a default, in order (`max_new_tokens=32` is `--max-new-tokens`, of the
    default's type). Options with help or choices are added after, as usual."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    for name, default in defaults.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    return parser


def grpo_batch(rows: int, group: int, prompt: int, completion: int, ragged: bool = False):
    """A seeded (0) GRPO `TrainBatch`: `rows` rows, each `group` in turn sharing a
    prompt of `prompt` tokens, `completion` tokens after it; every completion token
    counts, or with `ragged` a seeded length each (a quarter of `completion` to all
    of it)."""
    import torch

    from meshrl.types import TrainBatch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 98, (rows, prompt + completion), generator=g)
    ids[:, :prompt] = ids[torch.arange(rows) // group * group, :prompt]
    mask = torch.ones(rows, completion)
    if ragged:
        lengths = torch.randint(completion // 4, completion + 1, (rows,), generator=g)
        mask = (torch.arange(completion) < lengths.unsqueeze(1)).float()
    return TrainBatch(
        input_ids=ids,
        attention_mask=torch.cat([torch.ones(rows, prompt), mask], 1),
        completion_mask=mask,
        old_logprobs=-4.6 + 0.1 * torch.randn(rows, completion, generator=g),
        advantages=torch.randn(rows, generator=g),
        ref_logprobs=-4.6 + 0.1 * torch.randn(rows, completion, generator=g),
    )


def grpo_loss():
    """GRPO's loss with a KL term (`kl_coef` 0.01)."""
    from algorithms.grpo import GRPO, GRPOConfig

    return GRPO(GRPOConfig(kl_coef=0.01)).make_loss()
