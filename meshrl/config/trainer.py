"""The `trainer:` section: how the trainer turns a batch into an optimizer step."""

from __future__ import annotations

from dataclasses import dataclass

from meshrl.config.files import check, check_one_of

LAYOUTS = ("tree", "packed", "padded")
"""Batch layouts of the training-side forward pass (meshrl.model.packing)."""
PRECISIONS = ("fp32", "bf16-mixed")
"""`trainer.precision`'s values (`meshrl.weights.precision`)."""
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved")
"""`trainer.pp_schedule`'s values (`meshrl.procs.pipeline`)."""
CORRECTIONS = ("none", "tis", "mis-token", "mis-sequence", "icepop", "geo-mask")
"""`trainer.correction`'s train-inference mismatch corrections (`meshrl.model.losses`)."""
CORRECTION_HIGH = {
    "tis": 2.0,
    "mis-token": 2.0,
    "mis-sequence": 2.0,
    "icepop": 5.0,
    "geo-mask": 2.0,
}
"""Each correction's upper bound where `trainer.correction_high` is not set, from its
source: TIS and MIS truncate at 2 (Yao et al. 2025, "Your efficient RL framework
secretly brings you off-policy RL training"); IcePop masks outside [0.5, 5] (Ling Team
2025, "Every Step Evolves", arXiv 2510.18855); the geometric sequence mask has no
published default and takes TIS's."""


@dataclass
class TrainerConfig:
    """How the trainer turns a batch into one optimizer step."""

    micro_batches: int = 1
    """Gradient accumulation: each rank's shard of an optimizer step's batch runs
    as this many forward/backward passes (less activation memory; the same
    gradient, since every loss divides by the whole batch's counts)."""
    recompute_old_logprobs: str = "auto"
    """true: the trainer recomputes the old log-probs of each batch in a no-grad
    pass before its first optimizer step, so the PPO ratio compares the trainer
    with itself; the sampler's stay for `correction` and the `sampling/`
    metrics. false: the sampler's log-probs are the old ones. auto: true when
    the engine is vllm, model.dtype is not float32, trainer.precision or
    policy.precision is not fp32, top_p < 1,
    min_new_tokens > 0, or a correction is set."""
    correction: str = "none"
    """Train-inference mismatch correction (needs the recomputed old log-probs):
    none, tis (truncated IS per token), mis-token / mis-sequence (masked IS),
    icepop (token mask outside [low, high]), geo-mask (sequence mask on the
    geometric mean ratio). See meshrl.model.losses."""
    correction_low: float = 0.5
    """Lower bound of the ratio band (icepop, geo-mask): IcePop's 0.5 (Ling Team
    2025, Ring-1T)."""
    correction_high: float | None = None
    """Upper bound: the truncation (tis) or the band's top (the others). None: the
    method's own (`CORRECTION_HIGH`): 2.0 for tis and mis (the truncation of Yao et
    al. 2025), 5.0 for icepop (Ring-1T's band is [0.5, 5]; [0.5, 2] trained
    unstably there), 2.0 for geo-mask (no published default: TIS's)."""
    precision: str = "fp32"
    """fp32, or bf16-mixed: float32 master weights, gradients (reduced in float32
    on every layout) and optimizer state, each forward's matmuls in bfloat16
    (autocast, the same on DDP, FSDP2 and tensor parallelism). Needs
    model.dtype float32 (docs/precision.md)."""
    layout: str = "tree"
    """How the trainer, reference and critic lay a batch out for their forward
    pass (meshrl.model.packing): tree (no padding, and the completions of one prompt
    share one forward of it: under one dense mask for trees of up to 2,048 tokens,
    over the prompt's KV cache for larger ones, meshrl.model.tree), packed (no
    padding), padded (the rectangular batch). The same math."""
    routing_replay: bool = False
    """Mixture-of-experts models: the trainer's forward sends each token to the
    experts the sampler chose for it (routing replay, "R3"; meshrl.model.routing),
    with the gate weights still its own router's, so that a token near a
    routing tie runs the same experts on both sides. Turns on
    `policy.record_routes`. The `routing/` metrics count the tokens whose
    routing differs either way."""

    pp_schedule: str = "1f1b"
    """Pipelined layouts (`placement.sharding` pp, fsdp_pp, fsdp_tp_pp): the
    schedule of torch's pipelining that runs each pass: gpipe (every
    micro-batch's forward, then every backward), 1f1b (one forward, one backward
    in turn: fewer activations held) or interleaved (1f1b over 2 stages per
    proc, loop style: a smaller bubble)."""
    pp_microbatches: int = 4
    """Pipelined layouts: micro-batches each pass is split into by the schedule
    (1f1b and interleaved: at least the stages; a shard with fewer rows runs
    as many as it has). The bubble of gpipe and 1f1b is (pp - 1) / (m + pp - 1)
    of the pass for m micro-batches."""

    def validate(self) -> None:
        check(self.micro_batches >= 1, "trainer.micro_batches", "must be >= 1")
        check_one_of(self.pp_schedule, PP_SCHEDULES, "trainer.pp_schedule")
        check(self.pp_microbatches >= 1, "trainer.pp_microbatches", "must be >= 1")
        self.recompute_old_logprobs = str(self.recompute_old_logprobs).lower()
        check_one_of(
            self.recompute_old_logprobs, ("auto", "true", "false"), "trainer.recompute_old_logprobs"
        )
        check_one_of(self.correction, CORRECTIONS, "trainer.correction")
        check_one_of(self.precision, PRECISIONS, "trainer.precision")
        check_one_of(self.layout, LAYOUTS, "trainer.layout")
        check(self.correction_low >= 0, "trainer.correction_low", "must be >= 0")
        low, high = self.correction_band()
        check(
            low < high,
            "trainer.correction_low",
            f"{low} must be below trainer.correction_high ({high})",
        )

    def correction_band(self) -> tuple[float, float]:
        """(low, high) of the ratio band, `correction_high` None resolved to the
        method's own bound."""
        high = self.correction_high
        return self.correction_low, CORRECTION_HIGH.get(
            self.correction, 2.0
        ) if high is None else high

    def check_offline(self, algorithm: str, micro_batches: bool = True) -> None:
        """For an algorithm that trains on fixed data, no sampler in the loop (DPO,
        SFT): the keys about a sampler's log-probs and routes would do nothing, so
        they are refused; `micro_batches`: whether it can split a rank's rows."""
        check(self.correction == "none", "trainer.correction", f"{algorithm} samples nothing")
        check(
            self.recompute_old_logprobs != "true",
            "trainer.recompute_old_logprobs",
            f"{algorithm} has no old log-probs",
        )
        check(not self.routing_replay, "trainer.routing_replay", f"{algorithm} samples no routes")
        check(
            micro_batches or self.micro_batches == 1,
            "trainer.micro_batches",
            f"{algorithm} steps on whole pairs, one pass per rank (not yet split)",
        )

    def recompute(self, model, generation, policy) -> bool:
        """Whether old log-probs come from the trainer (resolving `auto`), given the
        run's `model`, `generation` and `policy` sections."""
        if self.recompute_old_logprobs != "auto":
            return self.recompute_old_logprobs == "true"
        return (
            policy.engine == "vllm"
            or model.dtype != "float32"
            or self.precision != "fp32"
            or policy.precision_for(model.dtype) != "fp32"
            or generation.top_p < 1
            or generation.min_new_tokens > 0  # the sampler's distribution is truncated
            or self.correction != "none"
        )

    def check_precision(self, model) -> None:
        """bf16-mixed keeps float32 master weights: model.dtype must be float32."""
        check(
            self.precision == "fp32" or model.dtype == "float32",
            "trainer.precision",
            f"bf16-mixed keeps float32 master weights, so model.dtype must be float32 "
            f"(it is {model.dtype})",
        )

    def published(self, model, policy, full_readers: bool = False) -> tuple[str, ...]:
        """The precisions the trainer publishes each version in (`Trainer(precisions=)`):
        the policy replicas' (`policy.precision`; None: no replicas), and with
        `full_readers` (a reference or critic that pulls the trainer's weights) or
        without replicas the trainer's own."""
        own = "fp32" if model.dtype == "float32" else "bf16"
        wanted = [] if policy is None else [policy.precision_for(model.dtype)]
        if full_readers or policy is None:
            wanted.append(own)
        return tuple(dict.fromkeys(wanted))
