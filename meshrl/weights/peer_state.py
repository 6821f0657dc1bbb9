"""A replica's state handed from a surviving rank to the ranks that replace a lost one.

A data-parallel trainer (DDP) holds the same model, optimizer, schedule and
generator state on every rank, so when one rank's proc dies, its peers still
hold everything the run needs: nothing has to come back from a checkpoint.
`Supervisor.heal` asks a surviving rank for its state (`share_state`: packed
into one byte buffer, registered as a Monarch `RDMABuffer`, with its checksum),
replaces the role's procs, and every new rank reads that buffer
(`take_state`: over RDMA, Monarch's TCP fallback where the host has no RDMA
device), checks it and loads it. A sharded trainer (FSDP2) has no such peer.

`pack` and `unpack` are the pure part: nested dicts and lists of tensors and
plain values to one aligned uint8 buffer and a skeleton of plain values, and
back, bit for bit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from monarch.actor import endpoint

from meshrl.weights.checksum import checksum

_ALIGN = 16  # every tensor starts at a multiple: a view of any dtype needs it


@dataclass(frozen=True)
class Packed:
    """Where one tensor lies in the packed buffer."""

    offset: int
    num_bytes: int
    dtype: str
    shape: tuple[int, ...]


def pack(state: Any) -> tuple[torch.Tensor, Any]:
    """(uint8 CPU buffer, skeleton): every tensor in `state` (dicts, lists and
    tuples of them and of plain values, as `state_dict()`s are) copied into one
    buffer, each replaced in the skeleton by its `Packed` place."""
    tensors: list[tuple[torch.Tensor, Packed]] = []
    size = 0

    def place(value: Any) -> Any:
        nonlocal size
        if isinstance(value, torch.Tensor):
            value = value.detach()
            nbytes = value.numel() * value.element_size()
            dtype = str(value.dtype).removeprefix("torch.")
            tensors.append((value, Packed(size, nbytes, dtype, tuple(value.shape))))
            size += -(-nbytes // _ALIGN) * _ALIGN
            return tensors[-1][1]
        if isinstance(value, dict):
            return {k: place(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(place(v) for v in value)
        return value

    skeleton = place(state)
    buffer = torch.empty(max(size, 1), dtype=torch.uint8)
    for tensor, at in tensors:
        if at.num_bytes:
            data = tensor.reshape(-1).contiguous().cpu().view(torch.uint8)
            buffer[at.offset : at.offset + at.num_bytes].copy_(data)
    return buffer, skeleton


def unpack(buffer: torch.Tensor, skeleton: Any, device: torch.device | str = "cpu") -> Any:
    """`pack`'s state again, every tensor a copy on `device` (none is a view of
    `buffer`, which may be reused)."""
    if isinstance(skeleton, Packed):
        data = buffer[skeleton.offset : skeleton.offset + skeleton.num_bytes]
        dtype = getattr(torch, skeleton.dtype)
        tensor = data.clone().view(dtype) if skeleton.num_bytes else torch.empty(0, dtype=dtype)
        return tensor.reshape(skeleton.shape).to(device)
    if isinstance(skeleton, dict):
        return {k: unpack(buffer, v, device) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(unpack(buffer, v, device) for v in skeleton)
    return skeleton


@dataclass
class Staged:
    """A surviving rank's state, ready to be read: its RDMA buffer, the
    skeleton to unpack it with, its size and checksum."""

    buffer: Any  # monarch.rdma.RDMABuffer
    skeleton: Any
    num_bytes: int
    checksum: int
    rank: int


class PeerState:
    """Mixed into a data-parallel actor whose ranks are replicas of each other:
    `peer_state()` gives what a new rank needs (state dicts, counters, the
    generators' states), `load_peer_state(state)` takes it."""

    _staged: torch.Tensor | None = None
    _probe: Any = None

    def ready_to_share(self) -> None:
        """Register a first RDMA buffer now, while every proc of the mesh lives:
        Monarch sets up RDMA on the whole proc mesh at a proc's first buffer, and
        cannot once one proc is gone (`share_state` would wait for it)."""
        from monarch.rdma import RDMABuffer

        from meshrl.weights.publisher import registering

        with registering():
            self._probe = RDMABuffer(torch.zeros(_ALIGN, dtype=torch.uint8))

    def peer_state(self) -> dict:
        raise NotImplementedError

    def load_peer_state(self, state: dict) -> None:
        raise NotImplementedError

    @endpoint
    def share_state(self) -> Staged:
        """This rank's state packed and registered for its replacements to read;
        kept until this proc ends (its mesh is stopped once they have it)."""
        from monarch.rdma import RDMABuffer

        from meshrl.weights.publisher import registering

        state = {**self.peer_state(), "generator": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda_generator"] = torch.cuda.get_rng_state()
        self._staged, skeleton = pack(state)
        with registering():
            buffer = RDMABuffer(self._staged)
        rank = getattr(self, "rank", 0)
        return Staged(buffer, skeleton, self._staged.numel(), checksum(self._staged), rank)

    @endpoint
    def take_state(self, staged: Staged, timeout_s: float = 60.0) -> float:
        """Read a peer's `Staged` state, check it and load it; the seconds it took."""
        from monarch.rdma import RDMAAction

        from meshrl.weights.publisher import without_cuda_probe_line

        started = time.perf_counter()
        local = torch.empty(staged.num_bytes, dtype=torch.uint8)
        action = RDMAAction()
        action.read_remote(local, staged.buffer)
        with without_cuda_probe_line():
            action.submit(timeout=max(1, int(timeout_s))).get()
        got = checksum(local)
        if got != staged.checksum:
            raise RuntimeError(
                f"the state read from rank {staged.rank} does not match its checksum "
                f"({got} != {staged.checksum}): not loaded"
            )
        state = unpack(local, staged.skeleton)
        torch.set_rng_state(state.pop("generator"))
        cuda = state.pop("cuda_generator", None)
        if cuda is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(cuda)
        self.load_peer_state(state)
        return time.perf_counter() - started
