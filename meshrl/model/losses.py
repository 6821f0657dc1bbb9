"""Pure tensor math for RL post-training: advantages, KL estimators, losses.

Shapes: B sequences, T completion tokens. `mask` [B, T] is 1 on completion
tokens that count, 0 elsewhere. Losses return `(loss, metrics)` where metrics
are plain floats for logging.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from meshrl.config.trainer import CORRECTIONS

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class LossScale:
    """The denominators of one optimizer step's loss, counted over its whole batch.

    A trainer rank sees a shard of the batch (and a micro-batch of that shard),
    and data parallelism averages the ranks' gradients (DDP, and FSDP2's
    reduce-scatter). So a rank's loss is `ranks * sum(its terms) / global count`:
    averaged over the ranks and summed over micro-batches, that is exactly the
    loss one proc computes on the whole batch, and so is its gradient. The same
    holds for every figure a loss reports through this scale, so metrics are a
    shard's part of the batch's value (summed over micro-batches, averaged over
    ranks). `tokens` counts the mask's ones, `sequences` the rows.
    """

    tokens: float
    sequences: int
    ranks: int = 1

    @staticmethod
    def of(mask: torch.Tensor, ranks: int = 1) -> LossScale:
        """The scale of a whole batch with this [B, T] mask, split over `ranks`."""
        return LossScale(float(mask.sum()), mask.size(0), ranks)

    def token_mean(self, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """This part's share of the batch's masked token mean of `values`."""
        return self.ranks * (values * mask).sum() / max(self.tokens, 1.0)

    def sequence_mean(self, values: torch.Tensor, sequences: float | None = None) -> torch.Tensor:
        """This part's share of the batch's mean of per-sequence `values` [B]
        (over `sequences` items instead of the rows, e.g. DPO's pairs)."""
        return self.ranks * values.sum() / max(sequences or self.sequences, 1)


def scale_of(mask: torch.Tensor, scale: LossScale | None) -> LossScale:
    """`scale`, or the local batch's own when None (one proc, whole batch)."""
    return scale if scale is not None else LossScale.of(mask)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` where mask is 1 (over all elements, or along `dim`)."""
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def per_token(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] advantages, one a sequence -> [B, T]: each completion token of a row takes
    its row's, 0 off the mask (the shape every `compute_advantages` returns)."""
    return advantages.unsqueeze(1) * mask


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
    per_token: torch.Tensor,
    mask: torch.Tensor,
    aggregation: str,
    max_tokens: int | None = None,
    scale: LossScale | None = None,
) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar, with the batch's global
    counts from `scale` (None: this batch is the whole batch).

    token-mean: sum(m L) / sum(m) over the batch (DAPO).
    seq-mean-token-mean: mean over sequences of sum_t(m L) / sum_t(m) (GRPO).
    seq-mean-token-sum-norm: sum(m L) / (B * max_tokens) (Dr. GRPO).
    """
    scale = scale_of(mask, scale)
    if aggregation == "token-mean":
        return scale.token_mean(per_token, mask)
    if aggregation == "seq-mean-token-mean":
        return scale.sequence_mean(masked_mean(per_token, mask, dim=1))
    if aggregation == "seq-mean-token-sum-norm":
        max_tokens = max_tokens or mask.size(1)
        return scale.sequence_mean((per_token * mask).sum(1) / max_tokens)
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
    scale: LossScale | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate (Schulman et al. 2017), as used by GRPO/DAPO/GSPO.

    L = -w min(rho A, clip(rho, 1 - clip_low, 1 + clip_high) A) per token, with
    rho = exp(logprobs - old_logprobs) (`ratio_level="token"`) or the GSPO
    sequence ratio exp(masked mean_t(logprobs - old_logprobs)) (`"sequence"`),
    and w the train-inference mismatch weights (`mismatch_weights`; 1 when None).
    logprobs, old_logprobs, mask, weights [B, T]; advantages [B] or [B, T].
    `scale` holds the whole batch's counts when this is a shard of it.
    """
    clip_high = clip_low if clip_high is None else clip_high
    scale = scale_of(mask, scale)
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
    if weights is not None:
        per_token = per_token * weights.detach()
    loss = aggregate(per_token, mask, aggregation, max_tokens, scale)
    with torch.no_grad():
        log_ratio = log_ratio.detach()
        metrics = {
            "loss/policy": loss.item(),
            "policy/clip_fraction": scale.token_mean((clipped < unclipped).float(), mask).item(),
            # k3 estimate of KL(old || new) from samples of old (Schulman 2020):
            # with r = new / old, E_old[(r - 1) - log r].
            "policy/approx_kl": scale.token_mean(torch.expm1(log_ratio) - log_ratio, mask).item(),
            "policy/ratio_mean": scale.token_mean(ratio, mask).item(),
            # Old log-probs vs the trainer's, per token. On a batch's first optimizer
            # step this is the generation/training mismatch when the old log-probs
            # are the sampler's (numerics, and staleness when generation runs
            # ahead); later steps add the updates.
            "sampling/logprob_abs_diff": scale.token_mean(
                (logprobs.detach() - old_logprobs).abs(), mask
            ).item(),
            "sampling/kl": scale.token_mean(
                kl_estimate(old_logprobs, logprobs.detach(), "k3"), mask
            ).item(),
        }
    return loss, metrics


def nll_loss(
    logprobs: torch.Tensor, mask: torch.Tensor, scale: LossScale | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Supervised next-token loss on masked tokens: -sum(m log p) / sum(m) over
    the whole batch (`scale`, as in `policy_loss`)."""
    loss = -scale_of(mask, scale).token_mean(logprobs, mask)
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
    scale: LossScale | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss of PPO (as in OpenAI baselines / TRL's PPO):
    0.5 * masked mean of max((V - R)^2, (clip(V, V_old - clip, V_old + clip) - R)^2),
    the mean over the whole batch's tokens (`scale`, as in `policy_loss`).

    values, old_values, returns, mask [B, T].
    """
    scale = scale_of(mask, scale)
    clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
    unclipped = (values - returns).pow(2)
    clipped = (clipped_values - returns).pow(2)
    loss = 0.5 * scale.token_mean(torch.maximum(unclipped, clipped), mask)
    with torch.no_grad():
        metrics = {
            "loss/value": loss.item(),
            "value/clip_fraction": scale.token_mean((clipped > unclipped).float(), mask).item(),
            "value/mean": scale.token_mean(values.detach(), mask).item(),
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
    pairs: int | None = None,
    ranks: int = 1,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Direct preference optimization (Rafailov et al. 2023), with the
    conservative label smoothing of cDPO (Mitchell 2023).

    All inputs [B]: summed log-probs of the chosen / rejected response.
    With D = (pi_c - ref_c) - (pi_r - ref_r):
    loss = mean of -(1 - eps) log sigmoid(beta D) - eps log sigmoid(-beta D).
    Metrics: implicit rewards beta (pi - ref) of chosen and rejected, their
    margin, and accuracy = fraction of pairs whose chosen reward is higher
    (ties count one half, so an untrained policy scores 0.5). Means are over
    `pairs` (the whole batch's, when these are one of `ranks` shards of it; as
    `LossScale`), by default the pairs given.
    """
    scale = LossScale(0.0, pairs or policy_chosen_logps.numel(), ranks)
    chosen_rewards = beta * (policy_chosen_logps - ref_chosen_logps)
    rejected_rewards = beta * (policy_rejected_logps - ref_rejected_logps)
    logits = chosen_rewards - rejected_rewards  # = beta * D
    losses = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    loss = scale.sequence_mean(losses)
    with torch.no_grad():
        wins = (logits > 0).float() + 0.5 * (logits == 0).float()
        metrics = {
            "loss/dpo": loss.item(),
            "rewards/chosen": scale.sequence_mean(chosen_rewards.detach()).item(),
            "rewards/rejected": scale.sequence_mean(rejected_rewards.detach()).item(),
            "rewards/margin": scale.sequence_mean(logits.detach()).item(),
            "rewards/accuracy": scale.sequence_mean(wins).item(),
        }
    return loss, metrics


# --- train-inference mismatch ---------------------------------------------------------
#
# The sampler (an inference engine, other kernels, another dtype, a truncated
# top-p distribution) and the trainer disagree on the old policy's log-probs.
# With log_ratio = trainer - sampler log-probs of the sampled tokens, the
# importance weight rho = exp(log_ratio) turns the sampler's samples into an
# estimate under the trainer's old policy. Each correction below returns
# detached per-token weights [B, T] that multiply the per-token policy loss.

# CORRECTIONS: their names live with their key (`trainer.correction`), imported above.


def tis_weights(log_ratio: torch.Tensor, mask: torch.Tensor, high: float = 2.0) -> torch.Tensor:
    """Truncated importance sampling, token level (Yao et al. 2025, "Your
    efficient RL framework secretly brings you off-policy RL training"):
    w = min(rho, high). [B, T] -> [B, T], 0 off the mask."""
    return torch.exp(log_ratio).clamp(max=high) * mask


def mis_weights(
    log_ratio: torch.Tensor, mask: torch.Tensor, high: float = 2.0, level: str = "token"
) -> torch.Tensor:
    """Masked importance sampling (Liu, Li et al. 2025, "When speed kills
    stability: demystifying RL collapse from the training-inference mismatch"):
    w = rho where rho <= high, else 0, with rho per token (`level="token"`) or
    per sequence, rho = exp(sum_t log_ratio) on every token of the row
    (`"sequence"`). [B, T] -> [B, T], 0 off the mask."""
    if level == "sequence":
        rho = torch.exp((log_ratio * mask).sum(1, keepdim=True)).expand_as(log_ratio)
    elif level == "token":
        rho = torch.exp(log_ratio)
    else:
        raise ValueError(f"level '{level}' is not one of token, sequence")
    return torch.where(rho <= high, rho, torch.zeros_like(rho)) * mask


def icepop_weights(
    log_ratio: torch.Tensor, mask: torch.Tensor, low: float = 0.5, high: float = 2.0
) -> torch.Tensor:
    """IcePop (Ling Team 2025, "Every step evolves: scaling RL for trillion-scale
    thinking model"): w = rho on tokens with low <= rho <= high; tokens outside
    the band are masked out (w = 0). [B, T] -> [B, T]."""
    rho = torch.exp(log_ratio)
    keep = (rho >= low) & (rho <= high)
    return torch.where(keep, rho, torch.zeros_like(rho)) * mask


def geometric_mask(
    log_ratio: torch.Tensor, mask: torch.Tensor, low: float = 0.5, high: float = 2.0
) -> torch.Tensor:
    """A sequence mask on the geometric mean of the token ratios,
    g = exp(masked mean_t log_ratio): every token of a row weighs 1 when
    low <= g <= high and 0 otherwise (no reweighting; verl's "geometric"
    rejection sampling). Length-normalized, so long rows are not rejected for
    their length. [B, T] -> [B, T]."""
    g = torch.exp(masked_mean(log_ratio, mask, dim=1)).unsqueeze(1)
    return ((g >= low) & (g <= high)).float().expand_as(log_ratio) * mask


def mismatch_weights(
    old_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kind: str,
    low: float = 0.5,
    high: float = 2.0,
) -> torch.Tensor | None:
    """The weights of correction `kind` (one of CORRECTIONS; "none" gives None)
    for the trainer's old log-probs against the sampler's. [B, T] -> [B, T]."""
    log_ratio = (old_logprobs - sampler_logprobs).float() * mask
    if kind == "none":
        return None
    if kind == "tis":
        return tis_weights(log_ratio, mask, high)
    if kind in ("mis-token", "mis-sequence"):
        return mis_weights(log_ratio, mask, high, kind.split("-")[1])
    if kind == "icepop":
        return icepop_weights(log_ratio, mask, low, high)
    if kind == "geo-mask":
        return geometric_mask(log_ratio, mask, low, high)
    raise ValueError(f"correction '{kind}' is not one of {', '.join(CORRECTIONS)}")


OFF_BAND = (0.9, 1.1)
"""The ratio band `sampling/ratio_off_band` counts the tokens outside of."""


def mismatch_metrics(
    old_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    lags: torch.Tensor | None = None,
) -> dict[str, float]:
    """How far the sampler is from the trainer, over the masked tokens, with
    rho = trainer / sampler probability of each sampled token:

    - `sampling/k3_kl`: KL(sampler || trainer), k3 estimate E[(rho - 1) - log rho];
    - `sampling/chi2`: chi-square divergence, E[rho^2] - 1;
    - `sampling/ess`: effective sample size fraction, E[rho]^2 / E[rho^2] (1 when
      they agree; the share of the batch the weighted estimate is worth);
    - `sampling/sampler_logprob_abs_diff` and `..._max_abs_diff`: |log rho|, mean
      and max;
    - `sampling/ratio_off_band`: the share of tokens whose rho leaves [0.9, 1.1]
      (`OFF_BAND`; the figure TRL's issue #7269 reports for low-precision samplers);
    - with `weights`: `sampling/masked_fraction` (tokens of weight 0) and
      `sampling/truncated_fraction` (tokens whose weight is below a rho > 1);
    - with `lags` [B, T] (each token's version, in publishes behind the trainer's;
      partial rollouts): `sampling/k3_kl_lag0`, `_lag1`, `_lag2plus` and
      `sampling/ratio_off_band_lag0`, ... over the tokens of each lag that has any.
      Lag 0 is the trainer's own version: numerics only, ~0 in float32; the
      others add the policy's drift since, so a figure out of line with its
      lag points at a token's log-prob or version, not at the staleness.
    """
    log_ratio = (old_logprobs - sampler_logprobs).float()
    rho = torch.exp(log_ratio)
    mean_rho, mean_rho2 = masked_mean(rho, mask), masked_mean(rho.pow(2), mask)
    metrics = {
        "sampling/k3_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, mask).item(),
        "sampling/chi2": (mean_rho2 - 1).item(),
        "sampling/ess": (mean_rho.pow(2) / mean_rho2.clamp(min=1e-30)).item(),
        "sampling/sampler_logprob_abs_diff": masked_mean(log_ratio.abs(), mask).item(),
        "sampling/sampler_logprob_max_abs_diff": (log_ratio.abs() * mask).max().item(),
        "sampling/ratio_off_band": masked_mean(
            ((rho < OFF_BAND[0]) | (rho > OFF_BAND[1])).float(), mask
        ).item(),
    }
    if weights is not None:
        on = mask > 0
        metrics["sampling/masked_fraction"] = masked_mean(
            ((weights == 0) & on).float(), mask
        ).item()
        truncated = (weights > 0) & (weights < rho - 1e-6) & (rho > 1)
        metrics["sampling/truncated_fraction"] = masked_mean(truncated.float(), mask).item()
    if lags is not None:
        k3 = torch.expm1(log_ratio) - log_ratio
        off = ((rho < OFF_BAND[0]) | (rho > OFF_BAND[1])).float()
        for name, at in (("lag0", lags == 0), ("lag1", lags == 1), ("lag2plus", lags >= 2)):
            tokens = mask * at
            if tokens.sum() > 0:
                metrics[f"sampling/k3_kl_{name}"] = masked_mean(k3, tokens).item()
                metrics[f"sampling/ratio_off_band_{name}"] = masked_mean(off, tokens).item()
    return metrics
