"""Driving the running batch (`meshrl.model.continuous`) and what it is checked
against: the unit tests' and benchmarks/gpu_check.py's shared helpers."""

import threading

import torch

from meshrl.model.continuous import Settings
from meshrl.model.generation import sample
from meshrl.model.models import completion_logprobs


def left_padded_rows(prompts: list[list[int]], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts left-padded with 0: ids and mask [B, P]."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


def batch_of_its_own(model, prompts, seeds, s: Settings, stops, lengths=None, device=None):
    """What the batch sampler draws for one call's rows alone: tokens, log-probs, mask."""
    ids, mask = left_padded_rows(prompts, device)
    return sample(
        model,
        ids,
        mask,
        max_new_tokens=s.max_new_tokens,
        eos_token_id=stops,
        pad_token_id=0,
        seeds=torch.tensor(seeds),
        temperature=s.temperature,
        top_p=s.top_p,
        min_new_tokens=s.min_new_tokens,
        lengths=None if lengths is None else torch.tensor(lengths),
    )


def run_engine(engine, work, lengths=None, between=None) -> list[dict]:
    """Submit every call (a little apart, so that they join a batch under way) and
    wait for all; `between(i)` runs after call i is submitted."""
    results: dict[int, dict] = {}
    finished = threading.Event()

    def done(i):
        def put(result):
            results[i] = result
            if len(results) == len(work):
                finished.set()

        return put

    for i, (prompts, seeds, settings) in enumerate(work):
        engine.submit(prompts, seeds, settings, done(i), None if lengths is None else lengths[i])
        if between is not None:
            between(i)
    answered = finished.wait(120)
    engine.close()
    assert answered, "the running batch did not answer every call"
    for result in results.values():
        if isinstance(result, BaseException):
            raise result
    return [results[i] for i in range(len(work))]


def by_version(model, versions, prompts, result, device=None):
    """For each weight version that sampled tokens of one call's `result` (partial
    rollouts): the mask of its tokens and the log-probs [B, T] that version's
    weights (`versions[version]`, loaded into `model`) give every token over its
    whole context, on the CPU."""
    mask, T = result["mask"], result["tokens"].size(1)
    ids, _ = left_padded_rows(prompts)
    full = torch.cat([ids, result["tokens"]], 1).to(device)
    attention = torch.cat([ids != 0, mask > 0], 1).float().to(device)
    for version in set(result["versions"][mask > 0].tolist()):
        model.load_state_dict(versions[version])
        with torch.no_grad():
            want = completion_logprobs(model, full, attention, T).cpu()
        yield (result["versions"] == version) & (mask > 0), want


def rows_spanning_versions(result) -> int:
    """How many of a call's rows hold tokens of more than one weight version."""
    rows = zip(result["versions"], result["mask"], strict=True)
    return sum(len(set(v[m > 0].tolist())) > 1 for v, m in rows)
