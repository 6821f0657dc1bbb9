"""MoE routing replay (`meshrl.model.routing`): the sampler records each token's
experts, the trainer measures its own routing against them and can replay them.

A bfloat16 sampler against a float32 trainer (`policy.dtype`) sends some tokens
to other experts; with replay every recorded token runs the sampler's experts
and the log-prob gap shrinks. Measured here on the real Qwen3-MoE classes."""

import copy

import pytest
import torch

from meshrl.config import ModelConfig
from meshrl.model.generation import sample
from meshrl.model.models import batch_logprobs, load_model
from meshrl.model.packing import pack
from meshrl.model.routing import Replay, routers
from meshrl.types import Completions, TrainBatch
from tests.support.layouts import LAYOUTS, laid_out

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def sampled():
    """A float32 Qwen3-MoE (the trainer's) and its bfloat16 copy (the sampler's),
    64 completions sampled by the copy with their routes."""
    trainer_model = load_model(ModelConfig(arch="qwen3_moe"), seed=0).eval()
    sampler_model = copy.deepcopy(trainer_model).to(torch.bfloat16)
    torch.manual_seed(0)
    prompt_ids = torch.randint(5, 40, (16, 6)).repeat_interleave(4, 0)
    lengths = torch.tensor([6, 4, 5, 3]).repeat(16)  # left padding on some rows
    prompt_mask = (torch.arange(6) >= 6 - lengths[:, None]).float()
    prompt_ids = prompt_ids.masked_fill(prompt_mask == 0, 0)
    stats: dict = {}
    tokens, logprobs, mask = sample(
        sampler_model,
        prompt_ids,
        prompt_mask,
        max_new_tokens=16,
        eos_token_id=[2],
        pad_token_id=0,
        generator=torch.Generator().manual_seed(0),
        stats=stats,
        record_routes=True,
    )
    completions = Completions(
        prompt_ids, prompt_mask, tokens, mask, logprobs, 0, routes=stats["routes"]
    )
    return trainer_model, completions


def trainer_pass(model, completions, layout, replay_on):
    batch = TrainBatch.from_completions(completions)
    replay = Replay(model, replay_on)
    with torch.no_grad():
        logprobs = batch_logprobs(model, batch, 1.0, layout, replay)
    gap = (logprobs - completions.logprobs).abs() * completions.completion_mask
    return replay.take(), gap


def test_routes_cover_every_fed_token_and_nothing_else(sampled):
    model, completions = sampled
    routes = completions.routes
    B, P = completions.prompt_ids.shape
    T = completions.completion_ids.size(1)
    assert routes.shape == (B, P + T, len(routers(model)), 2) and routes.dtype == torch.int16
    known = routes[..., 0, 0] >= 0
    # Prompt tokens and every completion token but a row's last (never fed) were routed.
    fed = torch.cat([completions.prompt_mask, completions.completion_mask], 1).bool()
    last = completions.completion_mask.sum(1).long() + P - 1
    fed[torch.arange(B), last] = False
    assert torch.equal(known, fed)
    assert int(routes.max()) < 4 and bool((routes[known] >= 0).all())


def test_replay_removes_the_routing_mismatch_and_shrinks_the_gap(sampled):
    model, completions = sampled
    for name in ("padded", "tree", "kv_tree"):
        with laid_out(name) as layout:
            own, own_gap = trainer_pass(model, completions, layout, replay_on=False)
            replayed, replay_gap = trainer_pass(model, completions, layout, replay_on=True)
        # The same tokens counted both ways; the router's own choice differs on some.
        assert own["routing/tokens"] == replayed["routing/tokens"] > 0
        assert own["routing/router_mismatch"] > 0
        assert own["routing/ran_mismatch"] == own["routing/router_mismatch"]
        assert replayed["routing/router_mismatch"] == own["routing/router_mismatch"]
        assert replayed["routing/ran_mismatch"] == 0
        assert replay_gap.max() < own_gap.max()
        assert replay_gap.sum() < own_gap.sum()


def test_packed_layouts_replay_what_the_padded_one_does(sampled):
    model, completions = sampled
    _, padded = trainer_pass(model, completions, "padded", True)
    for name in LAYOUTS:
        with laid_out(name) as layout:
            _, other = trainer_pass(model, completions, layout, True)
        assert torch.allclose(other, padded, atol=1e-5), name
    # Each packed token's route is its own (b, column)'s.
    batch = TrainBatch.from_completions(completions)
    T = batch.num_completion_tokens
    packed = pack(batch.input_ids, batch.attention_mask, T)
    ids = packed.gather(batch.input_ids.unsqueeze(-1), fill=-7).view(packed.input_ids.shape)
    real = packed.source >= 0
    assert torch.equal(ids[real], packed.input_ids[real]) and bool((ids[~real] == -7).all())


def test_routes_survive_concat_and_row_splits(sampled):
    _, completions = sampled
    a, b = completions.rows(slice(0, 8)), completions.rows(slice(8, 16))
    b = Completions(
        b.prompt_ids[:, 2:],
        b.prompt_mask[:, 2:],
        b.completion_ids[:, :9],
        b.completion_mask[:, :9],
        b.logprobs[:, :9],
        0,
        routes=b.routes[:, 2 : 2 + 4 + 9],
    )
    joined = Completions.concat([a, b], pad_token_id=0)
    P, T = joined.prompt_ids.size(1), joined.completion_ids.size(1)
    assert joined.routes.shape[:2] == (16, P + T)
    assert torch.equal(joined.routes[:8], a.routes)
    # The narrower part: -1 on the left of its prompt and right of its completion.
    assert bool((joined.routes[8:, :2] == -1).all())
    assert torch.equal(joined.routes[8:, 2 : 6 + 9], b.routes)
    assert bool((joined.routes[8:, 6 + 9 :] == -1).all())
    batch = TrainBatch.from_completions(joined)
    assert torch.equal(batch.split(2)[1].routes, joined.routes[8:])
