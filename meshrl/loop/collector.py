"""A step's rollouts on the controller: prompts drawn, completions collected from
the policy replicas, rewards from the environment (and a reward model), failed
groups replaced, and every sample entered in the ledger.

The loop sends generation itself (`policy.slice(procs=i).generate.call_one`)
into a `Batch` laid out here (`Collector.layout`); `finish(batch)` collects
it and scores it. A lost proc is replaced and the call made again (the
`Supervisor`); what a failed generation produced is counted as dropped
again (`policy_lost`, counted as redone), a batch more than `max_staleness` versions old is generated
again (`stale`), and a group with a failed episode is replaced by new prompts
(`env_failed`). Multi-turn episodes (`meshrl.envs.rollout`) are played in `finish`.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from meshrl.envs.rollout import ChatFormat, encode_prompts, run_episodes, to_completions
from meshrl.model.tokenizer import max_token_chars
from meshrl.model.vision import shard
from meshrl.procs.mesh import RemoteCallError, split, start_each, wait
from meshrl.types import Completions, Prompt

logger = logging.getLogger(__name__)

ENDPOINT_COUNTS = (
    ("refused", "episodes/refused_calls"),
    ("tool_call_errors", "episodes/tool_call_errors"),
    ("tool_choice_unmet", "episodes/tool_choice_unmet"),
)
"""The endpoint's counters (`PolicyServer`) logged per step, as the step's increase:
calls to episodes that are not theirs, tool-call text that did not parse, answers
without the call `tool_choice` asked for."""


class PromptTooLong(ValueError):
    """A prompt does not fit the model's context; one line."""


@dataclass
class Batch:
    """One step's generation: laid out, sent to the replicas, collected later."""

    prompts: list[Prompt]
    group: list[Prompt]  # each prompt group_size times
    shards: list[tuple[list[list[int]], list[int], Any]]
    """Per replica: its prompts' token ids, each row's sampling seed, and its rows'
    (pixels [B, I, C, H, W], image counts [B]) (`meshrl.model.vision`), or None."""
    published: int  # weight versions published when it was sent
    calls: list | None = None  # per replica: the generate future
    respawns: int = 0  # policy mesh replacements when it was sent
    started: float = field(default_factory=time.perf_counter)
    completions: Completions | None = None
    lost: int = 0
    counted: bool = False  # entered in the ledger as generated

    def __len__(self) -> int:
        return len(self.group)


class Collector:
    """`cfg`: an on-policy config (group_size, generation, task, max_staleness);
    `state`: the `LoopState` (its rng draws the prompts, its ledger counts the
    samples); `sup`: the `Supervisor`; `sync`: the `WeightSync`; `policy`,
    `environment` and `reward_model` the roles (`reward_model` may be None)."""

    max_refills = 3
    """Times in a row failed episodes' groups are sampled again before the run stops."""

    def __init__(
        self,
        cfg,
        state,
        sup,
        sync,
        tokenizer,
        task,
        context,
        policy,
        environment,
        reward_model=None,
        vision=None,
    ):
        self.cfg, self.state, self.sup, self.sync = cfg, state, sup, sync
        self.tokenizer, self.task, self.context = tokenizer, task, context
        self.format = ChatFormat(tokenizer)  # the chat template, when it has one
        self.vision = vision
        """A VLM's `meshrl.model.vision.VisionFormat`: prompts with images; None: text only."""
        self.policy, self.environment, self.reward_model = policy, environment, reward_model
        self.last_episodes: list = []
        self.held_out: set[str] = set()
        """Prompts training never draws, by `Prompt.key` (the held-out sets')."""
        self.server = None
        """The policy's OpenAI-compatible endpoint (`endpoint()`), once started."""
        self._reported: dict[str, int] = {}  # the endpoint's counts already logged
        self._overlong: dict[str, str] = {}  # prompt key -> its length, for prompts that do not fit
        self._token_chars = max_token_chars(tokenizer)  # a text over room x this cannot fit

    # --- prompts --------------------------------------------------------------------------

    def sample_prompts(self, num_prompts: int, rng: random.Random | None = None) -> list[Prompt]:
        """`num_prompts` prompts from the task that fit the model's context with
        `generation.max_new_tokens` to spare, drawn with `rng` (the loop's by
        default). A prompt that does not is skipped and another drawn
        (`samples/skipped_overlong_prompts`), or is an error
        (`generation.overlong_prompt=error`)."""
        generation, rng = self.cfg.generation, rng or self.state.rng
        room = self.context - generation.max_new_tokens
        prompts: list[Prompt] = []
        message = "every prompt drawn is held out for evaluation (eval.sets)"
        for _ in range(100):  # draws of a batch, before concluding nothing fits
            drawn = self.task.sample(num_prompts - len(prompts), rng)
            # A prompt found too long once is not tokenized again (a 2 MB row
            # drawn at every step would cost each step its tokenizing), nor one
            # whose characters alone cannot fit.
            fresh = {
                p.key: p
                for p in drawn
                if p.key not in self._overlong and len(p.text) <= room * self._token_chars
            }
            encoded = self.encode(list(fresh.values()))[0] if fresh else []
            lengths = {key: len(ids) for key, ids in zip(fresh, encoded, strict=True)}
            for prompt in drawn:
                if prompt.key in self.held_out:
                    continue
                if prompt.key in lengths:
                    if lengths[prompt.key] <= room:
                        prompts.append(prompt)
                        continue
                    self._overlong[prompt.key] = f"{lengths[prompt.key]} tokens"
                elif prompt.key not in self._overlong:
                    self._overlong[prompt.key] = (
                        f"more than {room} tokens ({len(prompt.text)} characters)"
                    )
                message = (
                    f"a prompt of {self._overlong[prompt.key]} does not fit the model's "
                    f"context of {self.context} with generation.max_new_tokens="
                    f"{generation.max_new_tokens}: {prompt.text[:40]!r}"
                )
                if generation.overlong_prompt == "error":
                    raise PromptTooLong(f"{message} (generation.overlong_prompt=skip skips it)")
                self.state.count("skipped_prompts")
            if len(prompts) == num_prompts:
                return prompts
        raise PromptTooLong(f"no prompt fits: {message}")

    def encode(self, prompts: list[Prompt]) -> tuple[list[list[int]], list]:
        """The prompts' token ids and each one's pixels (None without images):
        where an episode is built, image placeholders are expanded, once."""
        return encode_prompts(self.format, self.vision, prompts, f"task '{self.cfg.task.name}'")

    def layout(self, prompts: list[Prompt], draw: bool = True) -> Batch:
        """`group_size` copies of each prompt, their token ids split evenly over
        the replicas (`Batch.shards`), nothing sent yet.

        Each row's sampling seed is drawn here, from the loop's generator (saved
        in checkpoints), so a sample's tokens follow the sample, not the replica
        that generates it: the same at any number of replicas, after a pool
        grows or shrinks (`draw=False`: a restored batch, already generated)."""
        k = self.cfg.group_size
        encoded, pixels = self.encode(prompts)
        ids = [i for i in encoded for _ in range(k)]
        pixels = [x for x in pixels for _ in range(k)]
        seeds = [0] * len(ids)
        if draw:
            seeds = torch.randint(
                -(2**62), 2**62, (len(ids),), generator=self.state.torch_rng
            ).tolist()
        n = self.policy.size
        images = [shard(part) for part in split(pixels, n)]
        return Batch(
            prompts,
            [p for p in prompts for _ in range(k)],
            list(zip(split(ids, n), split(seeds, n), images, strict=True)),
            self.sync.published,
            respawns=self.policy.respawns,
        )

    def start(self, prompts: list[Prompt]) -> Batch:
        """Lay out `prompts` and send their generation to the replicas."""
        batch = self.layout(prompts)
        if not self.task.multi_turn:
            batch.calls = start_each(self.policy, "generate", self.generate_args(batch))
        return batch

    def generate_args(self, batch: Batch) -> list[tuple]:
        """`Policy.generate`'s arguments for each replica's shard of `batch`."""
        return [(ids, self.cfg.generation, seeds, images) for ids, seeds, images in batch.shards]

    def ended(self, batch: Batch) -> None:
        """Wait until the generation sent ahead for `batch` has ended, without taking its
        answer (`collect` does, and handles a failure). The step being logged then holds
        what that generation recorded on its procs (`meshrl.observe.telemetry`) in every
        run alike, not only when it happened to end before the step's report."""
        for rank, call in enumerate(batch.calls or ()):
            # A failure is left to `collect`, which meets it again and recovers.
            with contextlib.suppress(RemoteCallError):
                wait(call, f"policy.generate[{rank}]", self.sup.timeout_s)

    # --- collecting and scoring -----------------------------------------------------------

    def generated(self, batch: Batch) -> None:
        """Take the answers of `batch`'s generation (sent ahead, or sent now), a
        failed replica's part generated again. Before a weight pull the loop calls
        it on the batches sent ahead (`WeightSync.before_pull`): a part generated
        again then has the version the batch was sent with (a replacement takes the
        version the replicas serve), as it would have had without the fault."""
        if batch.completions is not None:
            return
        args = self.generate_args(batch)
        started = (batch.calls, batch.respawns) if batch.calls is not None else None
        parts, repeats = self.sup.call(self.policy, "generate", args, started, independent=True)
        batch.completions = Completions.concat(parts, self.tokenizer.pad_token_id)
        shards = zip(repeats, batch.shards, strict=True)
        batch.lost = sum(n * len(ids) for n, (ids, _, _) in shards)

    def collect(self, batch: Batch) -> Completions:
        """A batch's completions. A policy proc that dies is replaced and a call that
        raised may be retried: the same generation (the same prompts and per-row
        seeds) is done again for the replicas whose call failed, and what they
        generate again is counted as redone (`policy_lost`), not as dropped; the
        other replicas' completions are kept."""
        self.generated(batch)
        if not batch.counted:
            batch.counted = True
            self.state.ledger.generated += len(batch)
            self.state.ledger.redo("policy_lost", batch.lost)
        return batch.completions

    def finish(self, batch: Batch) -> tuple[Completions, torch.Tensor, dict]:
        """The batch's completions [B = prompts x group], rewards [B] and metrics.
        A batch generated more than `max_staleness` versions ago is dropped
        (`stale`) and generated again."""
        started = time.perf_counter()
        if self.task.multi_turn:
            completions, rewards, info = self.play(batch.prompts)
        else:
            completions = self.collect(batch)
            info = {"time/generate_s": time.perf_counter() - batch.started}
            staleness = self.sync.published - batch.published
            if staleness > self.cfg.max_staleness:
                self.state.ledger.drop("stale", len(batch))
                batch = self.start(batch.prompts)
                completions, staleness = self.collect(batch), 0
            info["weights/staleness"] = staleness
            scored = time.perf_counter()
            completions, rewards = self.score(batch.group, completions, info)
            info["time/score_s"] = time.perf_counter() - scored
        rewards = self.add_model_reward(completions, rewards, info)
        info["time/rollout_s"] = time.perf_counter() - started
        return completions, rewards, info

    def generate_and_score(self, prompts: list[Prompt]) -> tuple[Completions, torch.Tensor, dict]:
        """`group_size` completions per prompt, generated now and scored."""
        return self.finish(self.start(prompts))

    def score(
        self, group: list[Prompt], completions: Completions, info: dict, refills: int = 0
    ) -> tuple[Completions, torch.Tensor]:
        """Rewards from the environment mesh, each proc scoring a contiguous part.
        Scoring that failed for a lost proc is done again on the same completions;
        the groups of episodes that failed are replaced by new prompts' (`refill`)."""
        n = self.environment.size
        shards = zip(split(group, n), split(completions.completion_lists(), n), strict=True)
        scores, _ = self.sup.call(self.environment, "score", list(shards), independent=True)
        rewards = torch.tensor([r for part, _ in scores for r in part])
        failures, offset = {}, 0
        for part, failed in scores:
            failures.update({offset + row: reason for row, reason in failed.items()})
            offset += len(part)
        if not failures:
            return completions, rewards
        k = self.cfg.group_size
        groups = sorted({row // k for row in failures})
        self.count_failures(list(failures.values()), len(groups) * k, info, refills)
        keep = torch.tensor([r for r in range(len(rewards)) if r // k not in groups])
        new = self.start(self.sample_prompts(len(groups)))
        new_completions, new_rewards = self.score(new.group, self.collect(new), info, refills + 1)
        return (
            Completions.concat(
                [completions.rows(keep), new_completions], self.tokenizer.pad_token_id
            ),
            torch.cat([rewards[keep], new_rewards]),
        )

    def count_failures(self, reasons: list[str], dropped: int, info: dict, refills: int) -> None:
        if refills >= self.max_refills:
            raise RuntimeError(
                f"environment: episodes failed in {self.max_refills} refills in a row; "
                f"the last: {reasons[-1]}"
            )
        for reason in reasons:
            logger.warning("episode failed: %s", reason)
        self.state.ledger.drop("env_failed", dropped)
        self.state.count("episodes_failed", len(reasons))
        info["episodes/failed"] = info.get("episodes/failed", 0) + len(reasons)

    def play(self, prompts: list[Prompt]) -> tuple[Completions, torch.Tensor, dict]:
        """Multi-turn episodes (`meshrl.envs.rollout`): `group_size` per prompt, the
        model's turns on the policy replicas and the environment's replies on
        the environment procs, interleaved. A group with a failed episode is
        dropped (counted, its reasons logged) and new prompts played instead."""
        k, kept, info = self.cfg.group_size, [], {}
        roles = {"policy": self.policy, "environment": self.environment}
        for attempt in range(self.max_refills + 1):
            group = [p for p in prompts for _ in range(k)]
            key_prefix = f"{self.sync.published}.{attempt}."
            if getattr(self.task, "is_agent", False):  # your agent drives the endpoint
                episodes, timing = self.task.play(group, self.endpoint(), key_prefix)
            else:
                episodes, timing = run_episodes(
                    group,
                    lambda role: roles[role].actors,
                    self.policy.size,
                    self.environment.size,
                    self.format,
                    self.cfg.generation,
                    self.task.turns,
                    self.context,
                    self.sup.timeout_s,
                    on_lost=self.sup.recover,
                    key_prefix=key_prefix,
                    vision=self.vision,
                )
            self.state.ledger.generated += len(episodes)
            failed = {i // k for i, e in enumerate(episodes) if e.failed}
            kept += [e for i, e in enumerate(episodes) if i // k not in failed]
            if not failed:
                break
            reasons = [e.failed for e in episodes if e.failed]
            self.count_failures(reasons, len(failed) * k, info, attempt)
            prompts = self.sample_prompts(len(failed))
        completions, rewards = to_completions(kept, self.tokenizer.pad_token_id)
        mask, attention = completions.completion_mask, completions.attention
        info.update(
            {
                "time/generate_s": timing["time/episode_generate_s"],
                "time/episodes_s": timing["time/episodes_s"],
                "episodes/turns_mean": sum(e.turns for e in kept) / len(kept),
                "episodes/truncated": sum(e.truncated for e in kept),
                "tokens/environment": int((attention - mask).sum().item()),
            }
        )
        if self.server is not None:  # the endpoint's counts since the last step
            for name, metric in ENDPOINT_COUNTS:
                now = getattr(self.server, name)
                info[metric] = now - self._reported.get(name, 0)
                self._reported[name] = now
        self.last_episodes = kept
        return completions, rewards, info

    def endpoint(self, port: int = 0) -> Any:
        """The policy replicas' OpenAI-compatible endpoint on 127.0.0.1 (`meshrl.envs.endpoint`),
        started on first use; it samples at the run's generation settings."""
        if self.server is None:
            from meshrl.envs.endpoint import PolicyServer, Router

            router = Router(
                lambda: self.policy.actors,
                self.policy.size,
                self.cfg.generation,
                self.sup.timeout_s,
                on_lost=self.sup.recover,
            )
            self.server = PolicyServer(
                router, self.format, self.context, port, tool_parser=self.cfg.policy.tool_parser
            )
        return self.server

    def close(self) -> None:
        """Stop the endpoint (the task is its owner's to close: `Env.close`)."""
        if self.server is not None:
            self.server.close()
            self.server, self._reported = None, {}

    def add_model_reward(self, completions: Completions, rewards: torch.Tensor, info: dict):
        """With a reward model: rule_weight x the environment's reward + weight x
        the reward model's score of prompt + completion (both logged)."""
        if self.reward_model is None:
            return rewards
        cfg = self.cfg.reward_model
        prompts, texts = decode(self.tokenizer, completions)
        n = self.reward_model.size
        texts = [p + t for p, t in zip(prompts, texts, strict=True)]
        parts, _ = self.sup.call(
            self.reward_model, "score", [(c,) for c in split(texts, n)], independent=True
        )
        model = torch.tensor([s for part in parts for s in part])
        info["reward/rule_mean"] = rewards.mean().item()
        info["reward/model_mean"] = model.mean().item()
        return cfg.rule_weight * rewards + cfg.weight * model

    # --- batches generated ahead, in checkpoints ------------------------------------------

    def save(self, batch: Batch) -> tuple:
        """What a checkpoint keeps of a batch generated ahead (`collect` it first)."""
        assert batch.completions is not None and batch.counted, "collect the batch first"
        return batch.prompts, batch.completions, self.sync.published - batch.published

    def restore(self, saved: tuple) -> Batch:
        prompts, completions, behind = saved
        batch = self.layout(prompts, draw=False)
        batch.completions, batch.published = completions, self.sync.published - behind
        batch.counted = True  # in the restored ledger (or counted again by a rewind)
        return batch


def decode(tokenizer: Any, completions: Completions) -> tuple[list[str], list[str]]:
    """The prompts' and the completions' texts (an episode's whole transcript)."""
    prompts = [
        ids[m.bool()].tolist()
        for ids, m in zip(completions.prompt_ids, completions.prompt_mask, strict=True)
    ]
    return (
        tokenizer.batch_decode(prompts, skip_special_tokens=True),
        tokenizer.batch_decode(completions.completion_lists(), skip_special_tokens=True),
    )
