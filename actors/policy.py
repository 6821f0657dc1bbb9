"""Policy replica: generates completions with a KV cache from the current weights.

One replica per proc of the policy mesh. Tokens in, tokens out: prompts arrive
as token ids, completions leave as token ids with the sampling log-prob of each
token and the weight version that produced them.
"""

from __future__ import annotations

import os
import time

import torch
from monarch.actor import Actor, endpoint

from meshrl.config import GenerationConfig, ModelConfig, PolicyConfig
from meshrl.loop.checkpoint import read
from meshrl.model.engines import make_engine
from meshrl.model.models import device_for_this_proc, load_model, stop_token_ids
from meshrl.model.routing import moe_problem, routers
from meshrl.model.tokenizer import load_tokenizer
from meshrl.observe.telemetry import observed, proc_rank, record
from meshrl.procs.faults import Drillable
from meshrl.types import Completions
from meshrl.weights.publisher import TornWeights, WeightHandle
from meshrl.weights.receiver import Pulled, WeightReceiver


class Policy(Drillable, Actor):
    role = "policy"

    def __init__(
        self,
        model_cfg: ModelConfig,
        seed: int = 0,
        policy_cfg: PolicyConfig | None = None,
        context: int = 2048,
        shm_prefix: str | None = None,
    ):
        """`context`: prompt + completion tokens the engine must hold (vllm).
        `shm_prefix`: names this replica's shared-memory files when it relays
        weights (the run's, so the run removes them even if the proc dies)."""
        policy_cfg = policy_cfg or PolicyConfig()
        self.device = device_for_this_proc()
        self.model = load_model(model_cfg, seed).to(self.device).eval()
        if policy_cfg.dtype:  # a sampler in its own precision (pulls cast: weights.publisher)
            self.model.to(getattr(torch, policy_cfg.dtype))
        tokenizer = load_tokenizer(model_cfg)
        self.pad_id = tokenizer.pad_token_id
        # One stop set for every engine: the tokenizer's EOS and the model's own.
        self.stop_ids = stop_token_ids(self.model, tokenizer)
        # Every engine's weights come through this model: pulled in place by version.
        # hf on the trainer's host: served straight from the published slot (no copy).
        self.weights = WeightReceiver(self.model, zero_copy=policy_cfg.engine == "hf")
        self.shm_prefix = shm_prefix
        if policy_cfg.record_routes and not routers(self.model):
            raise ValueError(
                f"config key 'policy.record_routes': {moe_problem(self.model.config.model_type)}"
            )
        self.engine = make_engine(
            policy_cfg, self.model, model_cfg, self.pad_id, self.stop_ids, seed, context
        )
        # Each replica samples its own stream, reproducibly. (On the CPU: vLLM
        # takes its requests' seeds from it.)
        device = self.device if policy_cfg.engine == "hf" else "cpu"
        self.rank = proc_rank()  # read here: endpoints see no rank
        self.weights.owner = f"{self.role}[{self.rank}]"
        self.generator = torch.Generator(device).manual_seed(seed * 1009 + self.rank)

    @endpoint
    @observed
    def generate(
        self,
        prompt_ids: list[list[int]],
        generation: GenerationConfig,
        seeds: list[int] | None = None,
        images: tuple[torch.Tensor, torch.Tensor] | None = None,
        record_batch: bool = True,
    ) -> Completions:
        """Sample one completion per prompt (repeat a prompt to get a group).
        `seeds`: each row's sampling seed (the controller's, so a sample does not
        depend on the replica that draws it); None: from this replica's generator.
        `images`: the rows' pixels [B, I, C, H, W] and image counts [B]
        (`meshrl.model.vision`), returned with the completions for the trainer.
        `record_batch`: record this call's entropy and lengths (`policy/*`); work by
        pull computes them from each step's trained groups instead (the calls that
        run during a step are timing there), from the completions' `entropy`."""
        self.drill("generate")
        if self.weights.torn:
            raise RuntimeError("the last weight pull failed: pull a complete version first")
        self.check_intact()
        started = time.perf_counter()
        # Left-padded, made in one go (a tensor write per row cost more than a decode step).
        width = max(len(p) for p in prompt_ids)
        pads = [width - len(p) for p in prompt_ids]
        ids = torch.tensor(
            [[self.pad_id] * n + list(p) for n, p in zip(pads, prompt_ids, strict=True)]
        )
        mask = torch.tensor([[0.0] * n + [1.0] * (width - n) for n in pads])
        stats: dict = {}
        tokens, logprobs, completion_mask = self.engine.generate(
            ids.to(self.device),
            mask.to(self.device),
            prompt_ids,
            generation,
            self.generator,
            stats,
            seeds,
            None if images is None else tuple(t.to(self.device) for t in images),
        )
        self.drag(started)  # a `faults.slow` drill: a slower replica, whose records come later
        tokens_out = completion_mask.sum().item()
        record("time/policy/tokens_per_s", tokens_out / (time.perf_counter() - started), "mean")
        self.check_intact()  # nothing sampled from a slot rewritten meanwhile leaves
        completions = Completions(
            prompt_ids=ids,
            prompt_mask=mask,
            completion_ids=tokens.cpu(),
            completion_mask=completion_mask.cpu(),
            logprobs=logprobs.cpu(),
            weight_version=self.weights.version,
            routes=stats.get("routes"),
            images=None if images is None else images[0],
            image_counts=None if images is None else images[1],
            entropy=None if "entropy_rows" not in stats else stats["entropy_rows"].cpu(),
        )
        if record_batch:
            for key, (value, reduce) in completions.policy_metrics().items():
                record(key, value, reduce)
        return completions

    def check_intact(self) -> None:
        """Served in place from the trainer's slots: they must still hold this
        replica's version (a replica that missed a pull would otherwise serve
        whatever the trainer writes there next)."""
        if not self.weights.intact():
            raise TornWeights(
                f"{self.weights.owner}: version {self.weights.version} was overwritten in "
                "the trainer's shared memory before this replica pulled a newer one; "
                "every publish must be pulled before the next"
            )

    @endpoint
    @observed
    def load_weights(
        self, handle: WeightHandle, serve: bool = False, timeout_s: float | None = None
    ) -> Pulled:
        """Pull a published version into this replica: the version now served, how
        it came ('shm' or 'rdma'), and with `serve` the handle from which other
        replicas can pull it from this one (a relay)."""
        skip = self.armed("skip_pull")
        pulled = self.weights.pull(handle, serve, self.shm_prefix, timeout_s, skip_copy=skip)
        self.engine.weights_changed()
        return pulled

    @endpoint
    def host_id(self) -> str:
        """This replica's host (`meshrl.weights.publisher.host_id`): replicas of one host
        copy weights from each other's shared memory."""
        return self.weights.host

    @endpoint
    def set_rng_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)

    @endpoint
    def save_state(self, directory: str) -> None:
        """This replica's part of a checkpoint: its sampling stream."""
        # Its rank now (a standby takes the rank of the replica it replaces).
        torch.save(self.generator.get_state().cpu(), f"{directory}/policy_rng_{proc_rank()}.pt")

    @endpoint
    def load_state(self, directory: str) -> None:
        path = f"{directory}/policy_rng_{proc_rank()}.pt"
        if os.path.exists(path):  # else: a replica the pool did not have then keeps its own
            self.generator.set_state(read(path))

    @endpoint
    def parameters(self) -> dict[str, torch.Tensor]:
        """A CPU copy of every parameter (for inspection and tests)."""
        return {name: p.detach().cpu().clone() for name, p in self.model.named_parameters()}
