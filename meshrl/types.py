"""Dataclasses that travel between the controller and the actors.

Shapes: B sequences, P prompt tokens (left-padded), T completion tokens
(right-padded). Masks are float tensors of 0/1.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from meshrl.model.losses import LossScale
from meshrl.model.vision import stack, unstack


@dataclass
class Prompt:
    """One task instance: the text the model sees and what the environment checks."""

    text: str
    answer: str
    data: dict | None = None
    """Anything else the environment needs (a dataset row's other fields: the
    tests of a coding task, the numbers of a countdown)."""
    images: list | None = None
    """Pictures the model sees with the text (vision-language models,
    `meshrl.model.vision`): file paths, PIL images or [H, W, 3] uint8 arrays."""

    @property
    def key(self) -> str:
        """What tells this prompt from others (held-out sets are kept apart by it):
        its text, and a digest of its pictures when it has some."""
        if not self.images:
            return self.text
        import hashlib

        digest = hashlib.sha1()
        for image in self.images:
            data = image.tobytes() if hasattr(image, "tobytes") else str(image).encode()
            digest.update(data)
        return f"{self.text}\x00{digest.hexdigest()}"


@dataclass
class Completions:
    """What a policy replica returns for a batch of prompts."""

    prompt_ids: torch.Tensor  # [B, P] int64, left-padded
    prompt_mask: torch.Tensor  # [B, P]
    completion_ids: torch.Tensor  # [B, T] int64, right-padded
    completion_mask: torch.Tensor  # [B, T], 1 on sampled tokens up to and including EOS
    logprobs: torch.Tensor  # [B, T] sampling log-probs of completion_ids
    weight_version: int  # the (oldest) weight version that generated them
    # Multi-turn episodes (meshrl.envs.rollout): the completion holds the model's turns
    # and the environment's replies. completion_mask is 1 on the model's tokens
    # only (the loss), completion_attention on every token of the episode.
    completion_attention: torch.Tensor | None = None  # [B, T]
    token_versions: torch.Tensor | None = None  # [B, T] version of each model token, else -1
    routes: torch.Tensor | None = None
    """[B, P + T, layers, top_k] int16: the experts each token was computed with
    (`policy.record_routes`, MoE models; -1 where none), else None."""
    images: torch.Tensor | None = None
    """[B, I, C, H, W] the pixels the rows were generated from (`meshrl.model.vision`):
    the trainer's forward takes these, not a second processing of the images."""
    image_counts: torch.Tensor | None = None  # [B] images of each row
    entropy: torch.Tensor | None = None
    """[B] the sampling distribution's entropy summed over each row's generated
    tokens (None: the engine gives none, as vLLM)."""

    def __len__(self) -> int:
        return self.prompt_ids.size(0)

    def policy_metrics(self) -> dict[str, tuple[float, str]]:
        """What the replicas say of a batch they sampled, each with its reduction
        over the calls of a step: `policy/entropy` (mean over the generated tokens),
        `policy/completion_tokens`, `policy/longest_completion`, `policy/shortest_completion`."""
        lengths = self.completion_mask.sum(1)
        tokens = lengths.sum().item()
        metrics = {
            "policy/completion_tokens": (tokens, "sum"),
            "policy/longest_completion": (lengths.max().item(), "max"),
            "policy/shortest_completion": (lengths.min().item(), "min"),
        }
        if self.entropy is not None:
            metrics["policy/entropy"] = (self.entropy.sum().item() / max(tokens, 1), "mean")
        return metrics

    def versions(self) -> torch.Tensor:
        """[B, T] the weight version of each model token (-1 elsewhere): recorded per
        token (multi-turn episodes, partial rollouts), else `weight_version`'s."""
        if self.token_versions is not None:
            return self.token_versions
        version = torch.full_like(self.completion_ids, self.weight_version)
        return torch.where(self.completion_mask > 0, version, -1)

    def completion_lists(self) -> list[list[int]]:
        """Completion token ids of each row without padding (a multi-turn
        episode's whole transcript: the environment's replies included)."""
        lengths = self.attention.sum(1).long().tolist()
        return [row[:n] for row, n in zip(self.completion_ids.tolist(), lengths, strict=True)]

    @property
    def attention(self) -> torch.Tensor:
        """[B, T] 1 on every token of the completion, the environment's included."""
        if self.completion_attention is None:
            return self.completion_mask
        return self.completion_attention

    def rows(self, index: torch.Tensor | slice) -> Completions:
        """The completions of the rows picked by `index`."""
        return replace(
            self,
            **{
                f.name: getattr(self, f.name)[index]
                for f in fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)
            },
        )

    @staticmethod
    def concat(parts: list[Completions], pad_token_id: int) -> Completions:
        """Stack replica outputs: prompts padded on the left, completions on the right.
        Parts may come from different weight versions (a refill while generating
        ahead); `weight_version` is then the oldest, and each row's `logprobs` are
        still those of the weights that sampled it."""
        versions = {p.weight_version for p in parts}
        multi_turn = any(p.completion_attention is not None for p in parts)
        P = max(p.prompt_ids.size(1) for p in parts)
        T = max(p.completion_ids.size(1) for p in parts)

        def pad(t: torch.Tensor, width: int, value: float, left: bool) -> torch.Tensor:
            extra = width - t.size(1)
            return torch.nn.functional.pad(t, (extra, 0) if left else (0, extra), value=value)

        routes = None
        if any(p.routes is not None for p in parts):
            assert all(p.routes is not None for p in parts), "routes from some replicas only"
            routes = torch.cat([_pad_routes(p, P, T) for p in parts])
        images, counts = stack(
            [row for p in parts for row in unstack((p.images, p.image_counts), len(p))]
        )
        return Completions(
            images=images,
            image_counts=counts,
            routes=routes,
            completion_attention=torch.cat([pad(p.attention, T, 0, False) for p in parts])
            if multi_turn
            else None,
            token_versions=torch.cat([pad(p.versions(), T, -1, False) for p in parts])
            if any(p.token_versions is not None for p in parts)
            else None,
            prompt_ids=torch.cat([pad(p.prompt_ids, P, pad_token_id, True) for p in parts]),
            prompt_mask=torch.cat([pad(p.prompt_mask, P, 0, True) for p in parts]),
            completion_ids=torch.cat(
                [pad(p.completion_ids, T, pad_token_id, False) for p in parts]
            ),
            completion_mask=torch.cat([pad(p.completion_mask, T, 0, False) for p in parts]),
            logprobs=torch.cat([pad(p.logprobs, T, 0, False) for p in parts]),
            weight_version=min(versions),
            entropy=torch.cat([p.entropy for p in parts])
            if all(p.entropy is not None for p in parts)
            else None,
        )


def _pad_routes(part: Completions, P: int, T: int) -> torch.Tensor:
    """`part.routes` [B, p + t, L, k] padded with -1 to [B, P + T, L, k]: the prompt
    part on the left, the completion part on the right (as the ids)."""
    p = part.prompt_ids.size(1)
    routes = part.routes
    left = torch.full((len(part), P - p, *routes.shape[2:]), -1, dtype=routes.dtype)
    right = torch.full(
        (len(part), P + T - routes.size(1) - (P - p), *routes.shape[2:]), -1, dtype=routes.dtype
    )
    return torch.cat([left, routes, right], 1)


@dataclass
class TrainBatch:
    """One optimizer step's data, as the trainer's loss sees it."""

    input_ids: torch.Tensor  # [B, P + T] prompt then completion
    attention_mask: torch.Tensor  # [B, P + T]
    completion_mask: torch.Tensor  # [B, T] 1 on tokens that count in the loss
    old_logprobs: torch.Tensor  # [B, T] log-probs at sampling time
    advantages: torch.Tensor | None = (
        None  # [B, T] from the loop ([B] also trains); set by the algorithm
    )
    ref_logprobs: torch.Tensor | None = None  # [B, T] reference model, when KL is used
    old_values: torch.Tensor | None = None  # [B, T] critic values at rollout (PPO)
    returns: torch.Tensor | None = None  # [B, T] value targets (PPO)
    sampler_logprobs: torch.Tensor | None = None
    """[B, T] the sampler's log-probs, when `old_logprobs` are the trainer's own
    (`trainer.recompute_old_logprobs`)."""
    weights: torch.Tensor | None = None
    """[B, T] train-inference mismatch weights (`trainer.correction`), or None."""
    scale: LossScale | None = None
    """The whole optimizer step's counts, set when the batch is cut into
    data-parallel shards (`shard`); None on a whole batch."""
    routes: torch.Tensor | None = None
    """[B, P + T, layers, top_k] the sampler's experts per token (MoE models,
    `policy.record_routes`), which the trainer measures and may replay."""
    images: torch.Tensor | None = None
    """[B, I, C, H, W] the rows' pixels, as the sampler had them (`meshrl.model.vision`)."""
    image_counts: torch.Tensor | None = None  # [B] images of each row
    token_versions: torch.Tensor | None = None
    """[B, T] the weight version that sampled each completion token, -1 elsewhere
    (`Completions.token_versions`: multi-turn episodes, partial rollouts), or None."""
    paired: bool = False
    """Rows are [first; second] of the same items (DPO's chosen; rejected): a
    split keeps each item's two rows together."""

    @property
    def num_completion_tokens(self) -> int:
        return self.completion_mask.size(1)

    @staticmethod
    def from_completions(
        completions: Completions,
        advantages: torch.Tensor | None = None,
        ref_logprobs: torch.Tensor | None = None,
    ) -> TrainBatch:
        return TrainBatch(
            input_ids=torch.cat([completions.prompt_ids, completions.completion_ids], 1),
            attention_mask=torch.cat([completions.prompt_mask, completions.attention], 1),
            completion_mask=completions.completion_mask,
            old_logprobs=completions.logprobs,
            advantages=advantages,
            ref_logprobs=ref_logprobs,
            routes=completions.routes,
            images=completions.images,
            image_counts=completions.image_counts,
            token_versions=completions.token_versions,
        )

    def apply(self, fn) -> TrainBatch:
        """A copy with `fn` applied to every tensor (e.g. a row slice, `.to(device)`)."""
        return replace(
            self,
            **{
                f.name: fn(getattr(self, f.name))
                for f in fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)
            },
        )

    def shard(self, index: int, count: int, rows: torch.Tensor | slice | None = None) -> TrainBatch:
        """The data-parallel shard of rank `index` of `count`: the index-th of
        `count` contiguous row blocks (so a group's rows, which are adjacent,
        share their prompt's forward: meshrl.model.packing), or `rows`, carrying this
        whole batch's `LossScale` so that the ranks' averaged gradients are the
        whole batch's."""
        scale = self.scale or LossScale.of(self.completion_mask, count)
        if rows is None:
            rows = torch.arange(len(self)).tensor_split(count)[index]
        part = self.rows(rows)
        return replace(part, scale=scale, paired=self.paired and rows is not None)

    def shards(self, procs: int, tp: int = 1, rows=None) -> list[TrainBatch]:
        """Per proc of a mesh of `procs` in groups of `tp` (tensor parallelism),
        its data-parallel shard: proc i takes shard i // tp of procs // tp, so the
        procs of one group take the same rows. `rows(r)`: the rows of data-parallel
        rank r (default: contiguous blocks)."""
        dp = procs // tp
        return [
            self.shard(i // tp, dp, None if rows is None else rows(i // tp)) for i in range(procs)
        ]

    def split(self, parts: int) -> list[TrainBatch]:
        """`parts` consecutive micro-batches (gradient accumulation), each keeping
        the batch's scale: their losses add up to the batch's. Always `parts` of
        them, some empty when there are fewer rows: every data-parallel rank must
        run as many backward passes as the others."""
        scale = self.scale or LossScale.of(self.completion_mask)
        items = len(self) // 2 if self.paired else len(self)
        blocks = torch.arange(items).tensor_split(parts)
        if self.paired:
            blocks = [torch.cat([b, b + items]) for b in blocks]
        return [replace(self.rows(b), scale=scale, paired=self.paired) for b in blocks]

    def rows(self, index: torch.Tensor | slice) -> TrainBatch:
        """The rows picked by `index` (a slice or a tensor of row numbers), no
        longer `paired` (say so again when they are)."""
        return replace(self.apply(lambda t: t[index]), paired=False)

    def __len__(self) -> int:
        return self.input_ids.size(0)
