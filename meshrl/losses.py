"""Pure tensor math for RL post-training: advantages, KL estimators, losses.

Shapes: B sequences, T completion tokens. `mask` [B, T] is 1 on completion
tokens that count, 0 elsewhere. Losses return `(loss, metrics)` where metrics
are plain floats for logging.
"""

from __future__ import annotations

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` where mask is 1 (over all elements, or along `dim`)."""
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-4
) -> torch.Tensor:
    """GRPO advantages (Shao et al. 2024, DeepSeekMath, eq. 3).

    rewards [B] come as consecutive groups of `group_size` completions of one
    prompt. A = (r - group mean) / (std + eps), with the unbiased std of the group
    (`scale="group"`) or of the whole batch (`"batch"`); `"none"` gives
    A = r - group mean (Dr. GRPO, Liu et al. 2025). Returns [B].
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.float().view(-1, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "none":
        return centered.view(-1)
    if scale == "group":
        std = (
            grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(grouped[:, :1])
        )
    elif scale == "batch":
        std = rewards.float().std() if rewards.numel() > 1 else rewards.new_zeros(())
    else:
        raise ValueError(f"scale '{scale}' is not one of group, batch, none")
    return (centered / (std + eps)).view(-1)


def kl_estimate(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3"
) -> torch.Tensor:
    """Per-token estimators of KL(policy || reference) from samples of the policy
    (Schulman 2020, "Approximating KL divergence").

    With d = ref_logprobs - logprobs: k1 = -d, k2 = d^2 / 2, k3 = exp(d) - d - 1.
    [B, T], [B, T] -> [B, T].
    """
    d = ref_logprobs - logprobs
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d.pow(2)
    if kind == "k3":
        return torch.expm1(d) - d
    raise ValueError(f"kl kind '{kind}' is not one of k1, k2, k3")


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, aggregation: str, max_tokens: int | None = None
) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar.

    token-mean: sum(m L) / sum(m) over the batch (DAPO).
    seq-mean-token-mean: mean over sequences of sum_t(m L) / sum_t(m) (GRPO).
    seq-mean-token-sum-norm: sum(m L) / (B * max_tokens) (Dr. GRPO).
    """
    if aggregation == "token-mean":
        return masked_mean(per_token, mask)
    if aggregation == "seq-mean-token-mean":
        return masked_mean(per_token, mask, dim=1).mean()
    if aggregation == "seq-mean-token-sum-norm":
        max_tokens = max_tokens or mask.size(1)
        return (per_token * mask).sum() / (mask.size(0) * max_tokens)
    raise ValueError(f"aggregation '{aggregation}' is not one of {', '.join(AGGREGATIONS)}")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    aggregation: str = "token-mean",
    ratio_level: str = "token",
    max_tokens: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate (Schulman et al. 2017), as used by GRPO/DAPO/GSPO.

    L = -min(rho A, clip(rho, 1 - clip_low, 1 + clip_high) A) per token, with
    rho = exp(logprobs - old_logprobs) (`ratio_level="token"`) or the GSPO
    sequence ratio exp(masked mean_t(logprobs - old_logprobs)) (`"sequence"`).
    logprobs, old_logprobs, mask [B, T]; advantages [B] or [B, T].
    """
    clip_high = clip_low if clip_high is None else clip_high
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    log_ratio = logprobs - old_logprobs
    if ratio_level == "sequence":
        log_ratio = masked_mean(log_ratio, mask, dim=1).unsqueeze(1).expand_as(logprobs)
    elif ratio_level != "token":
        raise ValueError(f"ratio_level '{ratio_level}' is not one of token, sequence")
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    loss = aggregate(per_token, mask, aggregation, max_tokens)
    with torch.no_grad():
        metrics = {
            "loss/policy": loss.item(),
            "policy/clip_fraction": masked_mean((clipped < unclipped).float(), mask).item(),
            # k3 estimate of KL(old || new) from samples of old (Schulman 2020).
            "policy/approx_kl": masked_mean(torch.expm1(-log_ratio) + log_ratio, mask).item(),
            "policy/ratio_mean": masked_mean(ratio, mask).item(),
        }
    return loss, metrics


def nll_loss(logprobs: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """Supervised next-token loss on masked tokens: -sum(m log p) / sum(m)."""
    loss = -masked_mean(logprobs, mask)
    return loss, {"loss/nll": loss.item()}
