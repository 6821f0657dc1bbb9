"""Batched sampling with a KV cache, returning token ids and their log-probs.

Prompts come left-padded so every row's next token sits in the last column;
after a row emits EOS it is fed padding and masked out. The log-prob of each
sampled token is taken under softmax(logits / temperature) before top-p
truncation: the same quantity the trainer recomputes, so the two can be
compared token for token.
"""

from __future__ import annotations

import torch

from meshrl.models import sequence_positions


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the tail of each row outside the smallest set with mass >= top_p.

    probs [B, V] -> [B, V], renormalized.
    """
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum(-1, keepdim=True)


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_token_id: int | list[int],
    pad_token_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    stats: dict | None = None,
    min_new_tokens: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample completions for left-padded prompts.

    prompt_ids, prompt_mask [B, P] -> (completion_ids [B, T], logprobs [B, T],
    completion_mask [B, T]) with T <= max_new_tokens; completion_mask is 1 on
    generated tokens up to and including EOS (any of `eos_token_id`'s ids). A `stats` dict receives
    `entropy_sum`: the entropy of softmax(logits / temperature) summed over
    the generated tokens (divide by completion_mask.sum() for the mean).
    The first `min_new_tokens` tokens cannot be a stop id (their log-probs are
    those of the distribution without them, as in HF and vLLM).
    """
    batch_size = prompt_ids.size(0)
    attention_mask = prompt_mask.long()
    positions = sequence_positions(attention_mask)
    out = model(
        input_ids=prompt_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True
    )
    next_position = positions[:, -1:] + 1
    finished = torch.zeros(batch_size, dtype=torch.bool, device=prompt_ids.device)
    stop = torch.tensor(eos_token_id, device=prompt_ids.device).reshape(-1)
    tokens, logprobs, masks = [], [], []
    entropy_sum = torch.zeros((), device=prompt_ids.device)
    for step in range(max_new_tokens):
        logits = out.logits[:, -1].float() / temperature
        if step < min_new_tokens:
            logits[:, stop] = -float("inf")
        logp = torch.log_softmax(logits, dim=-1)
        probs = top_p_filter(logp.exp(), top_p)
        token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        token_logp = logp.gather(-1, token.unsqueeze(-1)).squeeze(-1)
        if stats is not None:
            entropy = -(logp.exp() * logp).nan_to_num().sum(-1)  # 0 * -inf is 0 here
            entropy_sum += entropy.masked_fill(finished, 0.0).sum()
        tokens.append(torch.where(finished, pad_token_id, token))
        logprobs.append(torch.where(finished, 0.0, token_logp))
        masks.append(~finished)
        finished = finished | torch.isin(token, stop)
        if bool(finished.all()):
            break
        attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=1)
        out = model(
            input_ids=tokens[-1].unsqueeze(-1),
            attention_mask=attention_mask,
            position_ids=next_position,
            past_key_values=out.past_key_values,
            use_cache=True,
        )
        next_position = next_position + 1
    if stats is not None:
        stats["entropy_sum"] = entropy_sum.item()
    return torch.stack(tokens, 1), torch.stack(logprobs, 1), torch.stack(masks, 1).float()
