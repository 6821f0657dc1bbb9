"""The fast paths give the plain paths' numbers: packed and tree training layouts
(meshrl.model.packing) against the padded batch, and the sampler's shared prefixes
and dropped rows (meshrl.model.generation) against one row per prompt copy. The
gradients of every layout at every placement are compared in
tests/actors/test_invariance.py."""

import pytest
import torch

from meshrl.config import ModelConfig
from meshrl.model.generation import draw, row_uniforms, sample
from meshrl.model.models import completion_logprobs, completion_values, load_model, load_value_model
from meshrl.model.packing import pack
from meshrl.model.tree import DENSE_TREE_TOKENS, largest_tree, lower_right_applies, takes_kv_tree
from tests.support.layouts import LAYOUTS, laid_out

pytestmark = pytest.mark.unit

MODEL = ModelConfig()


def grouped_batch(groups=(3, 5, 2), group_size=4, T=6, seed=0, empty=()):
    """Groups sharing a prompt (lengths `groups`, left-padded), completions of
    1..T tokens (right-padded; rows in `empty`: none): [B, P + T] ids and mask."""
    g = torch.Generator().manual_seed(seed)
    P, B = max(groups), len(groups) * group_size
    ids, mask = torch.zeros(B, P + T, dtype=torch.long), torch.zeros(B, P + T)
    for b in range(B):
        p = groups[b // group_size]
        if b % group_size == 0:
            prompt = torch.randint(3, 90, (p,), generator=g)
        t = int(torch.randint(1, T + 1, (), generator=g)) if b not in empty else 0
        ids[b, P - p : P], mask[b, P - p : P] = prompt, 1
        ids[b, P : P + t], mask[b, P : P + t] = torch.randint(3, 90, (t,), generator=g), 1
    return ids, mask, T


@pytest.mark.parametrize(
    "arch, groups, T, empty",
    [
        ("llama", (3, 5, 2), 6, ()),
        ("gemma2", (12, 20, 9), 10, ()),
        ("gpt2", (3, 5, 2), 6, ()),
        ("llama", (3, 5, 2), 6, (0, 5, 6)),
    ],
    ids=[
        "llama",
        "gemma2_rows_past_its_sliding_window",
        "gpt2_absolute_positions",
        "rows_with_empty_completions",  # a rollout hook's or outside data's
    ],
)
def test_packed_and_tree_layouts_score_what_the_padded_batch_scores(arch, groups, T, empty):
    ids, mask, T = grouped_batch(groups, T=T, empty=empty)
    scored = mask[:, -T:]
    cfg = ModelConfig(arch=arch)
    model = load_model(cfg, seed=1)
    values_model = load_value_model(cfg, seed=1)
    torch.nn.init.normal_(
        values_model.value_head.weight, generator=torch.Generator().manual_seed(2)
    )
    with torch.no_grad():
        want = completion_logprobs(model, ids, mask, T, 0.7) * scored
        want_values = completion_values(values_model, ids, mask, T) * scored
        for name in LAYOUTS:
            with laid_out(name) as layout:
                got = completion_logprobs(model, ids, mask, T, 0.7, layout)
                values = completion_values(values_model, ids, mask, T, layout)
            assert torch.allclose(got, want, atol=1e-5), name
            assert torch.all(got[scored == 0] == 0)  # nothing computed on padding
            assert torch.allclose(values, want_values, atol=1e-5), name


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-sum-norm"])
def test_every_layout_gives_the_padded_gradient(aggregation):
    """GRPO's loss with a KL term, on one model in this process (the layouts at
    every placement: tests/actors/test_invariance.py)."""
    from algorithms.grpo import GRPOConfig, GRPOLoss
    from meshrl.types import TrainBatch

    ids, mask, T = grouped_batch()
    g = torch.Generator().manual_seed(1)
    batch = TrainBatch(
        input_ids=ids,
        attention_mask=mask,
        completion_mask=mask[:, -T:],
        old_logprobs=-4.6 + 0.3 * torch.randn(len(ids), T, generator=g),
        advantages=torch.randn(len(ids), generator=g),
        ref_logprobs=-4.6 + 0.3 * torch.randn(len(ids), T, generator=g),
    )
    loss_fn = GRPOLoss(GRPOConfig(loss_aggregation=aggregation, kl_coef=0.1))
    model = load_model(MODEL, seed=2)
    grads = {}
    for name in ("padded", *LAYOUTS):
        model.zero_grad()
        with laid_out(name) as layout:
            loss, _ = loss_fn(completion_logprobs(model, ids, mask, T, 1.0, layout), batch)
        loss.backward()
        grads[name] = torch.cat([p.grad.flatten() for p in model.parameters()])
    want = grads["padded"]
    for name in LAYOUTS:
        error = ((grads[name] - want).norm() / want.norm()).item()
        assert error < 1e-5, f"{name}: relative error {error:.1e}"


def test_the_tree_layout_takes_the_kv_cache_past_its_dense_limit():
    """A tree is a distinct prompt and its rows' completion tokens but the last; the
    dense mask serves trees up to DENSE_TREE_TOKENS, the KV cache larger ones (a
    512-token prompt with 8 completions of 1,024 tokens: 8,704)."""
    ids, mask, T = grouped_batch(groups=(3, 5, 2), T=6, empty=(4,))
    fed = (mask[:, -T:].sum(1) - 1).clamp(min=0)
    want = max(p + int(fed[4 * i : 4 * i + 4].sum()) for i, p in enumerate((3, 5, 2)))
    assert largest_tree(ids, mask, T) == want
    model = load_model(MODEL)
    assert not takes_kv_tree(model, ids, mask, T)
    assert takes_kv_tree(model, ids, mask, T, limit=want - 1)
    assert not takes_kv_tree(model, ids, mask, T, limit=want)
    # Llama's completions run over their prompt's cache with no mask (rows grouped by
    # prompt length); Gemma 2's sliding window needs its mask (one 2D-mask forward).
    assert lower_right_applies(model)
    assert not lower_right_applies(load_model(ModelConfig(arch="gemma2")))
    long = torch.ones(8, 512 + 1024, dtype=torch.long)
    assert largest_tree(long, torch.ones_like(long), 1024) == 512 + 8 * 1023 > DENSE_TREE_TOKENS


def test_tree_layout_computes_each_prompt_once_and_no_padding():
    ids, mask, T = grouped_batch()
    real = int(mask.sum())
    packed = pack(ids, mask, T, share=False)
    tree = pack(ids, mask, T, share=True)
    prompt_tokens = int(mask[:, :-T].sum())
    distinct_prompt_tokens = 3 + 5 + 2
    # Rows as long as the longest tree (or row), packed first-fit.
    assert tree.input_ids.numel() < packed.input_ids.numel() < ids.numel()
    tree_real = real - prompt_tokens + distinct_prompt_tokens
    assert tree.input_ids.numel() < 2 * tree_real
    # A completion sees its prompt and itself, never a sibling.
    lengths = mask[:4, -T:].sum(1)
    first, second = (lengths >= 2).nonzero().flatten()[:2].tolist()  # rows of a group
    # The position predicting column 1 holds the completion's own first token.
    at_first = tree.at[(tree.rows == first) & (tree.cols == 1)][0]
    at_second = tree.at[(tree.rows == second) & (tree.cols == 1)][0]
    r, width = at_first // tree.input_ids.size(1), tree.input_ids.size(1)
    assert r == at_second // width
    assert not tree.allowed[r, at_second % width, at_first % width]
    assert not tree.allowed[r, at_first % width, at_second % width]


def test_a_batch_with_holes_in_its_mask_is_refused_with_the_key():
    ids, mask, T = grouped_batch()
    mask[0, -T - 2] = 0  # a hole in a 3-token prompt
    with pytest.raises(ValueError) as info:
        completion_logprobs(load_model(MODEL), ids, mask, T, 1.0, "tree")
    assert "trainer.layout" in str(info.value) and "\n" not in str(info.value)


def test_draw_samples_the_given_distribution_and_never_a_zero():
    probs = torch.tensor([0.5, 0.0, 0.2, 0.3])
    n = 200_000
    seeds = torch.arange(n, dtype=torch.long) * 7919
    tokens = draw(probs.expand(n, 4), row_uniforms(seeds, step=3))
    freq = torch.bincount(tokens, minlength=4).double() / n
    assert freq[1] == 0
    assert torch.allclose(freq, probs.double(), atol=0.005)
    u = row_uniforms(seeds, 0)
    assert float(u.min()) >= 0 and float(u.max()) < 1
    assert not torch.equal(u, row_uniforms(seeds, 1))  # a fresh draw each step


def test_shared_prefixes_and_dropped_rows_sample_the_plain_paths_tokens():
    """Each row's randomness is its seed's: sharing the prompt's prefill and
    dropping finished rows give the same tokens as the plain path, and a row
    sampled alone gives the tokens it gets in the batch."""
    model = load_model(MODEL, seed=3).eval()
    ids, mask, _ = grouped_batch(groups=(4, 7, 7), seed=4)
    prompt_ids, prompt_mask = ids[:, :7], mask[:, :7]
    seeds = torch.randint(-(2**62), 2**62, (len(ids),), generator=torch.Generator().manual_seed(5))
    stops = list(range(10, 30))  # the random model ends rows at different steps
    kw = dict(max_new_tokens=12, eos_token_id=stops, pad_token_id=0, seeds=seeds, temperature=1.5)

    def run(**flags):
        return sample(model, prompt_ids, prompt_mask, **kw, **flags)

    plain = run(share_prefix=False, drop_finished=False)
    assert plain[2].sum(1).min() < plain[2].size(1)  # some rows end early: rows drop
    assert len({tuple(r) for r in plain[0].tolist()}) > 3  # a group's rows differ
    for flags in ({"drop_finished": False}, {"share_prefix": False}, {}):
        fast = run(**flags)
        assert torch.equal(fast[0], plain[0]) and torch.equal(fast[2], plain[2]), flags
        # Log-probs up to float rounding: other batch shapes, other matmul blockings.
        assert torch.allclose(fast[1], plain[1], rtol=0, atol=1e-5), flags
    alone = sample(model, prompt_ids[5:6], prompt_mask[5:6], **{**kw, "seeds": seeds[5:6]})
    width = alone[0].size(1)
    assert torch.equal(alone[0][0], plain[0][5, :width])


def test_the_tree_layouts_gradient_sums_in_one_order_every_time():
    """The tree layout gathers the logits of a prompt's last position once for
    each completion of its prompt (it predicts their first tokens), and the
    backward sums those copies' gradients. Summed by two threads at once in
    whatever order they came (indexing's backward on the CPU: index_put_ with
    accumulate, parallel past torch's grain of 32,768 elements), the same batch
    now and then gave weights apart by float rounding: benchmarks/elastic.py's
    60 steps ended 1.2e-7 from a fixed pool's (its 16 x 8 rows gather about
    40,000 logits). Here one prompt's 128 completions (44,100 gathered) put its
    row's copies on both threads all along. Each gradient must be the one summed
    in index order (torch's deterministic algorithms): before, most were not,
    whether they differed from each other or not."""
    ids, mask, T = grouped_batch(groups=(5,), group_size=128, T=6)
    weights = torch.randn(ids.shape[0], T, generator=torch.Generator().manual_seed(1))
    model = load_model(MODEL, seed=2)
    logits = []  # the head's output: the gradient to it is the gather's sum, taken alone
    model.get_output_embeddings().register_forward_hook(lambda m, a, out: logits.append(out))
    loss = (completion_logprobs(model, ids, mask, T, 1.0, "tree") * weights).sum()

    def gradient():
        return torch.autograd.grad(loss, logits[0], retain_graph=True)[0]

    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.set_num_threads(2)  # the race needs two (a trainer proc on 2 cores has them)
    try:
        torch.use_deterministic_algorithms(True)
        in_order = gradient()
        torch.use_deterministic_algorithms(False)
        differ = sum(not torch.equal(gradient(), in_order) for _ in range(20))
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    assert differ == 0, f"{differ} of 20 gradients differ from the one summed in index order"
