"""Expert parallelism (EP) of a HF mixture-of-experts decoder, with torch.distributed.

Each rank of the group keeps a contiguous chunk of every MoE layer's experts
(split as `torch.chunk` splits the expert dim: rank i holds the experts of
chunk i, fewer or none when the count does not divide evenly). The router
(`mlp.gate`) is left as it is and runs on every rank for its own tokens, so
routing replay (`meshrl.model.routing`), which hooks the router's output,
works unchanged. Only the experts module's forward is replaced:

1. each (token, top-k slot) of this rank goes to the rank that owns its
   expert (`all_to_all_single` of `torch.distributed.nn.functional`, which
   has autograd: its backward is the reverse all-to-all);
2. the owner runs the expert MLP exactly as transformers'
   `Qwen3MoeExperts.forward` does (`act(x @ gate.T) * (x @ up.T)`, then
   `@ down.T`, the same activation), and sends the results back;
3. the sending rank multiplies them by the routing weights and sums them per
   token (`index_add`), as HF does: the same output as the unsplit module.

Which modules: those holding stacked expert weights, found by their structure
(`is_experts`): every parameter of the module itself is 3-D, stacked over
the expert dim, and either the class name ends in "Experts" (transformers 5:
`Qwen3MoeExperts`, `Qwen2MoeExperts`, `MixtralExperts`, ...) or the module
has an int `num_experts` that is the first dim of each. The forward handled
is the gated one of `Qwen3MoeExperts` (`gate_up_proj` [E, 2I, H], `down_proj`
[E, H, I]); a module of that structure with other parameter names is refused.
The new forward is set on the instance (`module.forward`), so it replaces
transformers' dispatch on `config._experts_implementation` (grouped_mm by
default in 5.24) for that module: the owner computes as the eager loop does.

Gradients. The data-parallel wrapper (DDP, FSDP2) averages every other
parameter's gradient over the ranks; the experts made rank-local must be left
out of it (`ddp_ignore`, `meshrl.procs.parallel.shard_layers`). Their owner receives, through
the all-to-all's backward, the sum over the ranks of each rank's loss
gradient. The forward scales that by 1/ep on the way to the parameters
(`_ScaleGrad`, identity forward; the gradient of the hidden states that goes
back to the senders is not scaled), which is DDP's average: with each rank's
loss built as `meshrl.model.losses.LossScale` builds it (ranks * its terms /
global count), an expert's gradient is the one a single proc computes on the
whole batch. This assumes the EP group is the whole data-parallel world, as
`group=None` (a group of every rank) is; experts replicated over several EP
groups would also need averaging across them, which is not done here.

DDP: `ddp_ignore(model, expert_parallel(model))` before wrapping, so DDP
neither broadcasts nor reduces the rank-local chunks. FSDP2: torch 2.13's
`fully_shard` takes `ignored_params` (not sharded, not moved, no gradient
reduction); `meshrl.procs.parallel.shard_layers` passes the chunks there for each
decoder layer and the root.
"""

from __future__ import annotations

import types
import warnings

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_to_all_single

# torch 2.13 marks the autograd all-to-all of torch.distributed.nn.functional as
# deprecated (a FutureWarning at each call) in favour of the functional collectives;
# it still works as documented, and is the one used here.
warnings.filterwarnings(
    "ignore",
    message=r"torch\.distributed\.nn\.functional\.all_to_all_single is deprecated",
    category=FutureWarning,
)

WEIGHTS = ("gate_up_proj", "down_proj")
"""The stacked expert parameters the replaced forward computes with."""


def is_experts(module: torch.nn.Module) -> bool:
    """True for a module of stacked expert weights: its own parameters are all
    3-D and it is named like HF's (class name ending in "Experts") or has an int
    `num_experts` equal to each one's first dim. Also true once `expert_parallel`
    has split it."""
    own = list(module.parameters(recurse=False))
    if not own or any(p.dim() != 3 for p in own):
        return False
    if getattr(module, "_meshrl_ep", None) is not None:
        return True
    if type(module).__name__.endswith("Experts"):
        return True
    count = getattr(module, "num_experts", None)
    return isinstance(count, int) and all(p.size(0) == count for p in own)


def expert_names(model: torch.nn.Module) -> list[str]:
    """Names (as `model.named_parameters` gives them) of the stacked expert
    parameters of `model`, in module order."""
    return [
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules()
        if is_experts(module)
        for name, _ in module.named_parameters(recurse=False)
    ]


def expert_range(experts: int, ep: int, rank: int) -> tuple[int, int]:
    """[start, end) of the experts `rank` holds: `torch.chunk(range(experts), ep)[rank]`,
    empty where chunk gives fewer than `ep` chunks."""
    size = -(-experts // ep)
    return min(rank * size, experts), min((rank + 1) * size, experts)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times `scale` in backward."""

    @staticmethod
    def forward(ctx, tensor, scale):
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _exchange(
    tensor: torch.Tensor, send: list[int], receive: list[int], group, grad: bool
) -> torch.Tensor:
    """All-to-all of the rows of `tensor`: `send[r]` rows to rank r, `receive[r]` from
    it. With `grad` (the same on every rank) through autograd, `tensor` made to
    require grad if it does not: every rank then runs the backward's reverse
    all-to-all, which a rank left out of it would leave the others waiting in."""
    out = tensor.new_empty((sum(receive), *tensor.shape[1:]))
    if grad:
        if not tensor.requires_grad:
            tensor = tensor.detach().requires_grad_()
        return all_to_all_single(out, tensor.contiguous(), receive, send, group=group)
    dist.all_to_all_single(out, tensor.contiguous(), receive, send, group=group)
    return out


def _forward(
    self,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """`Qwen3MoeExperts.forward` with the experts spread over `self._meshrl_ep`'s group."""
    group, ep, start, end, size = self._meshrl_ep
    tokens, top_k = top_k_index.shape
    experts = top_k_index.reshape(-1)
    token = torch.arange(tokens, device=experts.device).repeat_interleave(top_k)
    slot = torch.arange(top_k, device=experts.device).repeat(tokens)
    # HF skips index num_experts (no expert); ids out of range go nowhere here too.
    keep = (experts >= 0) & (experts < self.num_experts)
    order = torch.argsort(torch.where(keep, experts, self.num_experts), stable=True)
    order = order[: int(keep.sum())]  # slots sorted by expert, hence by owner
    experts, token, slot = experts[order], token[order], slot[order]
    send = torch.bincount(experts // size, minlength=ep)
    receive = torch.empty_like(send)
    dist.all_to_all_single(receive, send, group=group)  # counts first
    send, receive = send.tolist(), receive.tolist()

    # Owner side: the received rows of each local expert, as HF computes them.
    weights = (self.gate_up_proj, self.down_proj)
    grad = torch.is_grad_enabled() and (
        hidden_states.requires_grad or any(w.requires_grad for w in weights)
    )
    arrived = _exchange(hidden_states[token], send, receive, group, grad)
    wanted = _exchange(experts, send, receive, group, False) - start
    gate_up, down = (_ScaleGrad.apply(w, 1.0 / ep) for w in weights)
    # A rank without experts receives no rows (`arrived` is empty, still in the graph).
    computed = arrived if end == start else arrived.new_zeros(arrived.shape)
    for local in range(end - start):  # every local expert, hit or not: `arrived` in the graph
        rows = torch.nonzero(wanted == local).squeeze(-1)
        gate, up = torch.nn.functional.linear(arrived[rows], gate_up[local]).chunk(2, dim=-1)
        out = torch.nn.functional.linear(self.act_fn(gate) * up, down[local])
        computed = computed.index_add(0, rows, out.to(computed.dtype))

    # Sender side: results back, weighted and summed per token.
    returned = _exchange(computed, receive, send, group, grad)
    returned = returned * top_k_weights[token, slot, None]
    final = torch.zeros_like(hidden_states)
    return final.index_add(0, token, returned.to(final.dtype))


def expert_parallel(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> list[str]:
    """Split, in place, every experts module of `model` (`is_experts`) over the
    ranks of `group`: each keeps its chunk of the expert dim as new, smaller
    Parameters, and its forward exchanges tokens with the owners (see the
    module's docstring, gradients included).

    `group` None: a new group of the whole world (`dist.new_group`, collective),
    EP's own. The all-to-alls of the backward run in the autograd thread, in
    the graph's order, while DDP's bucket all-reduces (and FSDP2's reduce-scatters)
    start when their gradients are ready, in an order that may differ by rank:
    on one gloo group their sequence numbers would pair unlike collectives.

    Returns the names of the expert parameters made rank-local, for the
    data-parallel wrapper to leave out (`ddp_ignore`, `meshrl.procs.parallel.shard_layers`).
    Every rank must call it on an identical model (same seed or weights). A
    rank that holds no experts (more ranks than `torch.chunk` makes chunks)
    keeps empty parameters, which get no gradient. Each rank's state dict then
    holds its own chunk only: gathering the experts to save a whole model is
    not done here."""
    if group is None:
        group = dist.new_group()
    ep = dist.get_world_size(group)
    rank = dist.get_rank(group)
    names = []
    for prefix, module in model.named_modules():
        if not is_experts(module) or getattr(module, "_meshrl_ep", None) is not None:
            continue
        own = dict(module.named_parameters(recurse=False))
        if set(own) != set(WEIGHTS) or not hasattr(module, "act_fn"):
            raise ValueError(
                f"expert parallelism: '{prefix}' ({type(module).__name__}) holds "
                f"{sorted(own)}, not the gated experts {list(WEIGHTS)} it can split"
            )
        count = own[WEIGHTS[0]].size(0)
        start, end = expert_range(count, ep, rank)
        for name, param in own.items():
            local = param.detach()[start:end].clone()
            setattr(module, name, torch.nn.Parameter(local, requires_grad=param.requires_grad))
            names.append(f"{prefix}.{name}" if prefix else name)
        module.num_experts = count  # the global count: the routers' expert ids
        module._meshrl_ep = (group, ep, start, end, -(-count // ep))
        module.forward = types.MethodType(_forward, module)
    return names


def ddp_ignore(model: torch.nn.Module, names: list[str]) -> None:
    """Have a DDP made of `model` afterwards neither broadcast nor average the
    parameters `names` (the rank-local experts). Call before wrapping."""
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, list(names)
    )


def expert_blocks(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Each rank-local expert parameter of `model` (after `expert_parallel`): where
    its chunk starts in the whole parameter, and the whole parameter's shape (for
    publishing and checkpointing the chunk as the block of the whole it is)."""
    found = {}
    for prefix, module in model.named_modules():
        placed = getattr(module, "_meshrl_ep", None)
        if placed is None:
            continue
        _, _, start, _, _ = placed
        for name, param in module.named_parameters(recurse=False):
            whole = (module.num_experts, *param.shape[1:])
            found[f"{prefix}.{name}" if prefix else name] = (
                (start,) + (0,) * (param.dim() - 1),
                whole,
            )
    return found


def gather_blocks(state: dict[str, torch.Tensor], blocks: dict) -> dict[str, torch.Tensor]:
    """`state` (name -> this rank's tensor) with each parameter of `blocks`
    (`expert_blocks`) whole: the ranks' chunks gathered and joined on dim 0, on
    every rank (collective over the world)."""
    if not blocks:
        return state
    chunks: list = [None] * dist.get_world_size()
    mine = {name: state[name] for name in blocks if name in state}
    dist.all_gather_object(chunks, mine)
    whole = dict(state)
    for name in mine:
        whole[name] = torch.cat([chunk[name] for chunk in chunks])
    return whole
