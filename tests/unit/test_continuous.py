"""Continuous batching (meshrl/model/continuous.py) against the batch sampler: rows
that join a running decode batch mid-decode sample the tokens they sample in a
batch of their own, and rows that go on under new weights (partial rollouts)
carry, for each token, the log-prob of the weights that sampled it."""

import time

import pytest
import torch

from meshrl.model.continuous import ContinuousEngine, Settings
from meshrl.model.generation import drilled_lengths
from meshrl.model.models import load_model
from meshrl.types import Completions, TrainBatch
from tests.support.continuous import (
    batch_of_its_own,
    by_version,
    rows_spanning_versions,
    run_engine,
)
from tests.unit.test_packing import MODEL, grouped_batch

pytestmark = pytest.mark.unit

STOPS = list(range(10, 30))  # the random model ends rows at different steps


def calls(count: int, seed: int = 5) -> list[tuple[list[list[int]], list[int], Settings]]:
    """`count` calls of two 4-row groups each, prompts of several lengths, each
    call sampled its own way (lengths, temperature, top-p, min tokens)."""
    g = torch.Generator().manual_seed(seed)
    made = []
    for r in range(count):
        ids, mask, T = grouped_batch(groups=(4 + r, 7), seed=10 + r)
        P = ids.size(1) - T
        prompts = [
            [t for t, m in zip(row[:P].tolist(), m_row[:P].tolist(), strict=True) if m]
            for row, m_row in zip(ids, mask, strict=True)
        ]
        seeds = torch.randint(-(2**62), 2**62, (len(prompts),), generator=g).tolist()
        settings = Settings(12 + 3 * r, 1.5, 1.0 if r % 2 else 0.9, r % 3)
        made.append((prompts, seeds, settings))
    return made


def test_rows_that_join_mid_decode_sample_what_they_sample_alone():
    """A 5-row batch that six calls feed (each call's rows wait, then join as rows
    end, at their own positions): every row's tokens equal those of its call
    sampled as a batch of its own, log-probs to float rounding, whatever the
    temperature, top-p and minimum length of the rows beside it."""
    model = load_model(MODEL, seed=3).eval()
    work = calls(6)
    engine = ContinuousEngine(model, 0, STOPS, max_rows=5, version=lambda: 7)
    got = run_engine(engine, work)
    for (prompts, seeds, settings), result in zip(work, got, strict=True):
        tokens, logprobs, mask = batch_of_its_own(model, prompts, seeds, settings, STOPS)
        assert torch.equal(result["tokens"], tokens) and torch.equal(result["mask"], mask)
        assert torch.allclose(result["logprobs"], logprobs, rtol=0, atol=1e-5)
        assert set(result["versions"][mask > 0].tolist()) == {7}
    assert engine.occupancy() > 0.5  # the batch stayed full while calls waited


def test_rows_of_very_different_lengths_are_prefilled_apart_and_sample_the_same(monkeypatch):
    """Rows that join at once with contexts of 3 to 24 tokens (as after a refill:
    long rows under way beside new prompts) are prefilled in buckets, none padded
    to more than twice its shortest row, and sample what they sample alone."""
    import meshrl.model.continuous as continuous

    widths = []
    prefill = continuous._prefill

    def recorded(model, ids, mask, share):
        widths.append((ids.size(1), int(mask.sum(1).min())))
        return prefill(model, ids, mask, share)

    monkeypatch.setattr(continuous, "_prefill", recorded)
    model = load_model(MODEL, seed=3).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(40, 90, (n,), generator=g).tolist() for n in (3, 24, 4, 20, 11, 6)]
    seeds = list(range(101, 107))
    settings = Settings(10, 1.5, 0.9)
    engine = ContinuousEngine(model, 0, STOPS, max_rows=8, version=lambda: 1)
    (got,) = run_engine(engine, [(prompts, seeds, settings)])
    tokens, logprobs, mask = batch_of_its_own(model, prompts, seeds, settings, STOPS)
    assert torch.equal(got["tokens"], tokens) and torch.equal(got["mask"], mask)
    assert torch.allclose(got["logprobs"], logprobs, rtol=0, atol=1e-5)
    assert len(widths) > 1 and all(width <= 2 * shortest for width, shortest in widths), widths


def test_drilled_lengths_are_every_engines_and_exact():
    """`faults.completion_lengths`: each row ends at the length its seed draws,
    no stop id before, in the batch sampler and in the running batch alike."""
    model = load_model(MODEL, seed=3).eval()
    work = calls(3)
    lengths = [drilled_lengths(seeds, (3, 0.25, s.max_new_tokens)) for _, seeds, s in work]
    assert len({n for row in lengths for n in row}) > 3
    got = run_engine(ContinuousEngine(model, 0, STOPS, 4, lambda: 0), work, lengths)
    for (prompts, seeds, settings), result, want in zip(work, got, lengths, strict=True):
        tokens, _, mask = batch_of_its_own(model, prompts, seeds, settings, STOPS, want)
        assert mask.sum(1).long().tolist() == want
        assert torch.equal(result["tokens"], tokens) and torch.equal(result["mask"], mask)
        assert not torch.isin(tokens[mask > 0], torch.tensor(STOPS)).any()


def test_rows_under_way_take_new_weights_with_each_tokens_own_log_prob():
    """Partial rollouts: the weights change three times while rows decode (between
    two steps, `paused`, then `refill`). Rows span versions, and every token's
    recorded log-prob is the one the weights of its version give it over its
    whole context (the rows are prefilled again under the new weights, not
    carried on a cache of the old ones)."""
    model = load_model(MODEL, seed=3).eval()
    versions = [load_model(MODEL, seed=s).state_dict() for s in (3, 4, 5, 6)]
    now = {"version": 0}
    # One rare stop id and no minimum: the rows run long, under the plain softmax.
    engine = ContinuousEngine(model, 0, [2], max_rows=6, version=lambda: now["version"])
    work = [(p, s, Settings(40)) for p, s, _ in calls(4)]

    def swap(i: int) -> None:
        time.sleep(0.03)  # a few decode steps first
        with engine.paused():
            model.load_state_dict(versions[i + 1])
            now["version"] = i + 1
            engine.refill()

    got = run_engine(engine, work[:3], between=swap)
    spans = 0
    for (prompts, _, _), result in zip(work, got, strict=False):
        spans += rows_spanning_versions(result)
        for mine, want in by_version(model, versions, prompts, result):
            assert torch.allclose(result["logprobs"][mine], want[mine], rtol=0, atol=1e-5)
    assert spans > 0  # rows went on under new weights


def test_each_tokens_version_travels_to_the_trainers_shards():
    """Rows of two calls, one sampled by versions 3 then 4: the batch the trainer
    gets keeps each token's version through concatenation and data-parallel shards."""

    def part(versions) -> Completions:
        versions = torch.tensor(versions)
        return Completions(
            torch.ones(2, 2, dtype=torch.long),
            torch.ones(2, 2),
            torch.ones(2, 3, dtype=torch.long),
            (versions >= 0).float(),
            torch.zeros(2, 3),
            int(versions[versions >= 0].min()),
            token_versions=versions,
        )

    both = Completions.concat([part([[3, 3, 4], [3, 4, -1]]), part([[4, 4, 4], [4, -1, -1]])], 0)
    assert both.weight_version == 3
    batch = TrainBatch.from_completions(both)
    assert batch.shard(1, 2).token_versions.tolist() == [[4, 4, 4], [4, -1, -1]]
    assert batch.shard(0, 2).token_versions.tolist() == [[3, 3, 4], [3, 4, -1]]
