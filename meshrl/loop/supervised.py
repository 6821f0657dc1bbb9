"""Supervised steps on the trainer mesh: batches of prompt + target tokens, and
the warm-start that teaches a task's answer format before RL."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from meshrl.model.vision import ImageError, stack
from meshrl.types import TrainBatch


def supervised_batch(
    prompt_ids: list[list[int]],
    targets: list[list[int]],
    pad_id: int,
    target_masks: list[list[int]] | None = None,
) -> TrainBatch:
    """Prompt + target token ids -> a TrainBatch whose completion is the target.
    `target_masks`: which target tokens the loss counts (all when None; a
    conversation's user turns between assistant turns are 0)."""
    P, T = max(map(len, prompt_ids)), max(map(len, targets))
    ids, mask, completion_mask = [], [], []  # rows as lists, each tensor made once
    for row, (prompt, target) in enumerate(zip(prompt_ids, targets, strict=True)):
        left, right = P - len(prompt), T - len(target)
        ids.append([pad_id] * left + list(prompt) + list(target) + [pad_id] * right)
        mask.append([0.0] * left + [1.0] * (len(prompt) + len(target)) + [0.0] * right)
        counted = target_masks[row] if target_masks is not None else [1] * len(target)
        completion_mask.append([float(c) for c in counted] + [0.0] * right)
    completion = torch.tensor(completion_mask)
    return TrainBatch(
        torch.tensor(ids), torch.tensor(mask), completion, torch.zeros_like(completion)
    )


def supervised_steps(
    sup: Any,
    trainer: Any,
    batches: Callable[[int], TrainBatch],
    steps: int,
    lr: float,
    log_path: str,
    what: str,
) -> list[float]:
    """`steps` supervised steps (`trainer.warm_start_step`, its own AdamW at `lr`)
    on `batches(step)`, each logged to `log_path`; returns the NLL of each."""
    losses = []
    with open(log_path, "w") as log:
        for step in range(steps):
            metrics = sup.call_sharded(trainer, "warm_start_step", batches(step), lr)
            log.write(json.dumps({"step": step, **metrics}) + "\n")
            losses.append(metrics["loss/nll"])
    if losses:
        print(f"{what}: {steps} supervised steps, nll {losses[0]:.3f} -> {losses[-1]:.3f}")
    return losses


def demonstrations(collector: Any, batch_size: int) -> TrainBatch:
    """A batch of the task's demonstrations: prompts drawn as for RL (through
    the chat template when there is one), each with the task's demonstration as
    the target. A multi-turn demonstration (a list of model turns) is played
    through a fresh episode of the task: each turn ends with EOS and is
    followed by the episode's reply, tokenized as a rollout would and left out
    of the loss."""
    tokenizer, fmt, task = collector.tokenizer, collector.format, collector.task
    prompts = collector.sample_prompts(batch_size)
    targets: list = [None] * len(prompts)
    masks: list = [None] * len(prompts)
    single: list[tuple[int, str]] = []  # one-turn demonstrations: tokenized together below
    for i, prompt in enumerate(prompts):
        turns = _turns(task, prompt)
        if len(turns) == 1:
            single.append((i, turns[0]))
        else:
            targets[i], masks[i] = demonstration_tokens(task, fmt, prompt, turns)
    if single:  # one batch call: a call per text costs 6x as much (the tokenizer's Python)
        rows = tokenizer([text for _, text in single], add_special_tokens=False).input_ids
        for (i, _), row in zip(single, rows, strict=True):
            targets[i] = [*row, tokenizer.eos_token_id]
            masks[i] = [1] * len(targets[i])
    ids, pixels = collector.encode(prompts)
    batch = supervised_batch(ids, targets, tokenizer.pad_token_id, masks)
    batch.images, batch.image_counts = stack(pixels)
    return batch


def _turns(task: Any, prompt: Any) -> list[str]:
    turns = task.demonstration(prompt)
    return [turns] if isinstance(turns, str) else list(turns)


def demonstration_tokens(
    task: Any, fmt: Any, prompt: Any, turns: list[str] | None = None
) -> tuple[list[int], list[int]]:
    """The token ids of `prompt`'s demonstration (`turns`: the task's, drawn
    here when not given) and their loss mask (1 on the model's turns, 0 on the
    environment's replies)."""
    tokenizer = fmt.tokenizer
    if turns is None:
        turns = _turns(task, prompt)
    episode = task.episode(prompt) if len(turns) > 1 else None
    target: list[int] = []
    mask: list[int] = []
    for i, turn in enumerate(turns):
        ids = tokenizer(turn, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        target += ids
        mask += [1] * len(ids)
        if episode is None or i == len(turns) - 1:
            break
        step = episode.step(turn)
        if step.done:
            raise ValueError(
                f"{type(task).__name__}.demonstration: the episode ended after turn {i + 1} "
                f"of {len(turns)} ({turn!r})"
            )
        if step.images:
            raise ImageError(
                f"{type(task).__name__}.demonstration: replies with images "
                "are not supported in supervised batches yet"
            )
        reply = fmt.reply(step.observation, ids)
        target += reply
        mask += [0] * len(reply)
    return target, mask
