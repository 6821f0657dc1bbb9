"""Typed configs: dataclass defaults, then a YAML file, then `key=value` overrides.

Every algorithm defines one top-level dataclass built from the shared sections
below. `load_config(GRPOConfig, "x.yaml", ["steps=20"])` merges the three layers
with omegaconf and returns a plain dataclass instance. Any mistake (unknown key,
wrong type, missing file, bad value) raises `ConfigError` whose message is one
line naming the key, file or value; `parse_cli` turns that into a non-zero exit
before any process is spawned.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

# The loading functions live beside the sections' users as `meshrl.config.*` too.
from meshrl.config.files import (  # noqa: F401
    ConfigError,
    check_one_of,
    first_paragraph,
    load_config,
    parse_cli,
    save_config,
    validate_sections,
)
from meshrl.config.files import check as _check
from meshrl.config.health import HealthConfig  # noqa: F401
from meshrl.config.policy import PolicyConfig  # noqa: F401
from meshrl.config.trainer import TrainerConfig  # noqa: F401
from meshrl.config.vision import VisionConfig

SHARDINGS = ("ddp", "fsdp", "tp", "fsdp_tp", "pp", "fsdp_pp", "fsdp_tp_pp")
ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3", "phi3", "gpt2")
"""`model.arch`'s embedded text models (built by `meshrl.model.architectures`)."""
VISION_ARCHITECTURES = ("llava", "qwen2_vl", "qwen2_5_vl", "qwen3_vl")
"""Embedded vision-language models (`meshrl.model.vision`): LLaVA, a CLIP vision tower
and projector in front of the Llama above; Qwen2-VL, Qwen2.5-VL and Qwen3-VL,
their vision tower and M-RoPE language model at the Llama's sizes (`meshrl.model.mrope`)."""

# --- shared sections -------------------------------------------------------------


@dataclass
class LoraConfig:
    """LoRA adapters (peft) on the trainer's copy of the model; the replicas,
    the reference and the critic get the merged weights."""

    rank: int = 0
    """Adapter rank; 0 trains every weight (no LoRA)."""
    alpha: float = 16.0
    """Scale of the adapters' output: alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapters' input."""
    target_modules: list[str] = field(
        default_factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ]
    )
    """Names of the linear layers that get adapters (the Llama/Qwen names)."""
    save: str = "merged"
    """The final model: merged (weights with the adapters folded in), adapter
    (peft's adapter files in `final/adapter`) or both."""

    def validate(self, prefix: str = "model.lora") -> None:
        _check(self.rank >= 0, f"{prefix}.rank", "must be >= 0")
        _check(self.alpha > 0, f"{prefix}.alpha", "must be > 0")
        _check(0 <= self.dropout < 1, f"{prefix}.dropout", "must be in [0, 1)")
        _check(bool(self.target_modules), f"{prefix}.target_modules", "must name a module")
        check_one_of(self.save, ("merged", "adapter", "both"), f"{prefix}.save")
        if self.rank:
            import importlib.util

            _check(
                importlib.util.find_spec("peft") is not None,
                f"{prefix}.rank",
                "LoRA needs peft, which is not installed: pip install -e '.[lora]'",
            )


@dataclass
class ModelConfig:
    """The policy model. Either a local HF directory or the embedded tiny model."""

    path: str | None = None
    """Local directory of a HF causal LM + tokenizer (`save_pretrained` layout),
    or another meshrl run's directory (its `final/`, else its newest checkpoint)
    or checkpoint. None builds the embedded tiny model and the project's
    character tokenizer."""
    arch: str = "llama"
    """Embedded model only: its architecture, one of llama, qwen2, qwen3,
    qwen3_moe, gemma2, gemma3, phi3, gpt2 (`meshrl.model.architectures`), or llava,
    qwen2_vl, qwen2_5_vl, qwen3_vl: a vision-language model (`meshrl.model.vision`)."""
    hidden_size: int = 64
    """Embedded model only: width of the residual stream."""
    num_layers: int = 2
    """Embedded model only: number of decoder layers."""
    num_heads: int = 4
    """Embedded model only: attention heads (key/value heads = heads)."""
    intermediate_size: int = 256
    """Embedded model only: MLP width."""
    dtype: str = "float32"
    """Parameter dtype on every role: float32 or bfloat16."""
    max_positions: int = 256
    """Embedded model only: its context window in tokens."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA on the trainer (rank 0: off)."""
    vision: VisionConfig = field(default_factory=VisionConfig)
    """Images (vision-language models)."""

    @staticmethod
    def sized(hidden: int, layers: int, max_positions: int) -> ModelConfig:
        """The embedded Llama at another width and depth, with the usual ratios
        (64-wide heads, an MLP 4x the width): benchmarks' model sizes."""
        return ModelConfig(
            hidden_size=hidden,
            num_layers=layers,
            num_heads=max(1, hidden // 64),
            intermediate_size=4 * hidden,
            max_positions=max_positions,
        )

    def validate(self, prefix: str = "model") -> None:
        check_one_of(self.dtype, ("float32", "bfloat16"), f"{prefix}.dtype")
        if self.path is not None:
            _check(os.path.isdir(self.path), f"{prefix}.path", f"no such directory: {self.path}")
            # A saved model's tokenizer is checked against its vocabulary when the run
            # starts (`meshrl.model.tokenizer.check_tokenizer_fits`).
            if not os.path.isfile(os.path.join(self.path, "config.json")):
                # another run's output: `meshrl.loop.export.model_source` resolves it
                run = os.path.isfile(os.path.join(self.path, "config.yaml"))
                saved = os.path.isfile(os.path.join(self.path, "COMPLETE"))
                _check(
                    run or saved,
                    f"{prefix}.path",
                    f"{self.path} has no config.json (expected a save_pretrained directory, "
                    "a meshrl run directory or one of its checkpoints)",
                )
        self.lora.validate(f"{prefix}.lora")
        self.vision.validate(f"{prefix}.vision")
        known = ARCHITECTURES + VISION_ARCHITECTURES
        check_one_of(self.arch, known, f"{prefix}.arch")
        for name in (
            "hidden_size",
            "num_layers",
            "num_heads",
            "intermediate_size",
            "max_positions",
        ):
            _check(getattr(self, name) > 0, f"{prefix}.{name}", "must be > 0")
        _check(
            self.hidden_size % self.num_heads == 0,
            f"{prefix}.num_heads",
            f"hidden_size {self.hidden_size} is not divisible by {self.num_heads} heads",
        )


MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 100.0
"""Sampling temperatures meshrl takes: logits over a smaller one overflow float32
(1e-39 gave NaN log-probs, wrong tokens and NaN training steps)."""


@dataclass
class GenerationConfig:
    """Sampling on the policy replicas."""

    max_new_tokens: int = 8
    """Completion length limit; generation also stops at EOS."""
    temperature: float = 1.0
    """Softmax temperature; the trainer scores tokens at the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0 samples from the full distribution."""
    min_new_tokens: int = 0
    """No stop token before this many tokens (HF's min_new_tokens, vLLM's
    min_tokens); max_new_tokens makes every completion full length (equal work
    in benchmarks)."""
    overlong_prompt: str = "skip"
    """A prompt whose tokens plus max_new_tokens exceed the model's context:
    skip (draw another, counted in samples/skipped_overlong_prompts) or error."""

    def validate(self) -> None:
        _check(self.max_new_tokens > 0, "generation.max_new_tokens", "must be > 0")
        _check(
            MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE,
            "generation.temperature",
            f"{self.temperature} is not in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]",
        )
        _check(0 < self.top_p <= 1, "generation.top_p", "must be in (0, 1]")
        _check(
            0 <= self.min_new_tokens <= self.max_new_tokens,
            "generation.min_new_tokens",
            "must be in [0, generation.max_new_tokens]",
        )
        check_one_of(self.overlong_prompt, ("skip", "error"), "generation.overlong_prompt")


@dataclass
class OptimConfig:
    """AdamW on the trainer mesh."""

    lr: float = 1e-3
    """Peak learning rate."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    """AdamW's beta1 and beta2."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay."""
    max_grad_norm: float = 1.0
    """Gradients are clipped to this global L2 norm (0 disables clipping)."""
    schedule: str = "constant"
    """constant, linear or cosine decay to `min_lr_ratio * lr` over the run."""
    warmup_steps: int = 0
    """Linear warm-up from 0 over this many optimizer steps."""
    min_lr_ratio: float = 0.0
    """Where a linear or cosine decay ends, as a fraction of lr."""

    def validate(self, section: str = "optim") -> None:
        """`section` is where this config sits (`optim`, PPO's `critic_optim`)."""
        _check(self.lr > 0, f"{section}.lr", "must be > 0")
        _check(len(self.betas) == 2, f"{section}.betas", "must be a list of two floats")
        check_one_of(self.schedule, ("constant", "linear", "cosine"), f"{section}.schedule")
        _check(self.max_grad_norm >= 0, f"{section}.max_grad_norm", "must be >= 0")


@dataclass
class PlacementConfig:
    """Processes per role on the local host. One policy replica per policy proc;
    the trainer runs data-parallel over its procs."""

    policy: int = 1
    """Policy replicas (one per proc)."""
    trainer: int = 1
    """Trainer procs, laid out by `sharding`."""
    environment: int = 1
    """Environment procs: rewards and episode steps, split over them."""
    reference: int = 1
    """Spawned only when the algorithm needs a reference model (KL coefficient > 0, DPO)."""
    reward_model: int = 1
    """Spawned only when reward_model.path is set."""
    critic: int = 1
    """Spawned only by algorithms with a critic (PPO)."""
    teacher: int = 1
    """Spawned only by distillation: the teacher's procs (rows split over them)."""
    threads_per_proc: int = 0
    """torch threads in each proc; 0 shares this host's cores among the procs that
    compute at the same time (one role at a time in the synchronous loop)."""
    colocate: bool = False
    """Run the policy replicas in the trainer's procs (one per trainer proc,
    time-shared with training) instead of a policy mesh of their own."""
    sharding: str = "ddp"
    """The trainer's layout over its procs: ddp (a full replica each); fsdp
    (parameters, gradients and optimizer state sharded with FSDP2); tp (the
    decoder's linear layers split over every proc with tensor parallelism, the
    plan transformers ships for llama, mistral, qwen2, qwen3 and gemma2); or
    fsdp_tp (groups of `tp` procs tensor-parallel, FSDP2 across the groups);
    pp, fsdp_pp, fsdp_tp_pp (the layers split into `pp` pipeline stages run by
    `trainer.pp_schedule`, each stage's procs DDP replicas, FSDP2 shards, or `tp`
    tensor-parallel procs with FSDP2 across them: docs/launch.md). Every layout
    but ddp checkpoints sharded, through torch.distributed.checkpoint. The critic
    runs ddp."""
    tp: int = 2
    """fsdp_tp and fsdp_tp_pp only: procs per tensor-parallel group; it divides
    `trainer`."""
    pp: int = 2
    """pp, fsdp_pp and fsdp_tp_pp only: pipeline stages (each a group of procs:
    `trainer` / pp of them); with `tp`, pp x tp divides `trainer`."""
    ep: int = 1
    """Mixture-of-experts models: procs the experts are spread over (expert
    parallelism; tokens go to their experts' proc and back with all-to-all):
    1 (every proc holds every expert) or `trainer` (with sharding ddp or fsdp:
    each proc holds its share of each layer's experts)."""
    policy_tp: int = 1
    """Procs per policy replica: above 1, each replica's model is split over that
    many procs with tensor parallelism (the trainer's plan, `sharding`), for a
    model that one proc cannot hold; `policy` counts replicas (per host), and a
    replica's procs share its host. The `hf` engine's batch path only (not
    `policy.continuous`, vllm or `colocate`)."""

    def validate(self) -> None:
        roles = ("policy", "trainer", "environment", "reference", "critic", "reward_model")
        for role in (*roles, "teacher"):
            _check(getattr(self, role) >= 1, f"placement.{role}", "must be >= 1")
        _check(self.threads_per_proc >= 0, "placement.threads_per_proc", "must be >= 0")
        check_one_of(self.sharding, SHARDINGS, "placement.sharding")
        _check(self.policy_tp >= 1, "placement.policy_tp", "must be >= 1")
        _check(
            self.policy_tp == 1 or not self.colocate,
            "placement.policy_tp",
            "tensor-parallel replicas have procs of their own (placement.colocate=false)",
        )
        if self.sharding == "fsdp_tp":
            _check(
                self.tp >= 2 and self.trainer % self.tp == 0,
                "placement.tp",
                f"{self.tp} must be >= 2 and divide placement.trainer ({self.trainer})",
            )
        if self.sharding.endswith("pp"):
            _check(self.pp >= 2, "placement.pp", f"{self.pp} must be >= 2 ({self.sharding})")
            _check(
                self.trainer % (self.pp * self.trainer_tp) == 0,
                "placement.pp",
                f"{self.pp} stages x {self.trainer_tp} tensor-parallel procs do not divide "
                f"placement.trainer ({self.trainer})",
            )
        if self.sharding == "fsdp_tp_pp":
            _check(self.tp >= 2, "placement.tp", f"{self.tp} must be >= 2 (fsdp_tp_pp)")
        _check(
            self.ep in (1, self.trainer),
            "placement.ep",
            f"{self.ep} is neither 1 nor placement.trainer ({self.trainer}): the experts "
            "are spread over every trainer proc",
        )
        _check(
            self.ep == 1 or self.sharding in ("ddp", "fsdp"),
            "placement.ep",
            f"expert parallelism goes with placement.sharding ddp or fsdp, not {self.sharding}",
        )

    @property
    def trainer_tp(self) -> int:
        """Procs per tensor-parallel group of the trainer (1: none)."""
        return {"tp": self.trainer, "fsdp_tp": self.tp, "fsdp_tp_pp": self.tp}.get(self.sharding, 1)

    @property
    def trainer_pp(self) -> int:
        """Pipeline stages of the trainer (1: none)."""
        return self.pp if self.sharding.endswith("pp") else 1

    @property
    def trainer_group(self) -> int:
        """Trainer procs that take the same rows of a batch: a pipeline of
        tensor-parallel groups (1: each proc its own rows)."""
        return self.trainer_tp * self.trainer_pp


@dataclass
class TaskConfig:
    """The environment's task (see meshrl/envs)."""

    name: str = "reverse_digits"
    """An environment in meshrl.envs.TASKS (reverse_digits, math, countdown, code,
    calculator, slow_tool), the import path of your own (`mypkg.envs:MyEnv`), or
    an adapter: `openenv:mypkg.server:MyEnvironment` or `openenv:http://HOST:PORT`
    (OpenEnv), `verifiers:TASKSET_ID` (a verifiers taskset), `agent:mypkg:my_agent`
    (your agent function, through the policy's OpenAI-compatible endpoint)."""
    num_digits: int = 3
    """reverse_digits: digits per prompt."""
    max_digits: int = 0
    """reverse_digits: when above num_digits, each prompt has num_digits to
    max_digits digits (drawn uniformly)."""
    dataset: str = ""
    """Prompts from a .jsonl or .parquet file or a datasets save_to_disk directory
    instead of the environment's generator (not reverse_digits)."""
    prompt_field: str = "prompt"
    """The dataset field the model sees."""
    answer_field: str = "answer"
    """The dataset field the reward checks against (other fields travel along)."""
    max_turns: int = 0
    """Model turns per episode; 0: the environment's own (calculator: 4)."""
    step_timeout_s: float = 30.0
    """An episode step (a tool call) running longer fails that episode."""
    tool_timeout_s: float = 5.0
    """Wall limit of one sandboxed program (python tool, code tests)."""
    tools: list[str] = field(default_factory=lambda: ["calc", "python"])
    """calculator: the tools that work; a call to another answers that it is
    disabled (`[]`: the no-tool ablation)."""
    tool_latency_s: float = 0.1
    """slow_tool: seconds each step waits."""
    env_workers: int = 64
    """Episode steps an environment proc runs at once (threads)."""

    def validate(self) -> None:
        """The keys' values; the environment `name` resolves to and the dataset's rows
        are checked when the run starts (`meshrl.envs.check_task`)."""
        _check(self.num_digits >= 1, "task.num_digits", "must be >= 1")
        _check(
            self.max_digits == 0 or self.max_digits >= self.num_digits,
            "task.max_digits",
            "must be 0 or >= task.num_digits",
        )
        _check(self.max_turns >= 0, "task.max_turns", "must be >= 0")
        _check(self.step_timeout_s > 0, "task.step_timeout_s", "must be > 0")
        _check(self.tool_timeout_s > 0, "task.tool_timeout_s", "must be > 0")
        _check(self.env_workers >= 1, "task.env_workers", "must be >= 1")
        unknown = sorted(set(self.tools) - {"calc", "python"})
        _check(not unknown, "task.tools", f"{unknown} are not tools (calc, python)")
        if self.dataset:
            # A relative path: from the working directory, else from the repository
            # (the shipped samples under meshrl/envs/data work from anywhere).
            repo = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
            shipped = os.path.join(repo, self.dataset)
            if not os.path.exists(self.dataset) and os.path.exists(shipped):
                self.dataset = shipped

    def check_dataset(self) -> None:
        """`task.dataset` against `task.name`, and that it is there: checked once
        `task.name` resolves (`meshrl.envs.check_task`), so that a bad name is the
        error a user sees first."""
        if self.name.startswith("agent:"):
            _check(bool(self.dataset), "task.dataset", "an agent task takes its prompts from one")
        if self.dataset:
            _check(self.name != "reverse_digits", "task.dataset", "reverse_digits has no dataset")
            _check(
                os.path.exists(self.dataset),
                "task.dataset",
                f"no such file or directory: {self.dataset}",
            )


@dataclass
class RewardModelConfig:
    """A learned reward beside (or instead of) the environment's rule reward."""

    path: str = ""
    """A HF sequence-classification model directory (save_pretrained, with its
    tokenizer); empty: no reward model."""
    weight: float = 1.0
    """Weight of its score (the first logit on prompt + completion)."""
    rule_weight: float = 1.0
    """Weight of the environment's rule reward (0: the reward model alone)."""

    def validate(self) -> None:
        if self.path:
            _check(
                os.path.isfile(os.path.join(self.path, "config.json")),
                "reward_model.path",
                f"{self.path} has no config.json (expected a save_pretrained directory)",
            )


@dataclass
class WarmStartConfig:
    """Optional supervised warm-start on task demonstrations before RL."""

    steps: int = 0
    """Supervised steps before RL; 0 skips the warm-start."""
    batch_size: int = 64
    """Demonstrations per supervised step."""
    lr: float = 3e-3
    """Learning rate of the warm-start (its own AdamW)."""

    def validate(self) -> None:
        _check(self.steps >= 0, "warm_start.steps", "must be >= 0")
        _check(self.batch_size >= 1, "warm_start.batch_size", "must be >= 1")
        _check(self.lr > 0, "warm_start.lr", "must be > 0")


@dataclass
class RunConfig:
    """Where a run writes and how long a remote call may take."""

    name: str = ""
    """Run directory name under `dir`; empty picks `<algorithm>-<timestamp>`."""
    dir: str = "runs"
    """Directory the run directories go under."""
    seed: int = 0
    """Seeds the model's init, the prompts and every replica's sampling: a run
    repeats bitwise on CPU."""
    call_timeout_s: float = 300.0
    """Deadline of any single remote call; past it the run stops with an error
    naming the role and endpoint."""
    progress: bool = True
    """Show a console progress bar."""
    sinks: list[str] = field(default_factory=list)
    """Where metrics go besides metrics.jsonl: tensorboard (`<run dir>/tensorboard`;
    the `tensorboard` extra), wandb (offline under `<run dir>/wandb` unless
    WANDB_MODE or WANDB_API_KEY say otherwise; the `wandb` extra)."""
    samples_every: int = 25
    """Every this many steps, write the step's prompts, completions, rewards and
    advantages to `samples.jsonl` and the sinks (0: never)."""
    console_samples: int = 4
    """Of those, print this many as a table on the console (0: none)."""
    status_every_s: float = 5.0
    """Besides after each step, write `<run dir>/status.json` (each proc's state,
    read with `meshrl status RUN_DIR`) this often from a thread; 0: only after steps."""
    save_final: bool = True
    """Write the trained model and tokenizer to `<run dir>/final/`."""
    telemetry: bool = False
    """Turn on Monarch's distributed telemetry for the run's job: SQL over its
    actors, meshes and messages, and each step's record beside them (see
    docs/observability.md)."""
    dashboard: bool = False
    """Also serve Monarch's dashboard (turns `telemetry` on), behind meshrl's front
    (`meshrl.observe.front`): its URL, with the run's token, is printed at start and kept
    in `status.json`."""
    dashboard_port: int = 8265
    """The dashboard's port; one in use falls back to a free port (0: a free port)."""
    dashboard_host: str = "127.0.0.1"
    """The address the dashboard listens on; another than loopback (`0.0.0.0`, a
    host's address) opens it to whoever can reach that address and has the token."""
    profile_steps: list[int] = field(default_factory=list)
    """[first, last]: profile these steps (torch's profiler in every actor) into
    `<run dir>/profile/`: one Chrome trace per proc and `summary.json`."""

    def validate(self) -> None:
        _check(self.call_timeout_s > 0, "run.call_timeout_s", "must be > 0")
        _check(self.samples_every >= 0, "run.samples_every", "must be >= 0")
        _check(self.console_samples >= 0, "run.console_samples", "must be >= 0")
        _check(self.status_every_s >= 0, "run.status_every_s", "must be >= 0")
        import importlib.util

        modules = {"tensorboard": "tensorboard", "wandb": "wandb"}
        for sink in self.sinks:
            check_one_of(sink, modules, "run.sinks")
            _check(
                importlib.util.find_spec(modules[sink]) is not None,
                "run.sinks",
                f"{sink} is not installed: pip install -e '.[{sink}]'",
            )
        _check("/" not in self.name, "run.name", f"'{self.name}' must not contain '/'")
        _check(0 <= self.dashboard_port < 65536, "run.dashboard_port", "must be 0..65535")
        steps = self.profile_steps
        _check(
            not steps or (len(steps) == 2 and 0 <= steps[0] <= steps[1]),
            "run.profile_steps",
            f"{steps} is not [first, last] with 0 <= first <= last",
        )


def check_placement(model: ModelConfig, placement: PlacementConfig) -> None:
    """The trainer's layout against the model's training: LoRA trains with ddp.
    (Whether tensor parallelism can split the model's layers is checked when the
    run starts: `meshrl.model.models.check_layout`.)"""
    _check(
        not model.lora.rank or placement.sharding == "ddp",
        "model.lora.rank",
        f"LoRA trains with placement.sharding=ddp ({placement.sharding} with LoRA is not supported)",
    )
    _check(
        not model.lora.rank or placement.ep == 1,
        "model.lora.rank",
        f"LoRA trains every expert on every proc (placement.ep={placement.ep} with LoRA is "
        "not supported)",
    )
    _check(
        model.arch == "qwen3_moe" or model.path is not None or placement.ep == 1,
        "placement.ep",
        f"{placement.ep}: model.arch {model.arch} has no experts to spread",
    )


# --- loading ---------------------------------------------------------------------
