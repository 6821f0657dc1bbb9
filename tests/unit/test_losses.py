"""The math in meshrl.model.losses against hand-computed values and naive loops."""

import math

import pytest
import torch

from meshrl.model.losses import (
    LossScale,
    aggregate,
    dpo_loss,
    explained_variance,
    gae,
    geometric_mask,
    group_advantages,
    icepop_weights,
    kl_estimate,
    masked_mean,
    mis_weights,
    mismatch_metrics,
    mismatch_weights,
    nll_loss,
    policy_loss,
    returns_to_go,
    rloo_advantages,
    sequence_logprobs,
    tis_weights,
    token_rewards,
    value_loss,
    whiten,
)
from meshrl.types import TrainBatch

pytestmark = pytest.mark.unit


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5])
    adv = group_advantages(rewards, group_size=2, eps=1e-4)
    # group 1: mean 0.5, unbiased std sqrt(0.5); group 2: all equal -> 0 (eps avoids 0/0)
    s = math.sqrt(0.5) + 1e-4
    assert torch.allclose(adv, torch.tensor([0.5 / s, -0.5 / s, 0.0, 0.0]))


def test_group_advantages_scales_match_naive_loop():
    torch.manual_seed(0)
    rewards = torch.rand(12)
    group = 4
    for scale in ("group", "batch", "none"):
        got = group_advantages(rewards, group, scale=scale, eps=1e-4)
        for g in range(3):
            r = rewards[g * group : (g + 1) * group].tolist()
            mean = sum(r) / group
            if scale == "group":
                std = math.sqrt(sum((x - mean) ** 2 for x in r) / (group - 1))
            elif scale == "batch":
                all_r = rewards.tolist()
                m = sum(all_r) / len(all_r)
                std = math.sqrt(sum((x - m) ** 2 for x in all_r) / (len(all_r) - 1))
            for i, x in enumerate(r):
                want = x - mean if scale == "none" else (x - mean) / (std + 1e-4)
                assert got[g * group + i].item() == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_group_advantages_rejects_ragged_groups():
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(torch.zeros(4), 3)


def test_kl_estimators_by_hand():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    d = ref - logp  # [-0.5, 1.0]
    assert torch.allclose(kl_estimate(logp, ref, "k1"), torch.tensor([[0.5, -1.0]]))
    assert torch.allclose(kl_estimate(logp, ref, "k2"), torch.tensor([[0.125, 0.5]]))
    k3 = torch.tensor([[math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]])
    assert torch.allclose(kl_estimate(logp, ref, "k3"), k3)
    assert (kl_estimate(logp, ref, "k3") >= 0).all() and d.shape == (1, 2)


def test_policy_loss_ratio_one_is_minus_mean_advantage():
    # At ratio 1 the surrogate equals -A on every counted token.
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([2.0, -1.0])
    loss, m = policy_loss(logp, logp, adv, mask, aggregation="seq-mean-token-mean")
    assert loss.item() == pytest.approx(-(2.0 + -1.0) / 2)
    loss, _ = policy_loss(logp, logp, adv, mask, aggregation="token-mean")
    assert loss.item() == pytest.approx(-(2 * 2.0 - 1.0) / 3)
    loss, _ = policy_loss(
        logp, logp, adv, mask, aggregation="seq-mean-token-sum-norm", max_tokens=4
    )
    assert loss.item() == pytest.approx(-(2 * 2.0 - 1.0) / (2 * 4))
    assert m["policy/clip_fraction"] == 0.0
    assert m["policy/approx_kl"] == pytest.approx(0.0)


def test_policy_loss_clips_by_hand():
    old = torch.log(torch.tensor([[0.5, 0.5]]))
    new = torch.log(torch.tensor([[0.75, 0.25]]))  # ratios 1.5 and 0.5
    mask = torch.ones(1, 2)
    # A > 0: token 1 clipped at 1.2, token 2 unclipped 0.5 (min) -> -(1.2 + 0.5)/2
    loss, m = policy_loss(
        new, old, torch.tensor([1.0]), mask, clip_low=0.2, aggregation="token-mean"
    )
    assert loss.item() == pytest.approx(-(1.2 + 0.5) / 2)
    assert m["policy/clip_fraction"] == pytest.approx(0.5)
    # A < 0: token 1 keeps -1.5 (min), token 2 clipped at 0.8 -> -(-1.5 - 0.8)/2
    loss, _ = policy_loss(
        new, old, torch.tensor([-1.0]), mask, clip_low=0.2, aggregation="token-mean"
    )
    assert loss.item() == pytest.approx((1.5 + 0.8) / 2)
    # clip-higher: upper bound 1.28 instead of 1.2
    loss, _ = policy_loss(
        new, old, torch.tensor([1.0]), mask, clip_low=0.2, clip_high=0.28, aggregation="token-mean"
    )
    assert loss.item() == pytest.approx(-(1.28 + 0.5) / 2)


def test_policy_loss_gradient_is_policy_gradient_at_ratio_one():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, _ = policy_loss(
        logp, logp.detach(), torch.tensor([3.0]), torch.ones(1, 2), aggregation="token-mean"
    )
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1.5, -1.5]]))


def test_sequence_level_ratio_is_shared_across_tokens():
    old = torch.zeros(1, 3)
    new = torch.tensor([[0.1, -0.1, 0.3]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    _, m = policy_loss(new, old, torch.tensor([1.0]), mask, ratio_level="sequence")
    assert m["policy/ratio_mean"] == pytest.approx(1.0)  # exp(mean(0.1, -0.1)) = 1


def test_aggregate_and_masked_mean():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    assert masked_mean(values, mask).item() == pytest.approx(2.0)
    assert masked_mean(values, mask, dim=1).tolist() == pytest.approx([2.0, 0.0])
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(values, mask, "sum")


def test_nll_loss():
    logp = torch.log(torch.tensor([[0.5, 0.25, 1.0]]))
    loss, m = nll_loss(logp, torch.tensor([[1.0, 1.0, 0.0]]))
    assert loss.item() == pytest.approx(-(math.log(0.5) + math.log(0.25)) / 2)
    assert m["loss/nll"] == pytest.approx(loss.item())


# --- RLOO, REINFORCE++, PPO, DPO ---------------------------------------------------


def test_rloo_advantages_by_hand_and_equal_rewards():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.2, 0.2])
    adv = rloo_advantages(rewards, group_size=3)
    # 1 - (0 + .5)/2, 0 - (1 + .5)/2, .5 - (1 + 0)/2; an all-equal group gets 0
    assert torch.allclose(adv, torch.tensor([0.75, -0.75, 0.0, 0.0, 0.0, 0.0]), atol=1e-6)
    with pytest.raises(ValueError, match="group_size >= 2"):
        rloo_advantages(rewards, 1)
    with pytest.raises(ValueError, match="groups of 4"):
        rloo_advantages(rewards, 4)


def test_whiten_uses_only_masked_tokens():
    values = torch.tensor([[1.0, 3.0, 100.0], [5.0, -7.0, -7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    out = whiten(values, mask)
    # masked values 1, 3, 5: mean 3, unbiased std 2
    assert torch.allclose(out, torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]), atol=1e-6)


def test_token_rewards_put_the_score_on_the_last_token_and_kl_everywhere():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    kl = torch.full((3, 3), 0.5)
    rewards = token_rewards(torch.tensor([2.0, 3.0, 9.0]), mask, kl, kl_coef=0.1)
    want = torch.tensor([[-0.05, 1.95, 0.0], [-0.05, -0.05, 2.95], [0.0, 0.0, 0.0]])
    assert torch.allclose(rewards, want)  # an empty row gets nothing


def test_returns_to_go_match_naive_loop():
    torch.manual_seed(1)
    rewards, mask = torch.randn(3, 5), torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2, [0.0] * 5])
    got = returns_to_go(rewards, mask, gamma=0.9)
    for b in range(3):
        for t in range(5):
            want = sum(
                0.9 ** (s - t) * rewards[b, s].item() * mask[b, s].item() for s in range(t, 5)
            )
            assert got[b, t].item() == pytest.approx(want * mask[b, t].item(), abs=1e-5)


def test_gae_matches_naive_loop_with_masked_tail():
    torch.manual_seed(2)
    B, T, gamma, lam = 3, 6, 0.95, 0.9
    rewards, values = torch.randn(B, T), torch.randn(B, T)
    lengths = [6, 3, 0]
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths])
    adv, ret = gae(rewards, values, mask, gamma, lam)
    for b, n in enumerate(lengths):
        running = 0.0
        for t in reversed(range(T)):
            if t >= n:
                assert adv[b, t].item() == 0 and ret[b, t].item() == 0
                continue
            next_value = values[b, t + 1].item() if t + 1 < n else 0.0  # past the end: 0
            delta = rewards[b, t].item() + gamma * next_value - values[b, t].item()
            running = delta + gamma * lam * running
            assert adv[b, t].item() == pytest.approx(running, abs=1e-5)
            assert ret[b, t].item() == pytest.approx(running + values[b, t].item(), abs=1e-5)


def test_environment_tokens_inside_a_row_are_not_steps():
    """A multi-turn row (model, reply, model, reply, model): GAE and returns-to-go
    equal those of the row with the replies cut out, scattered back."""
    torch.manual_seed(3)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]])
    rewards, values = torch.randn(1, 9), torch.randn(1, 9)
    kept = mask[0] > 0
    short = (rewards[:, kept], values[:, kept], torch.ones(1, int(kept.sum())))
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    adv_short, ret_short = gae(*short, gamma=0.9, lam=0.8)
    assert torch.allclose(adv[:, kept], adv_short) and torch.allclose(ret[:, kept], ret_short)
    assert (adv[:, ~kept] == 0).all() and (ret[:, ~kept] == 0).all()
    rtg = returns_to_go(rewards, mask, gamma=0.9)
    assert torch.allclose(rtg[:, kept], returns_to_go(short[0], short[2], gamma=0.9))
    assert (rtg[:, ~kept] == 0).all()


def test_gae_with_lambda_one_is_return_minus_value():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 0.4, 0.6]])
    mask = torch.ones(1, 3)
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert torch.allclose(ret, torch.ones(1, 3))
    assert torch.allclose(adv, torch.tensor([[0.8, 0.6, 0.4]]))


def test_value_loss_by_hand():
    values = torch.tensor([[1.0, 0.0]])
    old_values = torch.tensor([[0.5, 0.0]])
    returns = torch.tensor([[2.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0]])
    loss, metrics = value_loss(values, old_values, returns, mask, clip=0.2)
    # token 0: unclipped (1-2)^2 = 1, clipped V = 0.7 -> (0.7-2)^2 = 1.69 -> max 1.69
    # token 1: unclipped 1, clipped V = 0 -> 1 -> 1
    assert loss.item() == pytest.approx(0.5 * (1.69 + 1.0) / 2)
    assert metrics["value/clip_fraction"] == pytest.approx(0.5)
    empty, _ = value_loss(values, old_values, returns, torch.zeros(1, 2))
    assert empty.item() == 0.0


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.ones(1, 4)
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 2.5), returns, mask) == pytest.approx(0.0)
    assert math.isnan(explained_variance(returns, torch.ones(1, 4), mask))


def test_dpo_loss_by_hand():
    pc, pr = torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -1.0])
    rc, rr = torch.tensor([-2.0, -2.0]), torch.tensor([-2.0, -2.0])
    loss, metrics = dpo_loss(pc, pr, rc, rr, beta=0.5)
    # D = (pc - rc) - (pr - rr) = [1 - (-1), 0 - 1] = [2, -1]
    want = [-math.log(1 / (1 + math.exp(-0.5 * d))) for d in (2.0, -1.0)]
    assert loss.item() == pytest.approx(sum(want) / 2)
    assert metrics["rewards/accuracy"] == 0.5
    assert metrics["rewards/chosen"] == pytest.approx(0.5 * (1.0 + 0.0) / 2)
    assert metrics["rewards/rejected"] == pytest.approx(0.5 * (-1.0 + 1.0) / 2)
    assert metrics["rewards/margin"] == pytest.approx(0.5 * (2.0 - 1.0) / 2)


def test_dpo_loss_label_smoothing_and_ties():
    same = torch.zeros(3)
    loss, metrics = dpo_loss(same, same, same, same, beta=0.1, label_smoothing=0.2)
    assert loss.item() == pytest.approx(math.log(2))  # sigma(0) = 1/2 either way
    assert metrics["rewards/accuracy"] == 0.5  # ties count one half
    d = torch.tensor([4.0])
    loss, _ = dpo_loss(d, torch.zeros(1), torch.zeros(1), torch.zeros(1), 1.0, 0.1)
    want = -0.9 * math.log(1 / (1 + math.exp(-4))) - 0.1 * math.log(1 / (1 + math.exp(4)))
    assert loss.item() == pytest.approx(want, rel=1e-5)


def test_dpo_gradient_raises_chosen_and_lowers_rejected():
    pc = torch.tensor([-2.0], requires_grad=True)
    pr = torch.tensor([-2.0], requires_grad=True)
    loss, _ = dpo_loss(pc, pr, torch.tensor([-2.0]), torch.tensor([-2.0]))
    loss.backward()
    assert pc.grad.item() < 0 < pr.grad.item()


def test_sequence_logprobs_and_empty_rows():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert torch.equal(sequence_logprobs(logprobs, mask), torch.tensor([-3.0, 0.0]))
    loss, _ = policy_loss(
        logprobs, logprobs, torch.ones(2), mask, aggregation="seq-mean-token-mean"
    )
    assert loss.item() == pytest.approx(-0.5)  # the empty row counts as a 0 in the mean


# --- one loss at any placement --------------------------------------------------------


def _shard_batch():
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([1, 10, 1, 10, 3, 7])
    mask = (torch.arange(10) < lengths.unsqueeze(1)).float()
    logp = (-2 + 0.5 * torch.randn(6, 10, generator=g)).requires_grad_()
    old = -2 + 0.5 * torch.randn(6, 10, generator=g)
    adv = torch.randn(6, generator=g)
    return logp, old, adv, mask


def _placed_gradient(loss_of, logp, mask, ranks, micro, global_scale=True):
    """The gradient DDP would step with: ranks' shards rows i::ranks, each cut
    into `micro` consecutive micro-batches whose backward passes accumulate,
    then averaged over ranks. With `global_scale=False`, each shard normalizes
    by its own counts (the rule before LossScale)."""
    logp.grad = None
    scale = LossScale.of(mask, ranks) if global_scale else None
    total = torch.zeros_like(logp)
    for r in range(ranks):
        rows = torch.arange(r, mask.size(0), ranks)
        for part in rows.tensor_split(micro):
            loss = loss_of(logp[part], part, LossScale.of(mask[part]) if scale is None else scale)
            total += torch.autograd.grad(loss, logp)[0]
    return total / ranks


@pytest.mark.parametrize(
    "aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_sharded_losses_give_the_whole_batch_gradient(aggregation):
    logp, old, adv, mask = _shard_batch()

    def loss_of(lp, rows, scale):
        loss, _ = policy_loss(
            lp, old[rows], adv[rows], mask[rows], aggregation=aggregation, scale=scale
        )
        kl = scale.token_mean(kl_estimate(lp, old[rows]), mask[rows])
        return loss + 0.1 * kl

    whole = _placed_gradient(loss_of, logp, mask, 1, 1)
    for ranks, micro in ((2, 1), (3, 1), (1, 2), (2, 2)):
        got = _placed_gradient(loss_of, logp, mask, ranks, micro)
        assert ((got - whole).norm() / whole.norm()).item() < 1e-6, (ranks, micro)
    # Each shard dividing by its own counts is another objective, except for
    # sum-norm whose denominator is fixed per row.
    local = _placed_gradient(loss_of, logp, mask, 2, 1, global_scale=False)
    error = ((local - whole).norm() / whole.norm()).item()
    assert error > 1e-2 if aggregation == "token-mean" else True


def test_sharded_value_nll_and_dpo_losses_give_the_whole_batch_gradient():
    logp, old, _, mask = _shard_batch()
    returns = torch.randn_like(old)

    def value(lp, rows, scale):
        return value_loss(lp, old[rows], returns[rows], mask[rows], 0.2, scale)[0]

    def nll(lp, rows, scale):
        return nll_loss(lp, mask[rows], scale)[0]

    for loss_of in (value, nll):
        whole = _placed_gradient(loss_of, logp, mask, 1, 1)
        got = _placed_gradient(loss_of, logp, mask, 2, 2)
        assert ((got - whole).norm() / whole.norm()).item() < 1e-6
    # DPO: 3 pairs, rows [chosen; rejected]; ranks take whole pairs, 2 and 1.
    seq = sequence_logprobs(logp, mask)
    ref = seq.detach() + torch.randn(6)

    def dpo(pairs):
        loss, _ = dpo_loss(
            seq[pairs], seq[pairs + 3], ref[pairs], ref[pairs + 3], 0.5, pairs=3, ranks=2
        )
        return loss

    (whole,) = torch.autograd.grad(
        dpo_loss(seq[:3], seq[3:], ref[:3], ref[3:], 0.5)[0], logp, retain_graph=True
    )
    halves = [
        torch.autograd.grad(dpo(p), logp, retain_graph=True)[0]
        for p in (torch.tensor([0, 2]), torch.tensor([1]))
    ]
    assert torch.allclose(sum(halves) / 2, whole, atol=1e-7)


def test_approx_kl_is_k3_of_kl_old_to_new():
    # r = new / old per token; k3 = (r - 1) - log r, whose mean under old samples
    # estimates KL(old || new).
    old = torch.tensor([[-1.0, -2.0]])
    new = torch.tensor([[-1.5, -1.0]])
    mask = torch.ones(1, 2)
    _, m = policy_loss(new, old, torch.zeros(1), mask)
    r = [math.exp(-0.5), math.exp(1.0)]
    want = sum((x - 1) - math.log(x) for x in r) / 2
    assert m["policy/approx_kl"] == pytest.approx(want, rel=1e-6)
    # On a categorical with old sampled exactly, the k3 mean is the exact KL.
    p_old = torch.tensor([0.5, 0.3, 0.2])
    p_new = torch.tensor([0.2, 0.3, 0.5])
    exact = (p_old * (p_old / p_new).log()).sum().item()
    log_ratio = (p_new / p_old).log()
    k3 = (p_old * (torch.expm1(log_ratio) - log_ratio)).sum().item()
    assert k3 == pytest.approx(exact, rel=1e-6)


# --- train-inference mismatch ---------------------------------------------------------


def _ratios(*values):
    return torch.tensor([values]).log()


def test_tis_truncates_each_token_ratio():
    w = tis_weights(_ratios(0.5, 1.5, 3.0), torch.tensor([[1.0, 1.0, 0.0]]), high=2.0)
    assert torch.allclose(w, torch.tensor([[0.5, 1.5, 0.0]]))
    w = tis_weights(_ratios(0.5, 1.5, 3.0), torch.ones(1, 3), high=2.0)
    assert torch.allclose(w, torch.tensor([[0.5, 1.5, 2.0]]))


def test_mis_masks_tokens_or_whole_sequences_above_the_threshold():
    mask = torch.ones(2, 2)
    log_ratio = torch.tensor([[math.log(0.5), math.log(3.0)], [math.log(1.2), math.log(1.5)]])
    token = mis_weights(log_ratio, mask, high=2.0, level="token")
    assert torch.allclose(token, torch.tensor([[0.5, 0.0], [1.2, 1.5]]))
    # Sequence ratios: 0.5 * 3 = 1.5 (kept, on every token), 1.2 * 1.5 = 1.8 (kept).
    seq = mis_weights(log_ratio, mask, high=2.0, level="sequence")
    assert torch.allclose(seq, torch.tensor([[1.5, 1.5], [1.8, 1.8]]))
    seq = mis_weights(log_ratio, mask, high=1.6, level="sequence")
    assert torch.allclose(seq, torch.tensor([[1.5, 1.5], [0.0, 0.0]]))


def test_icepop_keeps_the_ratio_inside_the_band_and_masks_outside():
    w = icepop_weights(_ratios(0.4, 0.5, 1.0, 2.0, 2.5), torch.ones(1, 5), low=0.5, high=2.0)
    assert torch.allclose(w, torch.tensor([[0.0, 0.5, 1.0, 2.0, 0.0]]))


def test_geometric_mask_uses_the_length_normalized_sequence_ratio():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    # Row 0: geometric mean sqrt(4 * 4) = 4 -> masked; row 1: (4 * 0.25 * 1)^(1/3) = 1 -> kept,
    # though one token's ratio is 4.
    log_ratio = torch.tensor([[4.0, 4.0, 9.0], [4.0, 0.25, 1.0]]).log()
    w = geometric_mask(log_ratio, mask, low=0.5, high=2.0)
    assert torch.equal(w, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]))


def test_mismatch_metrics_by_hand():
    sampler = torch.tensor([[0.0, 0.0, 0.0]])
    old = torch.tensor([[math.log(0.5), math.log(2.0), 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    weights = mismatch_weights(old, sampler, mask, "tis", high=1.5)
    m = mismatch_metrics(old, sampler, mask, weights)
    rho = [0.5, 2.0]
    assert m["sampling/k3_kl"] == pytest.approx(sum(r - 1 - math.log(r) for r in rho) / 2)
    assert m["sampling/chi2"] == pytest.approx((0.25 + 4) / 2 - 1)
    assert m["sampling/ess"] == pytest.approx(1.25**2 / 2.125)
    assert m["sampling/truncated_fraction"] == pytest.approx(0.5)  # the 2.0 became 1.5
    assert m["sampling/masked_fraction"] == 0.0
    assert mismatch_weights(old, sampler, mask, "none") is None
    with pytest.raises(ValueError, match="correction 'bogus'"):
        mismatch_weights(old, sampler, mask, "bogus")


def test_mismatch_metrics_by_lag_by_hand():
    """Partial rollouts: each token's lag (publishes behind the trainer) splits the
    mismatch, so the trainer's own version (lag 0, numerics only) is told apart
    from the drift of older ones; a lag with no token logs nothing."""
    from meshrl.loop.dispatch import token_lags

    sampler = torch.zeros(2, 3)
    old = torch.tensor([[0.0, math.log(2.0), 9.0], [math.log(0.5), math.log(1.05), 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    # Versions 7, 8, 9 were publishes 3, 4, 5; the trainer is at publish 5.
    versions = torch.tensor([[9, 8, -1], [7, 9, 8]])
    lags = token_lags(versions, 5, {7: 3, 8: 4, 9: 5})
    assert lags.tolist() == [[0, 1, -1], [2, 0, 1]]
    m = mismatch_metrics(old, sampler, mask, lags=lags)
    k3 = [r - 1 - math.log(r) for r in (1.0, 1.05)]  # lag 0: rho 1 and 1.05
    assert m["sampling/k3_kl_lag0"] == pytest.approx(sum(k3) / 2)
    assert m["sampling/ratio_off_band_lag0"] == 0.0
    assert m["sampling/k3_kl_lag1"] == pytest.approx((2 - 1 - math.log(2)) / 2)  # rho 2, 1
    assert m["sampling/ratio_off_band_lag1"] == 0.5
    assert m["sampling/k3_kl_lag2plus"] == pytest.approx(0.5 - 1 - math.log(0.5))
    assert m["sampling/ratio_off_band_lag2plus"] == 1.0
    assert not any("lag" in k for k in mismatch_metrics(old, sampler, mask))
    assert "sampling/k3_kl_lag2plus" not in mismatch_metrics(
        old, sampler, mask, lags=lags.clamp(max=1)
    )


@pytest.mark.parametrize("kind", ["tis", "mis-token", "mis-sequence", "icepop", "geo-mask"])
def test_corrections_bring_a_perturbed_samplers_gradient_back_on_policy(kind):
    """A one-token policy over 6 actions, softmax(theta), whose on-policy
    surrogate gradient is exact: -sum_y pi(y) A(y) grad log pi(y). 200k draws
    come from a perturbed sampler: the policy's logits plus noise (the
    importance-sampling corrections), or for geo-mask, which rejects rather than
    reweighs, a sampler exact on 80% of the rows and badly broken (noise 3) on
    the rest. Corrected, the gradient is closer to the exact one than
    uncorrected, and its cosine to it is >= 0.99."""
    g = torch.Generator().manual_seed(0)
    theta = torch.tensor([1.0, 0.5, 0.0, -0.5, 0.3, -1.0], requires_grad=True)
    reward = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.9, 0.1])
    pi = torch.softmax(theta, 0)
    advantage = reward - (pi.detach() * reward).sum()
    policy = -(pi.detach() * advantage * torch.log_softmax(theta, 0)).sum()
    (exact,) = torch.autograd.grad(policy, theta)

    n = 200_000
    noise = 3.0 if kind == "geo-mask" else 0.3
    q = torch.softmax(theta.detach() + noise * torch.randn(6, generator=g), 0)
    broken = torch.rand(n, generator=g) < (0.2 if kind == "geo-mask" else 1.0)
    y = torch.where(
        broken,
        torch.multinomial(q, n, replacement=True, generator=g),
        torch.multinomial(pi.detach(), n, replacement=True, generator=g),
    )
    logp = torch.log_softmax(theta, 0)[y].unsqueeze(1)  # [n, 1]: one token per sequence
    sampler = torch.where(broken, torch.log(q)[y], logp.detach().squeeze(1)).unsqueeze(1)
    mask = torch.ones(n, 1)
    weights = mismatch_weights(logp.detach(), sampler, mask, kind, low=0.5, high=2.0)

    def gradient(w):
        loss, _ = policy_loss(logp, logp.detach(), advantage[y], mask, weights=w)
        return torch.autograd.grad(loss, theta, retain_graph=True)[0]

    cosine = torch.nn.functional.cosine_similarity
    uncorrected = cosine(gradient(None), exact, dim=0).item()
    corrected = cosine(gradient(weights), exact, dim=0).item()
    assert corrected > uncorrected, (corrected, uncorrected)
    assert corrected >= 0.99, (corrected, uncorrected)


def test_pass_at_k_is_chen_et_al_unbiased_estimator():
    from meshrl.loop.evaluation import pass_at_k

    assert pass_at_k(5, 0, 1) == 0.0 and pass_at_k(5, 5, 3) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the pass rate
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(5, 3, 3) == 1.0  # n - c < k: every draw of 3 holds a pass
    assert pass_at_k(1, 1, 1) == 1.0
    for bad in ((3, 4, 1), (3, 1, 0), (3, 1, 4), (3, -1, 1)):
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(*bad)


def test_the_procs_of_a_tensor_parallel_group_take_the_same_rows():
    """`TrainBatch.shards`: on 4 procs in groups of 2, procs 0-1 and 2-3 take the
    same rows, the two data-parallel shards cover the batch once, and the loss
    scale counts 2 ranks (the data-parallel ones, whose gradients are averaged)."""
    _, old, adv, mask = _shard_batch()
    batch = TrainBatch(
        input_ids=torch.arange(60).reshape(6, 10),
        attention_mask=torch.ones(6, 10),
        completion_mask=mask,
        old_logprobs=old,
        advantages=adv,
    )
    shards = batch.shards(4, tp=2)
    assert [len(s) for s in shards] == [3, 3, 3, 3]
    assert torch.equal(shards[0].input_ids, shards[1].input_ids)
    assert torch.equal(shards[2].input_ids, shards[3].input_ids)
    assert torch.equal(torch.cat([shards[0].input_ids, shards[2].input_ids]), batch.input_ids)
    assert {s.scale.ranks for s in shards} == {2}
    assert [s.scale.ranks for s in batch.shards(2, tp=2)] == [1, 1]  # tp alone: one rank
