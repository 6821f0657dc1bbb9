"""Policy replica: generates completions with a KV cache from the current weights.

One replica per proc of the policy mesh. Tokens in, tokens out: prompts arrive
as token ids, completions leave as token ids with the sampling log-prob of each
token and the weight version that produced them.
"""

from __future__ import annotations

import torch
from monarch.actor import Actor, current_rank, endpoint

from meshrl.config import GenerationConfig, ModelConfig
from meshrl.faults import Drillable
from meshrl.generation import sample
from meshrl.models import device_for_this_proc, load_model, load_tokenizer
from meshrl.types import Completions
from meshrl.weights import WeightHandle, WeightReceiver


class Policy(Drillable, Actor):
    def __init__(self, model_cfg: ModelConfig, seed: int = 0):
        self.device = device_for_this_proc()
        self.model = load_model(model_cfg, seed).to(self.device).eval()
        tokenizer = load_tokenizer(model_cfg)
        self.pad_id, self.eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
        self.weights = WeightReceiver(self.model)
        # Each replica samples its own stream, reproducibly.
        self.generator = torch.Generator(self.device).manual_seed(seed * 1009 + current_rank().rank)

    @endpoint
    def generate(self, prompt_ids: list[list[int]], generation: GenerationConfig) -> Completions:
        """Sample one completion per prompt (repeat a prompt to get a group)."""
        self.drill("generate")
        if self.weights.torn:
            raise RuntimeError("the last weight pull failed: pull a complete version first")
        width = max(len(p) for p in prompt_ids)
        ids = torch.full((len(prompt_ids), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(prompt_ids), width)
        for row, prompt in enumerate(prompt_ids):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        tokens, logprobs, completion_mask = sample(
            self.model,
            ids.to(self.device),
            mask.to(self.device),
            max_new_tokens=generation.max_new_tokens,
            eos_token_id=self.eos_id,
            pad_token_id=self.pad_id,
            temperature=generation.temperature,
            top_p=generation.top_p,
            generator=self.generator,
        )
        return Completions(
            prompt_ids=ids,
            prompt_mask=mask,
            completion_ids=tokens.cpu(),
            completion_mask=completion_mask.cpu(),
            logprobs=logprobs.cpu(),
            weight_version=self.weights.version,
        )

    @endpoint
    def load_weights(self, handle: WeightHandle) -> tuple[int, str]:
        """Pull a published version into this replica; returns the version now
        served and how it came ('shm' or 'rdma')."""
        self.weights.pull(handle)
        return self.weights.version, self.weights.path

    @endpoint
    def rng_state(self) -> torch.Tensor:
        """This replica's sampling generator state (for checkpoints)."""
        return self.generator.get_state().cpu()

    @endpoint
    def set_rng_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)

    @endpoint
    def parameters(self) -> dict[str, torch.Tensor]:
        """A CPU copy of every parameter (for inspection and tests)."""
        return {name: p.detach().cpu().clone() for name, p in self.model.named_parameters()}
