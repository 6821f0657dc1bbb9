"""The `policy:` section: how the policy replicas generate."""

from __future__ import annotations

from dataclasses import dataclass

from meshrl.config.files import check as _check
from meshrl.config.files import check_one_of

PRECISIONS = ("fp32", "bf16", "fp8")
"""`policy.precision`'s values (`meshrl.weights.precision`)."""
FROM_DTYPE = {"float32": "fp32", "bfloat16": "bf16"}


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether nothing listens on `host`:`port` now."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


TOOL_PARSERS = ("hermes", "llama3_json", "mistral", "harmony")
"""`policy.tool_parser`'s values: the families `meshrl.envs.tool_calls` parses."""
TOOL_PARSER_ALIASES = {
    "qwen2.5": "hermes",
    "qwen3": "hermes",
    "qwen": "hermes",
    "llama3": "llama3_json",
}
"""Other names a config may give a parser by (the families it reads)."""


@dataclass
class PolicyConfig:
    """How the policy replicas generate."""

    engine: str = "hf"
    """hf: meshrl's KV-cache sampler on the replica's HF model (CPU or GPU).
    vllm: an in-process vLLM engine per replica (GPU hosts, the `vllm` extra);
    weights arrive through the same versioned sync."""
    serve_port: int = 0
    """Serve the policy replicas at http://127.0.0.1:PORT/v1 (OpenAI-compatible,
    `meshrl.envs.endpoint`) while the run trains; 0: not served (an `agent:` task serves
    them on a free port of its own). Callers need the run's token, printed at start and
    kept in status.json (`endpoint_token`): `Authorization: Bearer TOKEN`, the OpenAI
    client's api_key (401 without it); the Host header must name 127.0.0.1, localhost
    or [::1] with this port (421 otherwise)."""
    tool_parser: str = "auto"
    """How the endpoint reads the model's tool calls into `tool_calls`
    (`meshrl.envs.tool_calls`): hermes (also qwen2.5, qwen3), llama3_json (llama3),
    mistral, harmony; auto: the one the tokenizer's chat template implies (none
    known: a request with `tools` is refused, saying to name one here)."""
    gpu_memory_utilization: float = 0.5
    """vllm: the share of its GPU a replica's engine may take."""
    share_prefix: bool = True
    """hf: prefill each distinct prompt of a batch once and copy its KV cache to
    the rows that repeat it (a group); the same tokens either way."""
    drop_finished: bool = True
    """hf: rows leave the decode batch when they end, so decoding costs what the
    live rows need; the same tokens either way."""
    continuous: bool = False
    """hf, `rollout.dispatch: pull`: each replica keeps one running decode batch
    that every generate call feeds: rows leave when they end and the next calls'
    rows join at once, each at its own position (`meshrl.model.continuous`); the
    same tokens as a batch of their own. With `rollout.calls_per_replica` > 1 the
    calls under way share the batch; `rollout.partial` lets weights change under it."""
    max_rows: int = 0
    """continuous: the most rows a replica decodes at once (0: every row it was
    given); the others wait and join as rows end."""
    precision: str | None = None
    """hf: what the replicas hold and sample with (docs/precision.md): fp32, bf16,
    or fp8 (decoder linear weights float8_e4m3fn with 128 x 128 block scales,
    the rest bfloat16; FP8 matmuls on CUDA >= 8.9, else each layer dequantized
    to bfloat16). The trainer publishes each version in it, converted on its
    side, so a bf16 replica reads half the bytes and an fp8 one about a
    quarter; checksums are over those bytes. Unset: `dtype`'s, else
    model.dtype's (float32: fp32, bfloat16: bf16)."""
    dtype: str | None = None
    """hf: the replicas' parameter dtype when it is not `model.dtype` (float32 or
    bfloat16): the same as `precision` fp32 or bf16, which it sets when that is
    unset (both set must agree)."""
    record_routes: bool = False
    """hf, mixture-of-experts models: return the experts each prompt and
    completion token was computed with (`meshrl.model.routing`), so the trainer can
    measure its routing against the sampler's (`routing/` metrics) and replay
    it. On whenever `trainer.routing_replay` is."""

    def validate(self) -> None:
        check_one_of(self.engine, ("hf", "vllm"), "policy.engine")
        _check(
            0 < self.gpu_memory_utilization <= 1,
            "policy.gpu_memory_utilization",
            "must be in (0, 1]",
        )
        if self.tool_parser != "auto":
            name = self.tool_parser.lower()
            _check(
                TOOL_PARSER_ALIASES.get(name, name) in TOOL_PARSERS,
                "policy.tool_parser",
                f"'{self.tool_parser}' is not a tool-call parser (one of "
                f"{', '.join([*TOOL_PARSERS, *TOOL_PARSER_ALIASES])}), or auto",
            )
        _check(0 <= self.serve_port < 65536, "policy.serve_port", "must be a port (0: none)")
        if self.serve_port:  # known now, not after the procs started
            _check(
                port_free(self.serve_port),
                "policy.serve_port",
                f"port {self.serve_port} is in use on 127.0.0.1",
            )
        if self.dtype is not None:
            check_one_of(
                self.dtype, ("float32", "bfloat16"), "policy.dtype", " (or unset: model.dtype)"
            )
        _check(
            self.dtype is None or self.engine == "hf",
            "policy.dtype",
            "the replicas' own dtype needs policy.engine=hf",
        )
        if self.precision is not None:
            check_one_of(
                self.precision, PRECISIONS, "policy.precision", " (or unset: model.dtype's)"
            )
        _check(
            self.precision is None or self.engine == "hf",
            "policy.precision",
            "the replicas' own precision needs policy.engine=hf",
        )
        _check(
            self.dtype is None
            or self.precision is None
            or self.precision == FROM_DTYPE[self.dtype],
            "policy.precision",
            f"'{self.precision}' disagrees with policy.dtype={self.dtype} (set one)",
        )
        _check(
            not self.continuous or (self.engine == "hf" and not self.record_routes),
            "policy.continuous",
            "continuous batching runs on policy.engine=hf without policy.record_routes",
        )
        _check(self.max_rows >= 0, "policy.max_rows", "must be >= 0 (0: no cap)")
        _check(
            not (self.record_routes and self.engine != "hf"),
            "policy.record_routes",
            "routes are recorded by the hf engine only (policy.engine=hf)",
        )

    def precision_for(self, model_dtype: str) -> str:
        """The replicas' precision: `precision`, else `dtype`'s, else `model_dtype`'s."""
        return self.precision or FROM_DTYPE[self.dtype or model_dtype]
