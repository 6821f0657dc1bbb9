"""Pure tensor math for RL post-training: advantages, KL estimators, losses.

Shapes: B sequences, T completion tokens. `mask` [B, T] is 1 on completion
tokens that count, 0 elsewhere. Losses return `(loss, metrics)` where metrics
are plain floats for logging.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
            # Sampler vs trainer on the same tokens, per token. On a batch's first
            # optimizer step this is the generation/training mismatch (numerics,
            # and staleness when generation runs ahead); later steps add the updates.
            "sampling/logprob_abs_diff": masked_mean((logprobs - old_logprobs).abs(), mask).item(),
            "sampling/kl": masked_mean(
                kl_estimate(old_logprobs, logprobs.detach(), "k3"), mask
            ).item(),
        }
    return loss, metrics


def nll_loss(logprobs: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """Supervised next-token loss on masked tokens: -sum(m log p) / sum(m)."""
    loss = -masked_mean(logprobs, mask)
    return loss, {"loss/nll": loss.item()}


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out baseline (Ahmadian et al. 2024, "Back to Basics").

    rewards [B] in consecutive groups of `group_size`; each reward minus the mean
    of the other members of its group: A = r - (sum - r) / (k - 1). Returns [B].
    """
    if group_size < 2:
        raise ValueError("rloo_advantages needs group_size >= 2 (a baseline from the others)")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.float().view(-1, group_size)
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - others).view(-1)


def whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked elements of the whole batch; 0 off the mask.

    The global normalization of REINFORCE++ (Hu 2025) and of PPO advantages.
    """
    mean = masked_mean(values, mask)
    count = mask.sum()
    var = ((values - mean).pow(2) * mask).sum() / (count - 1).clamp(min=1)
    return (values - mean) / (var.sqrt() + eps) * mask


def token_rewards(
    scores: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None, kl_coef: float = 0.0
) -> torch.Tensor:
    """Per-token rewards for a sequence-level score: the score on the last masked
    token of each row, minus `kl_coef * kl` on every masked token (the KL-shaped
    reward of InstructGPT, Ouyang et al. 2022, used by PPO and REINFORCE++).

    scores [B], mask [B, T], kl [B, T] or None -> [B, T].
    """
    rewards = torch.zeros_like(mask, dtype=torch.float32)
    positions = torch.arange(mask.size(1), device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, -1).max(dim=1).values
    rows = torch.nonzero(last >= 0).squeeze(1)
    rewards[rows, last[rows]] = scores.float()[rows]
    if kl is not None and kl_coef:
        rewards = rewards - kl_coef * kl * mask
    return rewards


def returns_to_go(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Discounted sum of future masked rewards at each token: [B, T] -> [B, T].
    Positions off the mask are not steps: an environment's reply inside a
    multi-turn episode is skipped, not discounted over."""
    returns = torch.zeros_like(rewards, dtype=torch.float32)
    running = torch.zeros(rewards.size(0), device=rewards.device)
    for t in reversed(range(rewards.size(1))):
        on = mask[:, t] > 0
        running = torch.where(on, rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return returns * mask


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016).

    delta_t = r_t + gamma V_{t+1} - V_t;  A_t = delta_t + gamma lam A_{t+1}.
    rewards, values, mask [B, T]. The steps are the masked tokens only: past the
    last one the value is 0, and tokens off the mask inside a row (an
    environment's reply in a multi-turn episode) are skipped, so the model's
    last token of a turn bootstraps from its first token of the next turn.
    Returns (advantages [B, T], returns = advantages + values), both 0 off the mask.
    """
    values = values.float() * mask
    rewards = rewards.float() * mask
    advantages = torch.zeros_like(values)
    running = torch.zeros(values.size(0), device=values.device)
    next_value = torch.zeros(values.size(0), device=values.device)
    for t in reversed(range(values.size(1))):
        on = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(on, delta + gamma * lam * running, running)
        advantages[:, t] = running
        next_value = torch.where(on, values[:, t], next_value)
    advantages = advantages * mask
    return advantages, (advantages + values) * mask


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float = 0.2,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss of PPO (as in OpenAI baselines / TRL's PPO):
    0.5 * masked mean of max((V - R)^2, (clip(V, V_old - clip, V_old + clip) - R)^2).

    values, old_values, returns, mask [B, T].
    """
    clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
    unclipped = (values - returns).pow(2)
    clipped = (clipped_values - returns).pow(2)
    loss = 0.5 * masked_mean(torch.maximum(unclipped, clipped), mask)
    with torch.no_grad():
        metrics = {
            "loss/value": loss.item(),
            "value/clip_fraction": masked_mean((clipped > unclipped).float(), mask).item(),
            "value/mean": masked_mean(values, mask).item(),
        }
    return loss, metrics


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var[R - V] / Var[R] over masked tokens: 1 is a perfect critic, 0 no
    better than a constant, negative worse. NaN when the returns do not vary."""
    residual = returns - values
    var_returns = masked_mean((returns - masked_mean(returns, mask)).pow(2), mask)
    var_residual = masked_mean((residual - masked_mean(residual, mask)).pow(2), mask)
    if var_returns.item() == 0:
        return float("nan")
    return (1 - var_residual / var_returns).item()


def sequence_logprobs(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of masked token log-probs per sequence: [B, T] -> [B]."""
    return (logprobs * mask).sum(dim=1)


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Direct preference optimization (Rafailov et al. 2023), with the
    conservative label smoothing of cDPO (Mitchell 2023).

    All inputs [B]: summed log-probs of the chosen / rejected response.
    With D = (pi_c - ref_c) - (pi_r - ref_r):
    loss = mean of -(1 - eps) log sigmoid(beta D) - eps log sigmoid(-beta D).
    Metrics: implicit rewards beta (pi - ref) of chosen and rejected, their
    margin, and accuracy = fraction of pairs whose chosen reward is higher
    (ties count one half, so an untrained policy scores 0.5).
    """
    chosen_rewards = beta * (policy_chosen_logps - ref_chosen_logps)
    rejected_rewards = beta * (policy_rejected_logps - ref_rejected_logps)
    logits = chosen_rewards - rejected_rewards  # = beta * D
    losses = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    loss = losses.mean()
    with torch.no_grad():
        wins = (logits > 0).float() + 0.5 * (logits == 0).float()
        metrics = {
            "loss/dpo": loss.item(),
            "rewards/chosen": chosen_rewards.mean().item(),
            "rewards/rejected": rejected_rewards.mean().item(),
            "rewards/margin": logits.mean().item(),
            "rewards/accuracy": wins.mean().item(),
        }
    return loss, metrics
