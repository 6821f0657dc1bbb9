"""Batched sampling with a KV cache, returning token ids and their log-probs.

Prompts come left-padded so every row's next token sits in the last column;
after a row emits EOS it is fed padding and masked out. The log-prob of each
sampled token is taken under softmax(logits / temperature) before top-p
truncation: the same quantity the trainer recomputes, so the two can be
compared token for token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from meshrl.model import vision
from meshrl.model.models import Cache, DynamicLayer, forward_inputs
from meshrl.model.packing import (
    _cache_of,
    cache_arg,
    distinct_prompts,
    model_device,
    model_dtype,
    takes_logits_to_keep,
)
from meshrl.model.routing import Recorder


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


# splitmix64 (Steele et al.), as signed int64 constants: torch has no uint64 multiply.
def _signed(x: int) -> int:
    return (x + 2**63) % 2**64 - 2**63


_GOLDEN, _MIX1, _MIX2 = (
    _signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
)


def _shift(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def row_uniforms(seeds: torch.Tensor, step: int | torch.Tensor) -> torch.Tensor:
    """One uniform in [0, 1) per row, a pure function of (the row's seed, step):
    a row samples the same token from the same distribution whatever the batch
    around it (its size, its order, the rows dropped, the step at which it joined
    a running batch: `step` may be each row's own [R]), on any device."""
    if isinstance(step, torch.Tensor):  # int64 products wrap mod 2**64, as _signed does
        z = seeds + (step.to(seeds.device) + 1) * _GOLDEN
    else:
        z = seeds + _signed((step + 1) * _GOLDEN)
    z = (z ^ _shift(z, 30)) * _MIX1
    z = (z ^ _shift(z, 27)) * _MIX2
    z = z ^ _shift(z, 31)
    return _shift(z, 11).double() * 2.0**-53


def drilled_lengths(seeds: list[int], spec: tuple[int, float, int]) -> list[int]:
    """Each row's completion length under `faults.completion_lengths` (short, share,
    long): a pure function of its seed, so every engine and placement agrees."""
    short, share, long = spec
    seeds_t = torch.tensor(seeds, dtype=torch.long)
    tail, where = row_uniforms(seeds_t, -2), row_uniforms(seeds_t, -3)  # steps no token uses
    lengths = torch.where(
        tail < share,
        short + 1 + (where * max(long - short, 1)).long(),
        1 + (where * short).long(),
    )
    return lengths.clamp(max=long).tolist()


def left_padded(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows as left-padded ids [B, P] and their 0/1 float mask, made in one go
    (a tensor write per row cost more than a decode step)."""
    width = max(len(r) for r in rows)
    pads = [width - len(r) for r in rows]
    ids = torch.tensor([[pad_id] * n + list(r) for n, r in zip(pads, rows, strict=True)])
    return ids, torch.tensor([[0.0] * n + [1.0] * (width - n) for n in pads])


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: [n, V] probabilities (any positive total) and [n]
    uniforms -> [n] token ids; a zero-probability token is never drawn."""
    cdf = probs.double().cumsum(-1)
    target = (uniforms * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=probs.size(-1) - 1)


class GrowingLayer(DynamicLayer):
    """A KV-cache layer that writes each step's keys and values in place into a
    buffer with room to spare (doubled when full), where HF's dynamic layer
    concatenates, copying the whole cache at every token (a fifth of the decode
    time of a 34M model here). `keys` and `values` are views of the buffers."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.length, self.k_buffer, self.v_buffer = (
                0,
                key_states[..., :0, :],
                value_states[..., :0, :],
            )
        end = self.length + key_states.size(-2)
        if end > self.k_buffer.size(-2):
            self.k_buffer, self.v_buffer = (
                self._grown(b, max(end, 2 * self.length)) for b in (self.k_buffer, self.v_buffer)
            )
        self.k_buffer[..., self.length : end, :] = key_states
        self.v_buffer[..., self.length : end, :] = value_states
        self.length = end
        self.keys, self.values = self.k_buffer[..., :end, :], self.v_buffer[..., :end, :]
        return self.keys, self.values

    def _grown(self, buffer: torch.Tensor, capacity: int) -> torch.Tensor:
        grown = buffer.new_empty((*buffer.shape[:-2], capacity, buffer.size(-1)))
        grown[..., : self.length, :] = buffer[..., : self.length, :]
        return grown

    def assign(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Hold these keys and values [B, H, L, D] (a continuous batch's rows,
        merged: `meshrl.model.continuous`)."""
        self.k_buffer, self.v_buffer, self.length = keys, values, keys.size(-2)
        self.keys, self.values = keys, values

    def reorder_cache(self, rows: torch.Tensor) -> None:
        """Keep (or repeat) the batch rows `rows`, room to spare included."""
        if self.is_initialized:
            self.k_buffer, self.v_buffer = self.k_buffer[rows], self.v_buffer[rows]
            self.keys, self.values = (
                self.k_buffer[..., : self.length, :],
                self.v_buffer[..., : self.length, :],
            )


def _growing_cache(model) -> dict:
    """The `GrowingLayer` cache argument for attention-only models (full or
    sliding window: a window over a full cache is still applied by the mask);
    none for models with other layers (linear attention, state spaces), which
    make their own."""
    kinds = set(getattr(model.config, "layer_types", None) or ["full_attention"])
    if not kinds <= {"full_attention", "sliding_attention"}:
        return {}
    return cache_arg(model, Cache(layer_class_to_replicate=GrowingLayer))


def _prefill(model, ids, mask, share: bool, images=None, counts=None):
    """The last logits [B, V] and the KV cache of the prompts, with `share` (each
    distinct prompt computed once, its cache copied to its rows) each row's
    distinct prompt (else None), and each row's next position [B, 1].
    `images`, `counts`: the rows' pixels (`meshrl.model.vision`), which prompts must
    also share to share a prefill; an M-RoPE model's positions come from them."""
    keys = None if images is None else vision.row_keys(images, counts)
    first, inverse = distinct_prompts(ids, mask, keys) if share else (None, None)
    rows = first if share else slice(None)
    pixels = {}
    if images is not None:  # (the pixels may be on the CPU, the ids on the model's device)
        pick = rows.to(images.device) if share else rows
        pixels = vision.inputs(images[pick], counts[pick], model_dtype(model), model_device(model))
    inputs = forward_inputs(model, ids[rows], mask[rows], pixels)  # positions [3, B, P]: M-RoPE
    out = model(
        input_ids=ids[rows],
        attention_mask=mask[rows],
        use_cache=True,
        **inputs,
        **_growing_cache(model),
        **({"logits_to_keep": 1} if takes_logits_to_keep(model) else {}),  # the last only
    )
    logits, cache, positions = out.logits[:, -1], _cache_of(out), inputs["position_ids"]
    # Text goes on after the largest position (M-RoPE: an image's last row or column).
    after = (positions.amax(0) if positions.dim() == 3 else positions)[:, -1:] + 1
    if share:
        logits, after = logits[inverse], after[inverse]
        cache.reorder_cache(inverse)
    return logits, cache, inverse, after


def _next_tokens(
    logits: torch.Tensor,
    step: int,
    temperature: float,
    banned: torch.Tensor | None,
    top_p: float,
    seeds: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The token each decode row draws at `step` [R] and its behaviour log-prob [R]:
    under the distribution it was drawn from, softmax(logits / temperature) without
    the `banned` ids and, with `top_p` < 1, renormalized over the nucleus (vLLM's
    `processed_logprobs` mean the same); then the log-probs and probs [R, V] before
    top-p (for the entropy).

    `temperature` 0 is greedy: each row takes its most likely token (the first on a
    tie, with no draw), and every log-prob is under softmax(logits), the
    temperature-1 distribution (top-p does not change an argmax)."""
    greedy = temperature == 0
    logits = logits.float() / (1.0 if greedy else temperature)
    if banned is not None:
        logits[:, banned] = -float("inf")
    logp = torch.log_softmax(logits, dim=-1)
    probs = logp.exp()
    if greedy:
        token = logp.argmax(-1)
        return token, logp.gather(-1, token[:, None])[:, 0], logp, probs
    sampled = top_p_filter(probs, top_p)
    token = draw(sampled, row_uniforms(seeds, step))
    if top_p >= 1.0:
        behaviour = logp.gather(-1, token[:, None])[:, 0]
    else:
        behaviour = sampled.gather(-1, token[:, None])[:, 0].log()
    return token, behaviour, logp, probs


def top_logprobs(
    logp: torch.Tensor, probs: torch.Tensor, k: int, temperature: float, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` most likely tokens of each row's sampling distribution [R, V] and
    their log-probs, both [R, k]: the distribution the behaviour log-probs are
    taken under (`_next_tokens`: the nucleus renormalized when `top_p` < 1, so a
    token outside it has -inf; temperature 1 when greedy)."""
    if top_p < 1.0 and temperature != 0:
        logp = top_p_filter(probs, top_p).log()
    values, ids = logp.topk(min(k, logp.size(-1)), dim=-1)
    return values, ids


def _banned(model, stop: torch.Tensor, min_new_tokens: int, images: bool):
    """step -> the ids that cannot be drawn then (or None): the stop ids before
    `min_new_tokens`, and with `images` a VLM's image placeholder, which is the
    processor's to place: one sampled would have no pixels behind it."""
    never = (
        torch.tensor(vision.placeholder_ids(model.config), device=stop.device) if images else None
    )

    def at(step: int) -> torch.Tensor | None:
        banned = stop if step < min_new_tokens else None
        if never is None:
            return banned
        return never if banned is None else torch.cat([banned, never])

    return at


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
    seeds: torch.Tensor | None = None,
    share_prefix: bool = True,
    drop_finished: bool = True,
    record_routes: bool = False,
    images: torch.Tensor | None = None,
    image_counts: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    top_k_logprobs: int = 0,
    ends_at: Callable[[list[int]], bool] | None = None,
    each_step: Callable[..., None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample completions for left-padded prompts (and their `images`: `meshrl.model.vision`).

    prompt_ids, prompt_mask [B, P] -> (completion_ids [B, T], logprobs [B, T],
    completion_mask [B, T]) with T <= max_new_tokens; completion_mask is 1 on
    generated tokens up to and including EOS (any of `eos_token_id`'s ids). A `stats` dict receives
    `entropy_rows` [B]: the entropy of softmax(logits / temperature) summed over
    each row's generated tokens (divide by its length for the mean).
    `logprobs` are the behaviour log-probs: each token's under the distribution it
    was drawn from (after temperature, the `min_new_tokens` ban and top-p, as vLLM's
    `processed_logprobs`): the first `min_new_tokens` tokens cannot be a stop id, and
    with `top_p` < 1 the nucleus is renormalized.

    Row b's randomness is `seeds[b]` alone (drawn from `generator` when None),
    so a row's tokens do not depend on the rows beside it. `share_prefix`:
    each distinct prompt is prefilled once and its KV cache copied to its rows.
    `drop_finished`: rows leave the decode batch when they end. Both leave every
    row's distribution as it is: the same seeds give the same tokens (unless a draw
    falls within rounding of a boundary between two tokens' probability mass) and
    log-probs equal up to float rounding (other batch shapes, other matmul
    blockings): tests/unit/test_packing.py. `record_routes` (MoE): `stats["routes"]` [B, P + T, layers, top_k] gets each
    position's experts (`meshrl.model.routing`); -1 on padding and the unfed last token.
    `lengths` [B]: each row's exact completion length (`faults.completion_lengths`):
    no stop id is drawn and the row ends there.
    `top_k_logprobs` > 0 (the endpoint's `top_logprobs`): `stats["top_logprobs"]` gets
    (log-probs, ids), each [B, T, k], the k most likely tokens at each step under
    the distribution each token was drawn from (`top_logprobs`).
    `temperature` 0 is greedy decoding (`_next_tokens`).
    `ends_at(tokens)`: whether a row's tokens so far end it (the endpoint's stop
    strings, found in their text): it ends at that token, which it keeps, and
    decodes no further.
    `each_step(rows, tokens, logprobs, top)`: called as each step's tokens are
    drawn, for the rows still running (original row numbers, their tokens and
    behaviour log-probs; `top` their (log-probs, ids) [R, k] with
    `top_k_logprobs`, else None): the endpoint streams them."""
    (B, P), device = prompt_ids.shape, prompt_ids.device
    if seeds is None:
        on = generator.device if generator else "cpu"
        seeds = torch.randint(-(2**62), 2**62, (B,), generator=generator, device=on)
    seeds = seeds.to(device)
    attention_mask = prompt_mask.long()
    with Recorder.of(model, B, P + max_new_tokens, record_routes) as recorder:
        logits, cache, inverse, next_position = _prefill(
            model, prompt_ids, attention_mask, share_prefix, images, image_counts
        )
        if recorder is not None:
            recorder.put(torch.arange(B), 0, attention_mask, inverse)
        live = torch.arange(B, device=device)  # the original row of each decode row
        finished = torch.zeros(B, dtype=torch.bool, device=device)
        stop = torch.tensor(eos_token_id, device=device).reshape(-1)
        if lengths is not None:
            lengths = lengths.to(device).clamp(1, max_new_tokens)
            min_new_tokens = max_new_tokens  # no stop id: the rows end at their lengths
        banned_at = _banned(model, stop, min_new_tokens, images is not None)
        tokens = torch.full((B, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
        logprobs = torch.zeros(B, max_new_tokens, device=device)
        masks = torch.zeros(B, max_new_tokens, device=device)
        entropy_rows = torch.zeros(B, device=device)
        if top_k_logprobs:
            k = min(top_k_logprobs, logits.size(-1))
            top_values = torch.full((B, max_new_tokens, k), -float("inf"), device=device)
            top_ids = torch.full((B, max_new_tokens, k), pad_token_id, device=device)
        steps, rows_decoded = 0, 0
        for step in range(max_new_tokens):
            steps = step + 1
            rows_decoded += int((~finished[live]).sum()) if not drop_finished else len(live)
            token, behaviour, logp, probs = _next_tokens(
                logits, step, temperature, banned_at(step), top_p, seeds[live]
            )
            if stats is not None:
                entropy = -(probs * logp).nan_to_num().sum(-1)  # 0 * -inf is 0 here
                entropy_rows[live] += entropy.masked_fill(finished[live], 0.0)
            running = ~finished[live]
            if top_k_logprobs:
                values, ids_k = top_logprobs(logp, probs, k, temperature, top_p)
                top_values[live, step], top_ids[live, step] = values, ids_k
            if each_step is not None and bool(running.any()):
                top = (values[running], ids_k[running]) if top_k_logprobs else None
                each_step(live[running], token[running], behaviour[running], top)
            tokens[live, step] = torch.where(running, token, pad_token_id)
            logprobs[live, step] = torch.where(running, behaviour, 0.0)
            masks[live, step] = running.float()
            finished[live] |= torch.isin(token, stop)
            if ends_at is not None:
                for row in live[running].tolist():
                    if not finished[row] and ends_at(tokens[row, : step + 1].tolist()):
                        finished[row] = True
            if lengths is not None:
                finished[live] |= lengths[live] <= step + 1
            if step == max_new_tokens - 1 or bool(finished.all()):
                break  # (the last token's forward would feed nothing)
            if drop_finished and bool(finished[live].any()):
                keep = (~finished[live]).nonzero().squeeze(-1)
                live, next_position = live[keep], next_position[keep]
                attention_mask = attention_mask[keep]
                cache.reorder_cache(keep)
                token = token[keep]
            attention_mask = torch.nn.functional.pad(attention_mask, (0, 1), value=1)
            out = model(
                input_ids=torch.where(finished[live], pad_token_id, token).unsqueeze(-1),
                attention_mask=attention_mask,
                position_ids=next_position,
                use_cache=True,
                **cache_arg(model, cache),
            )
            logits, cache = out.logits[:, -1], _cache_of(out)
            next_position = next_position + 1
            if recorder is not None:  # the token sampled at `step` sits in column P + step
                recorder.put(live, P + step, ~finished[live, None])
    if stats is not None:
        stats["entropy_rows"] = entropy_rows
        stats["occupancy"] = rows_decoded / steps / B  # the live rows' share of the batch
        if top_k_logprobs:
            stats["top_logprobs"] = (top_values[:, :steps], top_ids[:, :steps].long())
        if recorder is not None:
            stats["routes"] = recorder.routes[:, : P + steps]
    return tokens[:, :steps], logprobs[:, :steps], masks[:, :steps]
