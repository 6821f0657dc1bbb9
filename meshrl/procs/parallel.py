"""Data and tensor parallelism inside one role's mesh (trainer, critic).

Each proc of the mesh is one rank; the process group is local to the mesh
(gloo on CPU, NCCL when every rank has a GPU of its own). The layouts
(`placement.sharding`; `meshrl.procs.reshard.Layout` describes each):

- `ddp` keeps a full replica per rank and averages gradients;
- `fsdp` shards parameters, gradients and optimizer state over the ranks with
  FSDP2 (`fully_shard`, one unit per decoder layer plus the root);
- `tp` splits the decoder's linear layers over the ranks with DTensor
  (`meshrl.procs.tensor_parallel`), every rank seeing the same rows;
- `fsdp_tp` is both on a 2-D device mesh (dp, tp): tensor parallelism inside
  each group of `tp` ranks, FSDP2 across the groups.

Every layout but `ddp` checkpoints through torch.distributed.checkpoint, each
rank writing its own shards.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import tempfile
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from monarch.actor import Actor, endpoint

_STORES: dict[int, dist.TCPStore] = {}
"""The torch.distributed stores `Rendezvous` opened in this proc, by port, until the
role's rank 0 (an actor on the same proc) takes its own in `data_parallel`."""
STORE_TIMEOUT = timedelta(seconds=300)
FILE_STORE = "file://"
"""How a `master` names a FileStore (`private_store`) rather than a TCP address."""
_PRIVATE_DIRS: set[str] = set()
"""The store directories `private_store` made in this proc and has not removed yet."""


def private_store() -> str:
    """A `master` address for a process group whose ranks all run on this host:
    ``file://`` and the path of a torch.distributed FileStore in a new directory of
    its own, mode 0700 (`tempfile.mkdtemp`). Only this uid (and root) can list the
    directory or open the store in it, the kernel enforcing it, so no other local
    user reads or rewrites what the ranks exchange (gloo's addresses), as any
    could at a TCPStore on loopback (`serve_store`).

    What stays reachable: gloo's own listening sockets on 127.0.0.1, plain TCP
    with no credential. Another local user can connect to them; established
    connections between ranks are the kernel's and out of its reach, but a
    connection that gloo's listener takes before the real peer's, announcing the
    pair's sequence number while a group forms, would be taken for that peer.

    The directory goes with `remove_private_store` (the `Rendezvous` that made it
    stopping: its role's procs stopped at the run's close or replaced), or at
    this proc's exit (and with the controller's `RoleMeshes`: `remove_with`);
    torch itself removes the store file once every rank's FileStore is gone."""
    where = tempfile.mkdtemp(prefix="meshrl-store-")
    if not _PRIVATE_DIRS:
        atexit.register(_remove_private_stores)
    _PRIVATE_DIRS.add(where)
    return FILE_STORE + os.path.join(where, "store")


def remove_private_store(address: str) -> None:
    """Remove the directory of `private_store`'s `address` (made in this proc), if
    still there."""
    where = os.path.dirname(address[len(FILE_STORE) :])
    if where in _PRIVATE_DIRS:
        _PRIVATE_DIRS.discard(where)
        shutil.rmtree(where, ignore_errors=True)


def remove_with(owner: object, master: tuple[str, int]) -> tuple[str, int]:
    """`master`, whose `private_store` directory (if it is one) is also removed when
    `owner` (the controller's `RoleMeshes`, on this host) is collected or this
    process exits: for a proc 0 killed before it could remove its own."""
    if master[0].startswith(FILE_STORE):
        where = os.path.dirname(master[0][len(FILE_STORE) :])
        weakref.finalize(owner, shutil.rmtree, where, True)
    return master


def _remove_private_stores() -> None:
    for where in list(_PRIVATE_DIRS):
        remove_private_store(FILE_STORE + os.path.join(where, "store"))


def serve_store(loopback: bool) -> tuple[str, int]:
    """Open, in this proc, the TCPStore a process group meets at; (address, port)
    the other ranks dial. `loopback`: a run on this host only, which no other
    machine can reach (127.0.0.1); `Rendezvous` gives such a run a `private_store`
    instead.

    The port is the kernel's pick for a socket bound here and held from then on,
    so no other process can take it before rank 0 serves on it (a port found free
    and let go can be handed to another group meanwhile: two groups on one port
    exchange each other's tensors, silently).

    Not guarded: torch 2.13's TCPStore takes no key or credential (its options are
    port, server or not, workers, timeout, multi-tenant, a listening fd and libuv;
    each client's handshake is a fixed public magic number) and serves TCP only,
    and any client may list every key (LIST_KEYS), so a secret key prefix would hide
    nothing. Across hosts (slurm) this is the gap that remains: whoever can reach
    rank 0's host at this port can read and rewrite the rendezvous. gloo (the only
    transport this torch builds is plain TCP) takes no credential either."""
    listener = socket.socket()
    listener.bind(("127.0.0.1" if loopback else "", 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    # The store serves on the socket (master_listen_fd) and owns it from here on.
    _STORES[port] = dist.TCPStore(
        "127.0.0.1",
        port,
        None,
        True,
        STORE_TIMEOUT,
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
    )
    address = "127.0.0.1" if loopback else socket.gethostbyname(socket.gethostname())
    return address, port


class Rendezvous(Actor):
    """Spawned on a role's mesh before its data-parallel actors: on proc 0 (on
    each proc: `RoleMeshes.rendezvous_each`), where the process group it leads
    meets. A run on this host only: a `private_store`, removed when this actor
    stops (its procs stopped at the run's close, or replaced after a loss) or its
    proc exits. Across hosts: a TCPStore this proc serves (`serve_store`)."""

    def __init__(self) -> None:
        self.made: list[str] = []

    @endpoint
    def address(self, loopback: bool) -> tuple[str, int]:
        """`master` for `data_parallel`: (``file://`` path, 0) on this host only
        (`loopback`), else (address, port) the other ranks dial."""
        if loopback:
            self.made.append(private_store())
            return self.made[-1], 0
        return serve_store(loopback)

    def __cleanup__(self, exc: Exception | None) -> None:
        for address in self.made:
            remove_private_store(address)


@dataclass(frozen=True)
class Ranks:
    """This proc's place in a role's process group: its device, its rank of
    `world_size`, where the ranks meet (`master`, from `Rendezvous`), how many
    ranks a host holds (None: all on one) and how long a collective waits for
    the others (None: torch's default)."""

    device: torch.device
    rank: int
    world_size: int
    master: tuple[str, int]
    per_host: int | None = None
    timeout: timedelta | None = None


def init_group(ranks: Ranks) -> None:
    """Join this mesh's process group (gloo, or NCCL where every rank has a GPU of
    its own) at `master`, from `Rendezvous`: a FileStore's (``file://`` path, 0)
    when every rank runs on this host (`private_store`), else rank 0's (address,
    port), whose store rank 0 takes; or any free port of the caller's choosing.
    `timeout`: how long a collective waits for the other ranks before it fails
    (default: torch's)."""
    device, rank, world_size, timeout = ranks.device, ranks.rank, ranks.world_size, ranks.timeout
    address, port = ranks.master
    if address.startswith(FILE_STORE):  # this host only: each rank opens the file
        store = dist.FileStore(address[len(FILE_STORE) :], world_size)
    else:
        store = _STORES.pop(port, None) if rank == 0 else None
        if store is None and rank > 0:
            store = dist.TCPStore(address, port, world_size, False, STORE_TIMEOUT)
    # A run on this host: gloo listens on loopback too, not on the address the host
    # name resolves to.
    local = address.startswith(FILE_STORE) or address == "127.0.0.1"
    loopback = local and "GLOO_SOCKET_IFNAME" not in os.environ
    if loopback and "lo" in {name for _, name in socket.if_nameindex()}:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    # NCCL needs a GPU of its own per rank; with fewer GPUs than ranks, gloo.
    own_gpus = device.type == "cuda" and (ranks.per_host or world_size) <= torch.cuda.device_count()
    backend = "nccl" if own_gpus else "gloo"
    if store is None:  # rank 0 of a master the caller chose: it opens the store itself
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address, str(port)
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    else:
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )


def data_parallel(
    model: torch.nn.Module, ranks: Ranks, sharding: str = "ddp", tp: int = 1, ep: int = 1
) -> torch.nn.Module:
    """`model` made parallel over this mesh's procs: wrapped in DDP, or split in
    place (`sharding` fsdp, tp, or fsdp_tp with `tp` ranks per tensor-parallel
    group); itself when there is one proc. `ep` (every proc, with ddp or fsdp):
    a mixture of experts' experts spread over the procs first
    (`meshrl.procs.expert_parallel`), left out of DDP's and FSDP2's reduction.
    The ranks meet at `ranks.master` (`init_group`). Returns the module to call."""
    device, world_size = ranks.device, ranks.world_size
    if world_size == 1:
        return model
    init_group(ranks)
    experts: list[str] = []
    if ep > 1:
        from meshrl.procs.expert_parallel import ddp_ignore, expert_parallel

        experts = expert_parallel(model)
        if not experts:
            raise ValueError(f"placement.ep={ep}: the model has no experts to spread")
        if sharding == "ddp":
            ddp_ignore(model, experts)
    if sharding == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh

    from meshrl.procs.reshard import Layout

    layout = Layout.named(sharding, world_size, tp)
    dp = None  # FSDP2's own mesh over every rank
    if layout.tp > 1:
        from meshrl.procs.tensor_parallel import tensor_parallel

        mesh = init_device_mesh(device.type, (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))
        tensor_parallel(model, mesh["tp"])
        dp = mesh["dp"]
    if layout.fsdp:
        shard_layers(model, dp, experts)
    return model


def shard_layers(model: torch.nn.Module, mesh: Any = None, ignored: list[str] = ()) -> None:
    """FSDP2 over `mesh` (None: every rank): one unit per decoder layer of
    `model`, and `model` itself for the rest; the parameters named `ignored`
    (rank-local experts) stay plain tensors, their gradients not reduced."""
    from torch.distributed.fsdp import fully_shard

    left = {param for name, param in model.named_parameters() if name in set(ignored)}
    if len(left) != len(set(ignored)):
        raise ValueError("shard_layers: some ignored names are not parameters of the model")
    for module in model.modules():
        if type(module).__name__.endswith("DecoderLayer"):
            fully_shard(module, mesh=mesh, ignored_params=left & set(module.parameters()))
    fully_shard(model, mesh=mesh, ignored_params=left)


def pipeline_parallel(
    model: torch.nn.Module,
    ranks: Ranks,
    sharding: str = "pp",
    tp: int = 1,
    pp: int = 2,
    schedule: str = "1f1b",
    microbatches: int = 4,
    positions: Any = None,
) -> Any:
    """`model` cut, in place, to this rank's pipeline stages (`meshrl.procs.pipeline`)
    over a device mesh ("pp", "dp", "tp") of the `sharding` pp, fsdp_pp or
    fsdp_tp_pp: each stage tensor-parallel over `tp` ranks (fsdp_tp_pp), then
    FSDP2 over the dp ranks (fsdp_*) or DDP over them. Ranks are numbered as
    `meshrl.procs.reshard.Layout.rank` says (a data-parallel shard's procs
    adjacent). Returns the `meshrl.procs.pipeline.Pipeline` that runs them
    (`schedule` over `microbatches` micro-batches; interleaved: 2 stages a rank).
    `positions(mask)`: the model's position ids of left-padded rows (`Stage`)."""
    from torch.distributed.device_mesh import DeviceMesh

    from meshrl.procs.pipeline import Pipeline, prune
    from meshrl.procs.reshard import Layout

    device, rank = ranks.device, ranks.rank
    layout = Layout.named(sharding, ranks.world_size, tp, pp)
    init_group(ranks)
    tie_group = None
    if getattr(model.config, "tie_word_embeddings", False):  # stage 0's and the last's
        for i in range(layout.dp):
            for j in range(layout.tp):
                pair = [layout.rank(0, i, j), layout.rank(layout.pp - 1, i, j)]
                group = dist.new_group(pair)  # (every rank makes every group, in order)
                if rank in pair:
                    tie_group = group
    grid = [
        [[layout.rank(s, i, j) for j in range(layout.tp)] for i in range(layout.dp)]
        for s in range(layout.pp)
    ]
    mesh = DeviceMesh(device.type, torch.tensor(grid), mesh_dim_names=("pp", "dp", "tp"))
    s, _, _ = layout.coords(rank)
    virtual = 2 if schedule == "interleaved" else 1
    stages, indices = prune(model, layout.pp, s, virtual, positions)
    if layout.tp > 1:
        from meshrl.procs.tensor_parallel import tensor_parallel

        tensor_parallel(model, mesh["tp"])
    modules: list[torch.nn.Module] = []
    for stage in stages:
        if layout.fsdp:
            shard_layers(stage, mesh["dp"])
        elif layout.dp > 1:
            stage = torch.nn.parallel.DistributedDataParallel(
                stage, process_group=mesh["dp"].get_group()
            )
        modules.append(stage)
    return Pipeline(
        modules,
        indices,
        layout.pp * virtual,
        device,
        mesh["pp"].get_group(),
        schedule,
        microbatches,
        layout.coords(rank),
        tie_group,
    )


def is_sharded(model: torch.nn.Module) -> bool:
    """True when FSDP2 has sharded `model`'s parameters (DTensors)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def is_tensor_parallel(model: torch.nn.Module) -> bool:
    """True when some parameter of `model` is split over a tensor-parallel mesh
    dim (a DTensor whose mesh names `tp`)."""
    from torch.distributed.tensor import DTensor

    return any(
        isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ())
        for p in model.parameters()
    )


def full_parameters(model: torch.nn.Module):
    """(name, full tensor) of every parameter, one at a time. For a sharded
    model each is all-gathered: every rank must iterate, in the same order."""
    import logging

    from torch.distributed.tensor import DTensor

    # FSDP2 over TP gathers in two steps, and torch warns so from every rank, every
    # time: advice about speed, where a whole model is gathered only to save it.
    advice = logging.getLogger("torch.distributed.tensor._redistribute")
    level = advice.level
    advice.setLevel(logging.ERROR)
    try:
        for name, param in model.named_parameters():
            yield name, _gathered(param) if isinstance(param, DTensor) else param
    finally:
        advice.setLevel(level)


def _gathered(param) -> torch.Tensor:
    """A DTensor's full tensor; one-byte floats (FP8) gathered as their bytes
    (gloo has no FP8 collectives)."""
    from torch.distributed.tensor import DTensor

    if not (param.dtype.is_floating_point and param.element_size() == 1):
        return param.full_tensor()
    raw = DTensor.from_local(
        param.to_local().view(torch.uint8),
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )
    return raw.full_tensor().view(param.dtype)


def _state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer, flat: bool):
    """DCP's model and optimizer state dicts; `flat`: the optimizer's settings per
    parameter, not per group (a pipeline's ranks each hold other parameters, so
    their groups differ)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    return get_state_dict(model, optimizer, options=options)


def _as_blocks(state: dict, blocks: dict | None) -> dict:
    """A copy of `state` (DCP's model and optimizer state dicts) where the tensors
    of each parameter of `blocks` (name -> (start, whole shape): a rank's chunk of
    dim 0, split as `torch.chunk` splits it over every rank) are DTensors sharded
    on dim 0 over the world, aliasing the plain tensors: DCP saves and loads them
    as the pieces of one parameter."""
    if not blocks:
        return state
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    some = next(iter(state["model"].values()))
    mesh = init_device_mesh(some.device.type, (dist.get_world_size(),))

    def whole(name: str, tensor: torch.Tensor) -> torch.Tensor:
        shape = torch.Size(blocks[name][1])
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(
            tensor, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride
        )

    model = {k: whole(k, v) if k in blocks else v for k, v in state["model"].items()}
    optim = dict(state["optim"])
    optim["state"] = {
        k: {
            n: whole(k, v) if k in blocks and torch.is_tensor(v) and v.dim() else v
            for n, v in per.items()
        }
        for k, per in state["optim"]["state"].items()
    }
    return {"model": model, "optim": optim}


class ShardIndexError(ValueError):
    """An FSDP checkpoint's shard index that meshrl refuses to read; one line
    naming the file."""


def _metadata_global(module: str, name: str) -> Any:
    """What DCP's `.metadata` pickle may name: DCP's own metadata classes, torch
    sizes, dtypes and layouts, paths. Anything else (`os.system`, ...) is refused."""
    import enum
    import pathlib
    import pickle

    import torch.distributed.checkpoint.filesystem as dcp_fs
    import torch.distributed.checkpoint.metadata as dcp_metadata

    found = None
    if module == dcp_metadata.__name__:
        found = getattr(dcp_metadata, name, None)
        if not (
            isinstance(found, type)
            and (hasattr(found, "__dataclass_fields__") or issubclass(found, enum.Enum))
        ):
            found = None
    elif (module, name) == (dcp_fs.__name__, "_StorageInfo"):
        found = dcp_fs._StorageInfo
    elif (module, name) in (("pathlib", "PosixPath"), ("pathlib", "Path")):
        found = getattr(pathlib, name)
    elif (module, name) == ("torch", "Size"):
        found = torch.Size
    elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
        found = getattr(torch, name)
    elif (module, name) == ("torch.serialization", "_get_layout"):
        import torch.serialization as serialization

        found = serialization._get_layout
    elif (module, name) == ("collections", "OrderedDict"):
        import collections

        found = collections.OrderedDict
    if found is None:
        raise pickle.UnpicklingError(f"refused to build {module}.{name}")
    return found


def safe_reader(path: str) -> Any:
    """torch.distributed.checkpoint's reader of directory `path`, whose
    `.metadata` (a pickle in torch's format) is read by an unpickler that builds
    only `_metadata_global`'s classes: loading shards runs no code from the files.
    The shards themselves torch reads with `weights_only=True`."""
    import pickle

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            return _metadata_global(module, name)

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            where = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(where, "rb") as f:
                try:
                    metadata = Unpickler(f).load()
                except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as error:
                    raise ShardIndexError(
                        f"{where}: not a shard index meshrl reads ({error})"
                    ) from None
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)


def load_dcp(state: dict, path: str) -> None:
    """`dcp.load(state)` from directory `path` through `safe_reader`; a refused
    index fails here in one line naming it (DCP would wrap it in a traceback)."""
    import torch.distributed.checkpoint as dcp

    reader = safe_reader(path)
    reader.read_metadata()
    dcp.load(state, storage_reader=reader)


@dataclass
class ShardedState:
    """A sharded model and its optimizer as torch.distributed.checkpoint saves
    and loads them into a directory, each rank its own shards (both collective);
    a load reshards if the world size changed. `blocks`: plain tensors that are
    this rank's block of a larger parameter (`expert_blocks`), saved as such;
    `flat`: the optimizer state flattened per parameter (`_state_dicts`)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    blocks: dict | None = None
    flat: bool = False

    def _state(self) -> dict:
        model_state, optim_state = _state_dicts(self.model, self.optimizer, self.flat)
        return {"model": model_state, "optim": optim_state}

    def save(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(_as_blocks(self._state(), self.blocks), checkpoint_id=path)

    def load(self, path: str) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        state = self._state()
        load_dcp(_as_blocks(state, self.blocks), path)  # (into the plain tensors the blocks alias)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=StateDictOptions(flatten_optimizer_state_dict=self.flat),
        )


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def accumulated_step(
    parts: list,
    loss_of: Callable[[Any], tuple[torch.Tensor, dict[str, float]]],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    max_grad_norm: float | None,
    backward: Callable[[list], tuple[torch.Tensor, dict[str, float]]] | None = None,
    stages: Any = None,
    local: Any = (),
    mirrors: Any = (),
) -> tuple[float, dict[str, float], float, bool]:
    """One optimizer step over micro-batches `parts` (gradient accumulation):
    backward of each part's loss, whose losses add up to the batch's (see
    `meshrl.model.losses.LossScale`), then clip the gradient norm and step.
    `backward(parts)`: how the parts' gradients are made (default
    `backward_each`; a pipeline's schedule); `stages`: the process group of a
    pipeline's ranks, each holding other parameters, over which the norm is taken;
    `local`: parameters each rank holds its own part of, `mirrors` copies of
    another rank's (`clip`).

    Returns the summed loss, the summed metrics, the norm before clipping, and
    whether the step was skipped: a NaN or infinite loss or gradient on any rank
    skips it on every rank, leaving weights and optimizer state as they were."""
    optimizer.zero_grad(set_to_none=True)
    total, metrics = backward_each(parts, loss_of) if backward is None else backward(parts)
    grad_norm = clip(model, max_grad_norm, stages, local, mirrors)
    bad = (~torch.isfinite(total) | ~torch.isfinite(grad_norm.cpu())).float().reshape(1)
    if dist.is_available() and dist.is_initialized():
        # Each rank's own loss may differ; the ranks must still agree to skip.
        bad = bad.to(grad_norm.device)
        dist.all_reduce(bad)
    skipped = bool(bad.item() > 0)
    if skipped:
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()
    return total.item(), metrics, grad_norm.item(), skipped


def clip(
    model: torch.nn.Module,
    max_norm: float | None,
    stages: Any = None,
    local: Any = (),
    mirrors: Any = (),
) -> torch.Tensor:
    """Clip `model`'s gradients to a 2-norm of `max_norm` (None: no clipping);
    returns the norm before clipping, over every rank's parameters: shards'
    (FSDP2), tensor-parallel blocks', with `stages` (a pipeline's process group)
    every stage's, and of the parameters named `local` (each rank its own part:
    expert parallelism's experts) every rank's; those named `mirrors` (copies of
    another rank's parameter: a tied embedding's head) are clipped, not counted."""
    from meshrl.procs.tensor_parallel import clip_gradients

    named = list(model.named_parameters())
    parameters = [p for n, p in named if n not in local and n not in mirrors]
    mine = [p for n, p in named if n in local]
    copies = [p for n, p in named if n in mirrors]
    if stages is None and not mine and not is_tensor_parallel(model):
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm or float("inf"))
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor
    # Parameters on several meshes (plain tensors among them), stages or ranks.
    return clip_gradients(parameters, max_norm, stages, mine, copies)


def accumulated_gradients(
    parts: list,
    loss_of: Callable[[Any], tuple[torch.Tensor, dict[str, float]]],
    model: torch.nn.Module,
    backward: Callable[[list], tuple[torch.Tensor, dict[str, float]]] | None = None,
) -> dict[str, torch.Tensor]:
    """The gradient `accumulated_step` would step with (reduced over the ranks,
    before clipping), as CPU copies of the full tensors, without stepping;
    the gradients are cleared again. Collective when the model is data-parallel."""
    from torch.distributed.tensor import DTensor

    model.zero_grad(set_to_none=True)
    backward_each(parts, loss_of) if backward is None else backward(parts)
    grads = {}
    for name, param in model.named_parameters():
        if param.grad is not None:
            grad = param.grad
            grads[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).cpu().clone()
    model.zero_grad(set_to_none=True)
    return grads


def backward_each(
    parts: list, loss_of: Callable[[Any], tuple[torch.Tensor, dict[str, float]]]
) -> tuple[torch.Tensor, dict[str, float]]:
    """Backward of each part's loss, gradients accumulating; returns the summed
    loss and metrics. An empty part (a rank with fewer rows than micro-batches)
    runs the first part again with its loss times 0: every data-parallel rank
    must run as many forward/backward passes, and so collectives, as the others."""
    total, metrics = torch.zeros(()), {}
    for part in parts:
        empty = len(part) == 0
        loss, part_metrics = loss_of(parts[0] if empty else part)
        if empty:
            (loss * 0).backward()
            continue
        loss.backward()
        total = total + loss.detach().float().cpu()
        for key, value in part_metrics.items():
            metrics[key] = metrics.get(key, 0.0) + value
    return total, metrics
