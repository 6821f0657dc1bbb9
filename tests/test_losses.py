"""The math in meshrl.losses against hand-computed values and naive loops."""

import math

import pytest
import torch

from meshrl.losses import (
    aggregate,
    group_advantages,
    kl_estimate,
    masked_mean,
    nll_loss,
    policy_loss,
)

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
