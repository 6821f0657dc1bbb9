"""Models: any HF causal LM from a local path, or the embedded default.

The embedded default is a tiny model (Llama unless `model.arch` says otherwise,
`meshrl.model.architectures`) built from `ModelConfig` plus a character tokenizer
built in code (`meshrl.model.tokenizer`), so nothing is downloaded. Both save with
`save_pretrained` and load back through `AutoModelForCausalLM` /
`AutoTokenizer`, exactly like a real model.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

# transformers is first imported through meshrl.model.tokenizer, in every proc: see
# there why one module must be the way in.
from meshrl.model.tokenizer import build_char_tokenizer, load_tokenizer  # isort: split

from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

# The sampler's cache classes (meshrl.model.generation) come through here, imported
# with the model classes above: a colocated policy and trainer import their
# modules in two threads of one proc at once, and importing transformers'
# modelling submodules from both sides broke its lazy imports (ImportError on
# AutoModelForCausalLM). This module's import lock serializes them.
from transformers.cache_utils import Cache, DynamicLayer  # noqa: F401

from meshrl.config import ModelConfig, PlacementConfig
from meshrl.model import mrope, vision
from meshrl.model.architectures import VISION_ARCHITECTURES, tiny_config
from meshrl.model.packing import (
    cache_arg,
    hf_config,
    model_device,
    model_dtype,
    pack,
    packed_logits,
    take_rows,
    takes_logits_to_keep,
)
from meshrl.model.tree import (
    Tree,
    by_prompt_length,
    lower_right,
    lower_right_applies,
    takes_kv_tree,
    tree,
    tree_outputs,
)
from meshrl.procs import pipeline, tensor_parallel
from meshrl.procs.mesh import DEVICE_OFFSET_ENV

if TYPE_CHECKING:
    from meshrl.model.routing import Replay


def embedded_config(cfg: ModelConfig, vocab_size: int, **ids) -> PretrainedConfig:
    """The HF config of the embedded model: `model.arch` at `cfg`'s sizes
    (`meshrl.model.architectures`); `ids` overrides the pad, BOS and EOS ids."""
    return tiny_config(
        cfg.arch,
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        intermediate_size=cfg.intermediate_size,
        max_positions=cfg.max_positions,
        **ids,
    )


def check_layout(cfg: ModelConfig, placement: PlacementConfig, trainer: Any = None) -> None:
    """Whether `placement`'s tensor parallelism can split this model's layers
    (`meshrl.procs.tensor_parallel.check_placement`) and its pipeline stages
    (`meshrl.procs.pipeline.check_placement`), from its config.json or the
    embedded model's config at its sizes; another run's directory is checked by
    the trainer when it loads (`trainer`: its `trainer:` section, for the
    pipeline's schedule). Run when a run starts, before any proc is spawned."""
    if placement.policy_tp == 1 and placement.trainer_group == 1:
        return
    if cfg.path is None:
        config = embedded_config(cfg, vocab_size=64)  # (the split needs no vocabulary)
    else:
        try:
            config = AutoConfig.from_pretrained(cfg.path)
        except (OSError, ValueError):  # a run directory: the trainer checks when it loads
            return
    tensor_parallel.check_placement(placement, config)
    pipeline.check_placement(placement, config, trainer)


def stop_token_ids(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """The ids that end a completion, one set for every engine: the tokenizer's
    EOS and the model's `generation_config.eos_token_id` (one id or several,
    e.g. a chat model's end-of-turn and end-of-text), which vLLM also stops on."""
    ids = [tokenizer.eos_token_id]
    config = getattr(model, "generation_config", None)
    extra = getattr(config, "eos_token_id", None)
    ids += extra if isinstance(extra, list) else [extra]
    return sorted({i for i in ids if i is not None})


_INIT_LOCK = threading.Lock()


@contextlib.contextmanager
def seeded_init(seed: int):
    """Weights initialized inside draw from torch's global generator seeded with
    `seed`, which is restored afterwards. One block at a time per process: two
    actors of one proc (a colocated replica and its trainer, a critic beside a
    trainer) building models at once would otherwise interleave their draws
    and both get weights that no seed gives."""
    with _INIT_LOCK, torch.random.fork_rng():
        torch.manual_seed(seed)
        yield


def load_model(cfg: ModelConfig, seed: int = 0) -> PreTrainedModel:
    """The policy architecture with its initial weights (seeded for the tiny model)."""
    dtype = getattr(torch, cfg.dtype)
    if cfg.path is not None:
        config = AutoConfig.from_pretrained(cfg.path)
        auto = AutoModelForImageTextToText if vision.is_vision(config) else AutoModelForCausalLM
        model = auto.from_pretrained(cfg.path, dtype=dtype)
    elif cfg.arch in VISION_ARCHITECTURES:
        tokenizer = load_tokenizer(cfg)
        with seeded_init(seed):
            text = embedded_config(
                replace(cfg, arch="llama"), len(tokenizer), pad_token_id=tokenizer.pad_token_id
            )
            config = vision.tiny_vlm_config(cfg, text, tokenizer)
            model = AutoModelForImageTextToText.from_config(config).to(dtype)
    else:
        vocab_size = len(build_char_tokenizer())
        with seeded_init(seed):
            config = embedded_config(cfg, vocab_size)
            model = AutoModelForCausalLM.from_config(config).to(dtype)
    model.config.use_cache = True
    without_dropout(model)
    if vision.is_vision(model.config) and not cfg.vision.train:
        vision.freeze_vision(model)
    return model


def without_dropout(model: torch.nn.Module) -> None:
    """Turn every dropout of `model` off, as TRL's `disable_dropout` (on by
    default) does: the trainer runs in train mode, and dropout there would make
    its log-probs of a sample differ from the sampler's (GPT-2's configs keep
    0.1 in three places). The saved config is left as it was."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0  # HF attention modules read it when training


def device_for_this_proc() -> torch.device:
    """GPU (role offset + rank in its mesh) mod the GPU count on GPU hosts, else CPU.

    Monarch does not bind devices; `meshrl.procs.mesh.RoleMeshes` sets each role's
    offset so roles get disjoint GPUs while there are enough of them, and each
    proc calls this when it builds its model.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    from monarch.actor import current_rank

    offset = int(os.environ.get(DEVICE_OFFSET_ENV, "0"))
    point = current_rank()
    local = dict(point).get("procs", point.rank)  # index on this host; GPUs are per host
    device = torch.device("cuda", (offset + local) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


# --- log-probs ---------------------------------------------------------------------


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(token) under softmax(logits / temperature).

    logits [B, T, V], tokens [B, T] -> [B, T] (float32).
    """
    logits = logits.float() / temperature
    return torch.gather(F.log_softmax(logits, dim=-1), -1, tokens.unsqueeze(-1)).squeeze(-1)


def sequence_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that skip left padding: [B, L] mask -> [B, L] positions."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def forward_inputs(model: torch.nn.Module, ids, attention_mask, pixels: dict) -> dict:
    """A forward's `position_ids` and image arguments for left-padded rows with
    `pixels` (`meshrl.model.vision.inputs`, {} without images): positions [B, L]
    skipping the padding, or an M-RoPE model's [3, B, L] from the images' grids
    (`meshrl.model.mrope`); the pixels; Gemma 3's token types (`vision.token_types`)."""
    found = mrope.positions(model, ids, attention_mask, pixels.get("image_grid_thw"))
    return {
        "position_ids": sequence_positions(attention_mask) if found is None else found,
        **pixels,
        **(vision.token_types(hf_config(model), ids) if pixels else {}),
    }


def completion_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    num_completion_tokens: int,
    temperature: float = 1.0,
    layout: str = "padded",
    replay: Replay | None = None,
    routes: torch.Tensor | None = None,
    images: torch.Tensor | None = None,
    image_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-probs of the last `num_completion_tokens` tokens of each sequence.

    input_ids, attention_mask [B, P + T] (prompt left-padded, completion
    right-padded) -> [B, T]. Logits at position i predict token i + 1.
    `layout` (`meshrl.model.packing`): padded, packed or tree; the same values (0 on
    padding unless padded). With `replay` and the sampler's `routes` [B, P + T,
    layers, top_k] (MoE models), the forward's routers are measured against
    them and, if the replay is on, made to use them (`meshrl.model.routing`). With
    `images` and `image_counts` (`meshrl.model.vision`) the rows' pixels go in too,
    laid out padded.
    """
    T = num_completion_tokens
    pixels = vision.inputs(images, image_counts, model_dtype(model), model_device(model))
    if pixels:
        layout = "padded"  # packing would cut rows apart from their images
    if layout == "tree" and takes_kv_tree(model, input_ids, attention_mask, T):

        def run(ids, mask, positions, cache, last):
            keep = {"logits_to_keep": 1} if last and takes_logits_to_keep(model) else {}
            return model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                **cache_arg(model, cache),
                **keep,
            ).logits

        def part(rows: torch.Tensor, laid: Tree, context) -> torch.Tensor:
            mine = None if routes is None else routes[rows.to(routes.device)]
            routed = lambda r: _routed(replay, r, lambda x: x)  # noqa: E731
            first, rest = tree_outputs(laid, run, routed, mine, context)
            targets = input_ids[rows, -T:]
            picked = torch.cat(
                [
                    token_logprobs(first.unsqueeze(1), targets[:, :1], temperature),
                    token_logprobs(rest, targets[:, 1:], temperature),
                ],
                1,
            )
            return torch.where(laid.scored, picked, 0.0)

        return _over_trees(model, input_ids, attention_mask, T, part)
    if layout != "padded" and len(input_ids):  # (an empty micro-batch runs padded)
        packed = pack(input_ids, attention_mask, T, share=layout == "tree")
        with _routed(replay, routes, packed.gather):
            logits = packed_logits(model, packed, model_dtype(model))
        targets = input_ids[:, -T:][packed.rows, packed.cols]
        picked = token_logprobs(logits.unsqueeze(0), targets.unsqueeze(0), temperature)
        return packed.scatter(picked.squeeze(0))
    with _routed(replay, routes, lambda r: r.reshape(-1, *r.shape[2:])):
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            use_cache=False,
            **({"logits_to_keep": T + 1} if takes_logits_to_keep(model) else {}),
            **forward_inputs(model, input_ids, attention_mask, pixels),
        )
    logits = out.logits[:, -T - 1 : -1]
    targets = input_ids[:, -T:]
    if not pixels:
        return token_logprobs(logits, targets, temperature)
    # The sampler never draws the image placeholder (meshrl.model.generation); the
    # placeholders of a tool's picture in the completion are the environment's
    # tokens (out of the loss), given 0 rather than log 0.
    placed = torch.tensor(vision.placeholder_ids(hf_config(model)), device=logits.device)
    logits = logits.clone()
    logits[..., placed] = -float("inf")
    picked = token_logprobs(logits, targets, temperature)
    return picked.masked_fill(torch.isin(targets, placed), 0.0)


def batch_logprobs(
    model: torch.nn.Module,
    batch: Any,  # a `meshrl.types.TrainBatch` (a layer above: not imported)
    temperature: float = 1.0,
    layout: str = "padded",
    replay: Replay | None = None,
) -> torch.Tensor:
    """`completion_logprobs` of a `TrainBatch` where it lies: its ids and masks, the
    sampler's routes and the rows' images."""
    return completion_logprobs(
        model,
        batch.input_ids,
        batch.attention_mask,
        batch.num_completion_tokens,
        temperature,
        layout,
        replay,
        batch.routes,
        batch.images,
        batch.image_counts,
    )


def _over_trees(model, input_ids, attention_mask, T: int, part) -> torch.Tensor:
    """The KV-cache tree layout's [B, T] outputs (`meshrl.model.tree`), from
    `part(rows, laid, context)`: one call per group of rows whose prompts have one
    length, their completions run with `lower_right` attention (no mask), where the
    model takes it; else one call for every row, its prompts left-padded under a
    2D mask."""
    if not lower_right_applies(model):
        rows = torch.arange(len(input_ids), device=input_ids.device)
        return part(rows, tree(input_ids, attention_mask, T), contextlib.nullcontext)
    groups = by_prompt_length(attention_mask, T)
    pieces = [
        part(rows, tree(input_ids[rows], attention_mask[rows], T), lambda: lower_right(model))
        for rows in groups
    ]
    return torch.cat(pieces)[torch.cat(groups).argsort()]


def _routed(replay: Replay | None, routes: torch.Tensor | None, layout):
    """The forward's routing measured (and replayed) when there are routes: `layout`
    turns [B, P + T, L, k] into the forward's token order [N, L, k]."""
    if replay is None or routes is None:
        return contextlib.nullcontext()
    return replay.forward(layout(routes))


# --- value model (PPO's critic) -----------------------------------------------------


class ValueModel(torch.nn.Module):
    """A causal LM's backbone with a scalar head: per-token values V(prefix).

    The backbone is the LM's `base_model` (for Llama, `LlamaModel`); the head is
    a zero-initialized linear layer, so values start at 0.
    """

    def __init__(self, lm: PreTrainedModel):
        super().__init__()
        self.backbone = lm.base_model
        self.backbone_prefix = f"{lm.base_model_prefix}."
        width = lm.config.get_text_config().hidden_size  # a VLM's: its language model's
        # Made without a draw from torch's global generator (nn.Linear's own init
        # draws): another actor of this proc may be building its model inside
        # `seeded_init` at this moment, and a draw here would change its weights.
        head = torch.nn.Linear(width, 1, dtype=lm.dtype, device="meta")
        self.value_head = head.to_empty(device=lm.device)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cache: Cache | None = None,
        **pixels: torch.Tensor,
    ) -> torch.Tensor:
        """[B, L] values; a 2D mask with `position_ids` None, or a packed layout's
        4D mask with its positions, or the KV-cache tree's 2D mask, positions and
        `cache` (filled in place); `pixels`: a VLM's image inputs (`meshrl.model.vision`)."""
        given = {"position_ids": position_ids}  # (a packed layout's, without images)
        if position_ids is None:
            given = forward_inputs(self.backbone, input_ids, attention_mask, pixels)
        if cache is not None:
            given.update(cache_arg(self.backbone, cache))
        hidden = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            use_cache=cache is not None,
            **given,
        ).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float()


def load_value_model(cfg: ModelConfig, seed: int = 0) -> ValueModel:
    """The policy architecture's backbone (same initial weights) with a value head."""
    return ValueModel(load_model(cfg, seed))


def completion_values(
    model: ValueModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    T: int,
    layout: str = "padded",
    images: torch.Tensor | None = None,
    image_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Value of the state before each of the last T tokens: [B, P + T] -> [B, T].

    Aligned like `completion_logprobs`: position i's hidden state scores the
    prefix that token i + 1 is sampled from (0 on padding unless `layout` is
    padded). With `images` (`meshrl.model.vision`) the rows' pixels go in, padded.
    """
    pixels = vision.inputs(images, image_counts, model_dtype(model), model_device(model))
    if layout == "padded" or not len(input_ids) or pixels:
        return model(input_ids, attention_mask, **pixels)[:, -T - 1 : -1]
    if layout == "tree" and takes_kv_tree(model, input_ids, attention_mask, T):

        def part(rows: torch.Tensor, laid: Tree, context) -> torch.Tensor:
            first, rest = tree_outputs(
                laid,
                lambda ids, mask, positions, cache, last: model(ids, mask, positions, cache),
                lambda r: contextlib.nullcontext(),
                completions_context=context,
            )
            return torch.where(laid.scored, torch.cat([first.unsqueeze(1), rest], 1), 0.0)

        return _over_trees(model, input_ids, attention_mask, T, part)
    packed = pack(input_ids, attention_mask, T, share=layout == "tree")
    mask = packed.attention_mask(model_dtype(model), hf_config(model))
    values = model(packed.input_ids, mask, packed.position_ids)
    return packed.scatter(take_rows(values.flatten(), packed.at))


def weight_bytes(cfg: ModelConfig) -> int:
    """About how many bytes the model's weights take: its weight files' size for
    a saved model, else the embedded config's parameters in float32."""
    if cfg.path:
        total = 0
        for root, _, names in os.walk(cfg.path):
            total += sum(
                os.path.getsize(os.path.join(root, n))
                for n in names
                if n.endswith((".safetensors", ".bin", ".pt"))
            )
        return total
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    vocab = 256  # the char tokenizer's order of magnitude
    return 4 * (layers * (4 * h * h + 3 * h * inter) + 2 * vocab * h)
