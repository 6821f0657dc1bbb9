"""Generation engines of the policy replicas (`policy.engine`).

`hf` (the default, CPU and GPU) samples with `meshrl.model.generation.sample` from
the replica's HF model. `vllm` (GPU only, the `vllm` extra) samples with an
in-process vLLM engine. Either way the replica pulls each weight version into
its HF model through `meshrl.weights.publisher`, so the versioned sync is the same; the
vLLM engine then loads that model's tensors into its own (fused) layers.

Both return what the trainer needs: completion ids, the behaviour log-prob of
each token under the distribution it was drawn from (after temperature, the
`min_new_tokens` ban and top-p: vLLM's `processed_logprobs`, and the same on
`hf`), and the mask (generated tokens up to and including EOS).
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from meshrl.config import GenerationConfig, ModelConfig, PolicyConfig
from meshrl.model.generation import sample

ENGINES = ("hf", "vllm")


class EngineUnavailable(RuntimeError):
    """The configured engine cannot run on this proc; one line naming the key."""


def vllm_missing() -> str | None:
    """Why the vllm engine cannot run in this process, or None."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed (pip install -e '.[vllm]' on the GPU hosts)"
    if not torch.cuda.is_available():
        return "vLLM generates on a CUDA GPU and this proc has none (policy.engine=hf runs on CPU)"
    return None


@dataclass
class Request:
    """One `generate` call of an engine: the rows' prompts, left-padded (`ids`,
    `mask` [B, P]) and as lists (`prompts`), and how to sample them."""

    ids: torch.Tensor
    mask: torch.Tensor
    prompts: list[list[int]]
    generation: GenerationConfig
    generator: torch.Generator
    """Each row's seed where `seeds` is None (the replica's stream)."""
    stats: dict = field(default_factory=dict)
    """Filled by the engine: `entropy_rows`, `occupancy`, `routes`, `top_logprobs`."""
    seeds: list[int] | None = None
    images: tuple[torch.Tensor, torch.Tensor] | None = None
    """The rows' (pixels [B, I, C, H, W], counts [B]), or None."""
    lengths: list[int] | None = None
    """Each row's exact length (`faults.completion_lengths`), or None."""
    top_logprobs: int = 0
    """> 0: `stats["top_logprobs"]` gets each step's k most likely tokens and
    their log-probs ([B, T, k] each)."""
    stops: list[str] | None = None
    """Strings that end a row at the token completing one in its text (decoded
    without special tokens), kept."""
    each_step: Callable[..., None] | None = None
    """Told each step's tokens as they are drawn (`sample`'s; the endpoint's streams)."""


class HFEngine:
    """Batched KV-cache sampling with the replica's HF model: each distinct
    prompt prefilled once, finished rows dropped (`policy.share_prefix`,
    `policy.drop_finished`), each row's randomness its own seed's."""

    def __init__(
        self,
        model: torch.nn.Module,
        pad_id: int,
        stop_ids: list[int],
        policy_cfg: PolicyConfig,
        decode: Callable[[list[int]], str] | None = None,
    ):
        self.model, self.pad_id, self.stop_ids = model, pad_id, stop_ids
        self.decode = decode  # token ids -> text, for stop strings
        self.share_prefix, self.drop_finished = policy_cfg.share_prefix, policy_cfg.drop_finished
        self.record_routes = policy_cfg.record_routes

    def generate(self, request: Request) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(completion ids, behaviour log-probs, completion mask), each [B, T].
        Temperature 0 is greedy."""
        r = request
        pixels, counts = r.images if r.images is not None else (None, None)
        ends_at = None
        if r.stops:
            decode, stops = self.decode, r.stops

            def ends_at(tokens: list[int]) -> bool:
                text = decode(tokens)
                return any(stop in text for stop in stops)

        generation = r.generation
        return sample(
            self.model,
            r.ids,
            r.mask,
            max_new_tokens=generation.max_new_tokens,
            eos_token_id=self.stop_ids,
            pad_token_id=self.pad_id,
            temperature=generation.temperature,
            top_p=generation.top_p,
            generator=r.generator,
            seeds=None if r.seeds is None else torch.tensor(r.seeds, dtype=torch.long),
            stats=r.stats,
            min_new_tokens=generation.min_new_tokens,
            share_prefix=self.share_prefix,
            drop_finished=self.drop_finished,
            record_routes=self.record_routes,
            images=pixels,
            image_counts=counts,
            lengths=None if r.lengths is None else torch.tensor(r.lengths),
            top_k_logprobs=r.top_logprobs,
            ends_at=ends_at,
            each_step=r.each_step,
        )

    def weights_changed(self) -> None:
        """The replica's model was updated in place: nothing else to do."""


class VLLMEngine:
    """An in-process vLLM engine (vLLM 0.33 API) started from the replica's HF
    model; `weights_changed` loads the model's current tensors into it."""

    def __init__(
        self,
        model: torch.nn.Module,
        model_cfg: ModelConfig,
        pad_id: int,
        stop_ids: list[int],
        seed: int,
        gpu_memory_utilization: float,
        max_model_len: int,
    ):
        missing = vllm_missing()
        if missing:
            raise EngineUnavailable(f"config key 'policy.engine': {missing}")
        # The engine in this process, so that its model can be written in place.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import vllm

        self.model, self.pad_id, self.stop_ids = model, pad_id, stop_ids
        path = model_cfg.path
        if path is None:  # the embedded model: vLLM loads from a directory
            self._dir = tempfile.TemporaryDirectory(prefix="meshrl-vllm-")
            path = self._dir.name
            from meshrl.model.tokenizer import load_tokenizer

            model.save_pretrained(path)
            load_tokenizer(model_cfg).save_pretrained(path)
        self.llm = vllm.LLM(
            model=path,
            dtype=model_cfg.dtype,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            logprobs_mode="processed_logprobs",  # after temperature, min_tokens and top-p
        )
        self.weights_changed()

    def generate(self, request: Request) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As `HFEngine.generate` (`each_step` is not called: vLLM's offline
        generate returns whole completions, which a stream then sends at once)."""
        import vllm

        if request.images is not None:
            raise EngineUnavailable("config key 'policy.engine': vllm takes no images yet; use hf")
        generation, prompts, seeds = request.generation, request.prompts, request.seeds
        lengths, top_logprobs = request.lengths, request.top_logprobs
        if seeds is None:  # one per request from the replica's generator: reproducible
            seeds = torch.randint(
                0, 2**31 - 1, (len(prompts),), generator=request.generator
            ).tolist()
        seeds = [seed % (2**31 - 1) for seed in seeds]  # the controller's: vLLM takes 31 bits
        params = [
            vllm.SamplingParams(
                n=1,
                temperature=generation.temperature,
                top_p=generation.top_p,
                max_tokens=generation.max_new_tokens if length is None else length,
                # The sampled token's own log-prob, and the k most likely beside it.
                logprobs=top_logprobs,
                stop_token_ids=list(self.stop_ids),
                min_tokens=generation.min_new_tokens if length is None else length,
                seed=seed,
                # Ends at the token that completes one, which stays in token_ids.
                stop=list(request.stops or []),
                include_stop_str_in_output=True,
            )
            for seed, length in zip(seeds, lengths or [None] * len(seeds), strict=True)
        ]
        outputs = self.llm.generate(
            [vllm.TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        width = max(1, max(len(o.outputs[0].token_ids) for o in outputs))
        tokens = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        logprobs = torch.zeros(len(prompts), width)
        completion_mask = torch.zeros(len(prompts), width)
        for row, output in enumerate(outputs):
            out = output.outputs[0]
            ids_out = list(out.token_ids)
            tokens[row, : len(ids_out)] = torch.tensor(ids_out, dtype=torch.long)
            logprobs[row, : len(ids_out)] = torch.tensor(
                [step[token].logprob for step, token in zip(out.logprobs, ids_out, strict=True)]
            )
            completion_mask[row, : len(ids_out)] = 1
        if top_logprobs:
            request.stats["top_logprobs"] = self._top(outputs, width, top_logprobs)
        # No `entropy_rows`: vLLM does not return the full distribution.
        return tokens, logprobs, completion_mask

    def _top(self, outputs, width: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's k most likely tokens of each step (by their rank: the sampled
        token comes beside them when it is not one of them) as [B, T, k] tensors."""
        values = torch.full((len(outputs), width, k), -float("inf"))
        ids = torch.full((len(outputs), width, k), self.pad_id, dtype=torch.long)
        for row, output in enumerate(outputs):
            for step, candidates in enumerate(output.outputs[0].logprobs):
                ranked = sorted(
                    (c for c in candidates.items() if c[1].rank is not None and c[1].rank <= k),
                    key=lambda c: c[1].rank,
                )[:k]
                for j, (token, logprob) in enumerate(ranked):
                    values[row, step, j], ids[row, step, j] = logprob.logprob, token
        return values, ids

    def weights_changed(self) -> None:
        """Load the HF model's tensors (just pulled) into vLLM's layers, which fuse
        some of them (qkv, gate_up): its `load_weights` maps the HF names."""
        weights = [(name, p.detach()) for name, p in self.model.named_parameters()]
        runner = self.llm.llm_engine.model_executor.driver_worker.model_runner
        runner.model.load_weights(weights=weights)
        self.llm.reset_prefix_cache()  # cached prefixes were computed by the old weights


def make_engine(
    policy_cfg: PolicyConfig,
    model: torch.nn.Module,
    model_cfg: ModelConfig,
    pad_id: int,
    stop_ids: list[int],
    seed: int,
    max_model_len: int = 2048,
    decode: Callable[[list[int]], str] | None = None,
):
    if policy_cfg.engine == "vllm":
        return VLLMEngine(
            model,
            model_cfg,
            pad_id,
            stop_ids,
            seed,
            policy_cfg.gpu_memory_utilization,
            max_model_len,
        )
    return HFEngine(model, pad_id, stop_ids, policy_cfg, decode)
