"""Policy replica: generates completions with a KV cache from the current weights.

One replica per proc of the policy mesh. Tokens in, tokens out: prompts arrive
as token ids, completions leave as token ids with the sampling log-prob of each
token and the weight version that produced them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
from monarch.actor import Actor, concurrent_endpoint, endpoint

from meshrl.config import GenerationConfig, ModelConfig, PolicyConfig
from meshrl.model.continuous import ContinuousEngine, Settings
from meshrl.model.engines import Request, make_engine
from meshrl.model.files import read
from meshrl.model.generation import drilled_lengths, left_padded
from meshrl.model.models import device_for_this_proc, load_model, stop_token_ids
from meshrl.model.routing import moe_problem, routers
from meshrl.model.tokenizer import load_tokenizer
from meshrl.observe.telemetry import observed, proc_rank, record
from meshrl.procs.faults import Drillable
from meshrl.types import Completions
from meshrl.weights.precision import FP8, check_precisions, to_precision
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
        role_name: str = "policy",
        partial: bool = False,
        lengths: tuple[int, float, int] | None = None,
        tp: int = 1,
        leader: bool = True,
    ):
        """`context`: prompt + completion tokens the engine must hold (vllm).
        `shm_prefix`: names this replica's shared-memory files when it relays
        weights (the run's, so the run removes them even if the proc dies).
        `role_name`: its role, by which its `PolicyStream` finds it (`policy.continuous`).
        `partial` (`rollout.partial`): a weight pull does not wait for the rows under way.
        `lengths`: each row's exact length, drawn from its seed (`faults.completion_lengths`).
        `tp` > 1 (`placement.policy_tp`): this replica's model is split over `tp` procs
        with tensor parallelism: a `leader` (the proc the controller calls, rank i of
        its role) and `tp - 1` followers (procs of the role `<role>_tp`, which
        `follow` hands it), split once they `join` their process group. The leader
        runs each call on its followers too, with the same seeds: every proc
        computes the same logits, so samples the same tokens."""
        policy_cfg = policy_cfg or PolicyConfig()
        self.device = device_for_this_proc()
        self.model = load_model(model_cfg, seed).to(self.device).eval()
        # A sampler in its own precision (`policy.precision`): it reads the trainer's
        # bytes of that precision (`meshrl.weights.precision`).
        precision = policy_cfg.precision_for(model_cfg.dtype)
        check_precisions("fp32", (precision,), model_cfg.dtype)
        to_precision(self.model, precision)
        self.followers = None  # a tensor-parallel leader's: `follow`
        self.tp, self.leader = tp, leader
        tokenizer = load_tokenizer(model_cfg)
        self.pad_id = tokenizer.pad_token_id
        # One stop set for every engine: the tokenizer's EOS and the model's own.
        self.stop_ids = stop_token_ids(self.model, tokenizer)
        # Every engine's weights come through this model: pulled in place by version.
        # hf on the trainer's host: served straight from the published slot (no copy).
        self.zero_copy = policy_cfg.engine == "hf"
        self.weights = WeightReceiver(self.model, zero_copy=self.zero_copy)
        self.shm_prefix = shm_prefix
        if policy_cfg.record_routes and not routers(self.model):
            raise ValueError(
                f"config key 'policy.record_routes': {moe_problem(self.model.config.model_type)}"
            )
        decode = functools.partial(tokenizer.decode, skip_special_tokens=True)
        self.engine = make_engine(
            policy_cfg, self.model, model_cfg, self.pad_id, self.stop_ids, seed, context, decode
        )
        # Each replica samples its own stream, reproducibly. (On the CPU: vLLM
        # takes its requests' seeds from it.)
        device = self.device if policy_cfg.engine == "hf" else "cpu"
        self.rank = proc_rank()  # read here: endpoints see no rank
        self.weights.owner = f"{self.role}[{self.rank}]"
        self.generator = torch.Generator(device).manual_seed(seed * 1009 + self.rank)
        self.lengths = lengths
        self.partial, self.continuous = partial, None
        if policy_cfg.continuous:
            self.continuous = ContinuousEngine(
                self.model,
                self.pad_id,
                self.stop_ids,
                policy_cfg.max_rows,
                lambda: self.weights.version,
                policy_cfg.share_prefix,
            )
            _streams[role_name] = self

    @endpoint
    @observed
    def generate(
        self,
        prompt_ids: list[list[int]],
        generation: GenerationConfig,
        seeds: list[int] | None = None,
        images: tuple[torch.Tensor, torch.Tensor] | None = None,
        record_batch: bool = True,
        stops: list[str] | None = None,
    ) -> Completions:
        """Sample one completion per prompt (repeat a prompt to get a group).
        `seeds`: each row's sampling seed (the controller's, so a sample does not
        depend on the replica that draws it); None: from this replica's generator.
        `images`: the rows' pixels [B, I, C, H, W] and image counts [B]
        (`meshrl.model.vision`), returned with the completions for the trainer.
        `record_batch`: record this call's entropy and lengths (`policy/*`); work by
        pull computes them from each step's trained groups instead (the calls that
        run during a step are timing there), from the completions' `entropy`.
        `stops`: strings that end a row at the token completing one (the endpoint's
        `stop`; a tensor-parallel group's procs all get them)."""
        return self._generate(prompt_ids, generation, seeds, images, record_batch, 0, stops)[0]

    @endpoint
    @observed
    def generate_top(
        self,
        prompt_ids: list[list[int]],
        generation: GenerationConfig,
        seeds: list[int] | None = None,
        top_logprobs: int = 0,
        stops: list[str] | None = None,
        progress: Any = None,
    ) -> tuple[Completions, tuple[torch.Tensor, torch.Tensor] | None]:
        """`generate` for the OpenAI-compatible endpoint (`meshrl.envs.endpoint`):
        with `top_logprobs` > 0 also each step's that many most likely tokens, as
        (log-probs, ids) [B, T, k] under the distribution each token was drawn
        from; None with 0. `generation.temperature` 0 is greedy decoding. `stops`:
        the request's stop strings: a row ends at the token that completes one.
        `progress`: a Monarch `Port` that gets each step's drawn tokens as they
        come, `[(row, token, logprob, top), ...]` (`top`: [(id, log-prob)] with
        `top_logprobs`, else None), then None once the call has sampled (the
        endpoint's streams)."""
        each_step = None
        if progress is not None:

            def each_step(rows, tokens, logprobs, top) -> None:
                tops = [None] * len(rows)
                if top is not None:
                    tops = [
                        list(zip(i, v, strict=True))
                        for v, i in zip(*map(torch.Tensor.tolist, top), strict=True)
                    ]
                progress.send(
                    list(zip(rows.tolist(), tokens.tolist(), logprobs.tolist(), tops, strict=True))
                )

        try:
            completions, stats = self._generate(
                prompt_ids, generation, seeds, None, True, top_logprobs, stops, each_step
            )
        finally:
            if progress is not None:
                progress.send(None)
        top = stats.get("top_logprobs")
        return completions, None if top is None else tuple(t.cpu() for t in top)

    def _generate(
        self,
        prompt_ids: list[list[int]],
        generation: GenerationConfig,
        seeds: list[int] | None,
        images: tuple[torch.Tensor, torch.Tensor] | None,
        record_batch: bool,
        top_logprobs: int = 0,
        stops: list[str] | None = None,
        each_step: Any = None,
    ) -> tuple[Completions, dict]:
        """`generate`'s work; returns the engine's `stats` beside the completions."""
        self.drill("generate")
        self.check_serving()
        started = time.perf_counter()
        ids, mask = left_padded(prompt_ids, self.pad_id)
        stats: dict = {}
        # The drill draws lengths from seeds; a tensor-parallel group samples by them alike.
        if seeds is None and (self.lengths is not None or self.followers is not None):
            seeds = self.draw_seeds(len(prompt_ids))
        # (Stop strings end rows, which changes the decode batch: the followers too.)
        following = self._lead("generate", prompt_ids, generation, seeds, images, False, stops)
        # (A call beside the running batch, e.g. evaluation's: it runs between its steps.)
        paused = self.continuous.paused() if self.continuous else contextlib.nullcontext()
        with self._group_call(following, "generate"), paused:
            tokens, logprobs, completion_mask = self.engine.generate(
                Request(
                    ids.to(self.device),
                    mask.to(self.device),
                    prompt_ids,
                    generation,
                    self.generator,
                    stats,
                    seeds,
                    None if images is None else tuple(t.to(self.device) for t in images),
                    None if self.lengths is None else drilled_lengths(seeds, self.lengths),
                    top_logprobs,
                    stops,
                    each_step,
                )
            )
        self.drag(started)  # a `faults.slow` drill: a slower replica, whose records come later
        if "occupancy" in stats:
            record("policy/batch_occupancy", stats["occupancy"], "mean")
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
        return completions, stats

    @endpoint
    def join(self, masters: list[tuple[str, int]]) -> None:
        """Form this proc's tensor-parallel group (`tp` > 1) at `masters[i]`, replica
        i's store (`RoleMeshes.rendezvous_each`), and split the model over it; every
        proc of the group must be called at once."""
        from meshrl.procs.parallel import Ranks, data_parallel

        rank, tp = proc_rank(), self.tp
        group, tp_rank = (rank, 0) if self.leader else (rank // (tp - 1), 1 + rank % (tp - 1))
        # A call that fails on one proc of the group leaves the others waiting in a
        # collective: they fail too after this long, instead of torch's half hour.
        wait_s = timedelta(seconds=300)
        data_parallel(
            self.model, Ranks(self.device, tp_rank, tp, masters[group], None, wait_s), "tp", tp
        )
        owner = self.weights.owner  # the split parameters are new ones: a receiver of them
        self.weights = WeightReceiver(self.model, zero_copy=self.zero_copy)
        self.weights.owner = owner
        self.weights.publishes_whole = self.leader  # its relay: see `load_weights`

    @endpoint
    def follow(self, followers) -> None:
        """The other procs of this tensor-parallel replica (a slice of `Policy`s
        of the role `<role>_tp`): from now on each call that runs the model or
        moves its weights runs on them too."""
        self.followers = followers

    def _lead(self, endpoint_name: str, *args):
        """The same call on this leader's followers, under way (None: none)."""
        if self.followers is None:
            return None
        return getattr(self.followers, endpoint_name).call(*args)

    def _followed(self, pending, what: str) -> list:
        """Wait for the followers' part of a call (`_lead`) and return their answers:
        an error there is this call's error."""
        if pending is None:
            return []
        from meshrl.procs.mesh import wait

        answers = wait(pending, f"{self.weights.owner}'s tensor-parallel followers: {what}", 600)
        return [answer for _, answer in answers.items()]

    @contextlib.contextmanager
    def _group_call(self, pending, what: str):
        """A call that runs collectives over the group (`generate`): if it fails
        here or on a follower, the group's procs may be stuck in a collective or
        out of step, so this leader ends its proc. The controller then sees the
        replica lost and replaces the whole group (`Algorithm.group_replicas`)."""
        try:
            yield
            self._followed(pending, what)
        except BaseException as error:
            if pending is None:
                raise
            self._end_group(what, error)

    def _end_group(self, what: str, error: BaseException) -> None:
        print(
            f"{self.weights.owner}: its tensor-parallel group failed in {what} "
            f"({type(error).__name__}: {error}); ending this proc so the group is replaced",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    def check_serving(self) -> None:
        """The weights served are one whole version, still in place."""
        if self.weights.torn:
            raise RuntimeError("the last weight pull failed: pull a complete version first")
        self.check_intact()

    def draw_seeds(self, rows: int) -> list[int]:
        on = self.generator.device
        return torch.randint(-(2**62), 2**62, (rows,), generator=self.generator, device=on).tolist()

    def submit(
        self,
        prompt_ids: list[list[int]],
        generation: GenerationConfig,
        seeds: list[int] | None,
        images: tuple | None,
        done,
    ) -> None:
        """`generate` through the running decode batch (`PolicyStream`): the rows
        join it; `done(result)` is called from the decode thread when they ended."""
        self.drill("generate")
        if images is not None:
            raise ValueError("config key 'policy.continuous': images are sampled by the batch path")
        with self.continuous.paused():  # (not while a pull repoints the weights)
            self.check_serving()
        seeds = self.draw_seeds(len(prompt_ids)) if seeds is None else seeds
        settings = Settings(
            generation.max_new_tokens,
            generation.temperature,
            generation.top_p,
            generation.min_new_tokens,
        )
        lengths = None if self.lengths is None else drilled_lengths(seeds, self.lengths)
        self.continuous.submit(prompt_ids, seeds, settings, done, lengths)

    def completed(
        self, prompt_ids: list[list[int]], result: dict, record_batch: bool
    ) -> Completions:
        """A `submit`'s answer, as `generate` returns it: each token's version kept."""
        with self.continuous.paused():  # (not while a pull repoints the weights)
            self.check_intact()
        ids, prompt_mask = left_padded(prompt_ids, self.pad_id)
        mask = result["mask"]
        versions = result["versions"]
        record("time/policy/tokens_per_s", mask.sum().item() / result["seconds"], "mean")
        occupancy = self.continuous.occupancy()
        if occupancy is not None:
            record("policy/batch_occupancy", occupancy, "mean")
        completions = Completions(
            prompt_ids=ids,
            prompt_mask=prompt_mask,
            completion_ids=result["tokens"],
            completion_mask=mask,
            logprobs=result["logprobs"],
            weight_version=int(versions[mask > 0].min()),
            token_versions=versions,
            entropy=result["entropy"],
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
        if self.continuous is None:
            following = self._lead("load_weights", handle, serve, timeout_s)
            pulled = self.weights.pull(handle, serve, self.shm_prefix, timeout_s, skip_copy=skip)
            try:
                answers = self._followed(following, "load_weights")
            except BaseException as error:  # a follower lost: its half of the weights with it
                self._end_group("load_weights", error)
            self.engine.weights_changed()
            if answers:  # a tensor-parallel replica: what its group moved, and relays
                pulled = dataclasses.replace(
                    pulled,
                    rdma_bytes=pulled.rdma_bytes + sum(a.rdma_bytes for a in answers),
                    bytes_moved=pulled.bytes_moved + sum(a.bytes_moved for a in answers),
                    verified=pulled.verified and all(a.verified for a in answers),
                    version_bytes=pulled.version_bytes + sum(a.version_bytes for a in answers),
                    relay=WeightHandle.merge([a.relay for a in [pulled, *answers]])
                    if serve
                    else None,
                )
            return pulled
        if not self.partial:  # every row is sampled by one version
            self.continuous.wait_idle(timeout_s or 600.0)
        with self.continuous.paused():  # between two decode steps
            pulled = self.weights.pull(handle, serve, self.shm_prefix, timeout_s, skip_copy=skip)
            self.engine.weights_changed()
            record("rollout/refilled_rows", self.continuous.refill(), "sum")
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
        """A CPU copy of every parameter, whole (for inspection and tests); FP8
        ones as their bytes (uint8: torch does not pickle float8 tensors)."""
        from meshrl.procs.parallel import full_parameters

        following = self._lead("parameters")
        whole = {}
        for name, param in full_parameters(self.model):
            if param.dtype == FP8:
                param = param.view(torch.uint8)
            whole[name] = param.detach().cpu().clone()
        self._followed(following, "parameters")
        return whole


_streams: dict[str, Policy] = {}  # this proc's replicas by role (`Policy(role_name=...)`)


class PolicyStream(Actor):
    """`Policy.generate` through the replica's running decode batch
    (`policy.continuous`), beside the `Policy` of role `role_name` on the same proc.

    Its endpoint is concurrent: calls under way wait here, their rows decoding in
    one batch on the replica's decode thread, while the replica's own endpoints
    (a weight pull) go on. A Monarch actor's endpoints are all sync or all async,
    hence an actor of its own."""

    def __init__(self, role_name: str = "policy"):
        self.role_name = role_name

    @concurrent_endpoint
    async def generate(
        self,
        prompt_ids: list[list[int]],
        generation: GenerationConfig,
        seeds: list[int] | None = None,
        images: tuple[torch.Tensor, torch.Tensor] | None = None,
        record_batch: bool = True,
    ) -> Completions:
        """As `Policy.generate` (no stop strings: the endpoint's calls go to
        `Policy.generate_top`); the completions carry each token's version."""
        for _ in range(600):  # the replica's __init__ may still run (spawned just before)
            policy = _streams.get(self.role_name)
            if policy is not None:
                break
            await asyncio.sleep(0.1)
        else:
            raise RuntimeError(
                f"{self.role_name}: no policy replica with a running batch on this proc"
            )
        loop = asyncio.get_running_loop()
        answer = loop.create_future()

        def settle(result) -> None:
            if answer.done():
                return
            if isinstance(result, BaseException):
                answer.set_exception(result)
            else:
                answer.set_result(result)

        policy.submit(
            prompt_ids, generation, seeds, images, lambda r: loop.call_soon_threadsafe(settle, r)
        )
        return policy.completed(prompt_ids, await answer, record_batch)
