"""MoE routing: the sampler records the experts each token was sent to, the
trainer can replay them (routing replay, "R3").

A mixture-of-experts layer sends each token to the top-k experts of its
router. The sampler and the trainer compute the router's logits with other
kernels (and often in another dtype), so a token near a tie can go to other
experts in the trainer than in the sampler: its log-prob then differs by more
than rounding, and the policy-gradient ratio with it. Replay makes the
trainer's forward use the sampler's experts for every token it recorded,
while the gate weights (and their gradient) stay the trainer's own: the
router's softmax taken at the replayed experts, normalized as the model does.

It works through transformers' own router modules (`ROUTERS`), by a forward
hook that records or replaces their `(logits, scores, indices)` output; the
model code is not forked. Routes are int16 tensors [..., layers, top_k], -1
where a position was not computed by the sampler (padding, a sequence's last
token, a tool reply not yet prefilled): there the trainer routes by itself.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

ROUTERS = ("Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "OlmoeTopKRouter", "MixtralTopKRouter")
"""Router classes (transformers 5) whose output is (logits, scores, indices)."""
MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral")
"""`model_type`s of the HF models built from those routers."""


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's router modules in layer order (through DDP, FSDP2 and peft,
    whose wrapped modules are submodules)."""
    return [m for m in model.modules() if type(m).__name__ in ROUTERS]


def moe_problem(model_type: str) -> str:
    """Why routing cannot be recorded and replayed for a model of `model_type`
    ('' when it can)."""
    if model_type in MOE_MODEL_TYPES:
        return ""
    return (
        f"'{model_type}' has no mixture-of-experts routers meshrl can replay "
        f"(supported: {', '.join(MOE_MODEL_TYPES)})"
    )


def check_routing(model, policy, trainer, multi_turn: bool) -> None:
    """Config check: `trainer.routing_replay` turns `policy.record_routes` on; both
    need the hf engine, an MoE model whose routers this module knows (checked
    here for the embedded model, by the policy actor for one loaded by path)
    and one-turn episodes."""
    from meshrl.config import ConfigError

    if trainer.routing_replay:
        policy.record_routes = True
    if not policy.record_routes:
        return
    key = "trainer.routing_replay" if trainer.routing_replay else "policy.record_routes"
    if policy.engine != "hf":
        raise ConfigError(f"config key '{key}': routes are recorded by policy.engine=hf only")
    if model.path is None and moe_problem(model.arch):
        raise ConfigError(f"config key '{key}': model.arch {moe_problem(model.arch)}")
    if multi_turn:
        raise ConfigError(f"config key '{key}': multi-turn episodes carry no routes yet")


class Recorder:
    """Records the experts of each row and position while `sample` runs.

    `routes` [B, width, layers, top_k] int16, -1 where nothing was recorded.
    After each forward of the model, `put` writes what its routers chose."""

    def __init__(self, model: torch.nn.Module, rows: int, width: int):
        self.modules = routers(model)
        top_k = self.modules[0].top_k
        self.routes = torch.full(
            (rows, width, len(self.modules), top_k), -1, dtype=torch.int16, device="cpu"
        )
        self._last: list[torch.Tensor | None] = [None] * len(self.modules)
        self._hooks = [
            m.register_forward_hook(self._keep(layer)) for layer, m in enumerate(self.modules)
        ]

    def _keep(self, layer: int):
        def hook(module, args, output):
            self._last[layer] = output[2]

        return hook

    def put(
        self,
        rows: torch.Tensor,
        column: int,
        valid: torch.Tensor,
        inverse: torch.Tensor | None = None,
    ) -> None:
        """Store the last forward's experts: it ran [R, C] tokens; with `inverse`
        (a shared prefill) row `inverse[b]` of it is row b's. They go to
        `routes[rows, column : column + C]`, -1 where `valid` [len(rows), C] is 0."""
        chosen = torch.stack(self._last, dim=1).to("cpu", torch.int16)  # [R*C, L, k]
        width = valid.size(1)
        chosen = chosen.view(-1, width, *chosen.shape[1:])
        if inverse is not None:
            chosen = chosen[inverse.cpu()]
        chosen = chosen.masked_fill(~valid.bool().cpu()[..., None, None], -1)
        self.routes[rows.cpu(), column : column + width] = chosen
        self._last = [None] * len(self.modules)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()

    @staticmethod
    @contextmanager
    def of(model: torch.nn.Module, rows: int, width: int, on: bool):
        """A recorder for the block (its hooks removed after), or None when not `on`."""
        recorder = Recorder(model, rows, width) if on else None
        try:
            yield recorder
        finally:
            if recorder is not None:
                recorder.close()


class Replay:
    """The trainer side: the routers of `model` use `routes` during `forward`.

    Counts, over the recorded tokens, how many the trainer's router left alone
    would send to another set of experts than the sampler in at least one layer
    (`router_mismatch`), and how many ran with another set (`ran_mismatch`: 0
    when replay is on)."""

    def __init__(self, model: torch.nn.Module, replay: bool):
        self.modules = routers(model)
        self.replay = replay
        self.tokens = self.router_mismatch = self.ran_mismatch = 0

    @contextmanager
    def forward(self, routes: torch.Tensor):
        """During the block, each router's layer l takes `routes[:, l]` ([N, L, k],
        N the tokens of the forward in row-major order; -1: its own choice)."""
        # Recorded by the sampler wherever it kept them (CPU in a batch): the routers'
        # outputs, compared and replaced here, are on the model's device.
        routes = routes.to(next(self.modules[0].parameters()).device) if self.modules else routes
        own_differs = torch.zeros(len(routes), dtype=torch.bool, device=routes.device)
        ran_differs = torch.zeros_like(own_differs)
        known = routes[:, 0, 0] >= 0
        hooks = [
            m.register_forward_hook(self._hook(layer, routes, known, own_differs, ran_differs))
            for layer, m in enumerate(self.modules)
        ]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
        self.tokens += int(known.sum())  # (both flags are set on recorded tokens only)
        self.router_mismatch += int(own_differs.sum())
        self.ran_mismatch += int(ran_differs.sum())

    def _hook(self, layer, routes, known, own_differs, ran_differs):
        def hook(module, args, output):
            logits, scores, own = output
            recorded = routes[:, layer].long()
            if recorded.size(0) != own.size(0):
                raise ValueError(
                    f"routing replay: {recorded.size(0)} recorded tokens for a forward "
                    f"of {own.size(0)}"
                )
            same = recorded.sort(-1).values == own.sort(-1).values
            own_differs.logical_or_(known & ~same.all(-1))
            if not self.replay:
                ran_differs.logical_or_(known & ~same.all(-1))
                return None
            used = torch.where(known[:, None], recorded, own)
            ran_differs.logical_or_(known & (used != recorded).any(-1))
            gates = torch.softmax(logits.float(), dim=-1).gather(-1, used)
            if getattr(module, "norm_topk_prob", True):  # Mixtral always normalizes
                gates = gates / gates.sum(-1, keepdim=True)
            return logits, gates.to(scores.dtype), used

        return hook

    def take(self) -> dict[str, float]:
        """The counts since the last `take` as metrics (none when no token counted)."""
        if not self.tokens:
            return {}
        metrics = {
            "routing/tokens": float(self.tokens),
            "routing/router_mismatch": self.router_mismatch / self.tokens,
            "routing/ran_mismatch": self.ran_mismatch / self.tokens,
        }
        self.tokens = self.router_mismatch = self.ran_mismatch = 0
        return metrics
