"""Versioned weight publishing and pulling over Monarch RDMA buffers.

The trainer packs its parameters into a few large contiguous byte buckets,
registers each bucket once as an `RDMABuffer`, and on every publish copies the
current parameters into the buckets and hands out a `WeightHandle` (version,
layout, buffers). A policy replica pulls every bucket in one `RDMAAction` into a
local staging area and only then copies into its parameters and adopts the
version: a replica never serves a half-updated model.

On hosts without ibverbs Monarch carries RDMA over TCP (it warns once); the
path taken is reported by `rdma_backend()`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch

DEFAULT_BUCKET_MB = 256


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives inside the buckets."""

    name: str
    bucket: int
    offset: int  # bytes into the bucket
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def num_bytes(self) -> int:
        return _numel(self.shape) * _itemsize(self.dtype)


@dataclass
class WeightHandle:
    """A published version: small to pickle, points at the trainer's buckets."""

    version: int
    slots: list[ParamSlot]
    bucket_sizes: list[int]
    buffers: list  # list[RDMABuffer], one per bucket


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).view(torch.uint8)


def plan_buckets(
    named: list[tuple[str, torch.Tensor]], bucket_bytes: int
) -> tuple[list[ParamSlot], list[int]]:
    """Assign parameters, in order, to buckets of at most `bucket_bytes`
    (a single larger parameter gets a bucket of its own)."""
    slots, sizes = [], [0]
    for name, tensor in named:
        num_bytes = tensor.numel() * tensor.element_size()
        if sizes[-1] and sizes[-1] + num_bytes > bucket_bytes:
            sizes.append(0)
        slots.append(ParamSlot(name, len(sizes) - 1, sizes[-1], tuple(tensor.shape), tensor.dtype))
        sizes[-1] += num_bytes
    return slots, sizes


def rdma_backend() -> str:
    """'ibverbs', 'tcp' (Monarch's fallback) or 'none'."""
    from monarch.rdma import get_rdma_backend

    return get_rdma_backend()


class WeightPublisher:
    """Trainer side. Call `publish(version)` after an optimizer step."""

    def __init__(self, model: torch.nn.Module, bucket_mb: int = DEFAULT_BUCKET_MB):
        self.params = dict(model.named_parameters())
        self.slots, self.bucket_sizes = plan_buckets(
            list(self.params.items()), bucket_mb * 1024 * 1024
        )
        device = next(iter(self.params.values())).device
        self.buckets = [torch.empty(n, dtype=torch.uint8, device=device) for n in self.bucket_sizes]
        self._buffers: list | None = None  # registered lazily: needs a Monarch actor context

    @torch.no_grad()
    def publish(self, version: int, named: Iterable | None = None) -> WeightHandle:
        """Copy the parameters into the buckets as `version`. `named` yields
        (name, tensor) in `named_parameters` order instead of reading the
        parameters (a sharded trainer passes them all-gathered)."""
        tensors = named if named is not None else self.params.items()
        for slot, (name, tensor) in zip(self.slots, tensors, strict=True):
            assert name == slot.name, (name, slot.name)
            start = slot.offset
            self.buckets[slot.bucket][start : start + slot.num_bytes].copy_(_as_bytes(tensor))
        if self._buffers is None:
            from monarch.rdma import RDMABuffer, RDMATcpFallbackWarning

            with warnings.catch_warnings():
                # Reported once through rdma_backend() in the run metrics instead.
                warnings.simplefilter("ignore", RDMATcpFallbackWarning)
                self._buffers = [RDMABuffer(b) for b in self.buckets]
        return WeightHandle(version, self.slots, self.bucket_sizes, self._buffers)


class WeightReceiver:
    """Policy side. `pull(handle)` makes the local model equal to that version."""

    def __init__(self, model: torch.nn.Module, timeout_s: int = 120, prefix: str | None = None):
        # With `prefix`, `model` is a part of the published one (a critic's backbone
        # is the policy's `model.` submodule): only the names under it are taken.
        self.partial = prefix is not None
        self.params = {f"{prefix or ''}{n}": p for n, p in model.named_parameters()}
        self.version = -1
        self.timeout_s = timeout_s
        self._staging: list[torch.Tensor] = []

    @torch.no_grad()
    def pull(self, handle: WeightHandle) -> None:
        from monarch.rdma import RDMAAction

        published = [s.name for s in handle.slots]
        if self.partial:
            missing = set(self.params) - set(published)
        else:
            missing = set() if published == list(self.params) else set(self.params) ^ set(published)
        if missing:
            raise ValueError(f"published weights do not match this model: {sorted(missing)[:5]}")
        if [t.numel() for t in self._staging] != handle.bucket_sizes:
            device = next(iter(self.params.values())).device
            self._staging = [
                torch.empty(n, dtype=torch.uint8, device=device) for n in handle.bucket_sizes
            ]
        action = RDMAAction()
        for local, remote in zip(self._staging, handle.buffers, strict=True):
            action.read_remote(local, remote)
        action.submit(timeout=self.timeout_s).get()
        # All bytes are here: now switch the model over in one pass.
        for slot in handle.slots:
            param = self.params.get(slot.name)
            if param is None:  # partial receiver: not part of this model
                continue
            if tuple(param.shape) != slot.shape or param.dtype != slot.dtype:
                raise ValueError(
                    f"parameter {slot.name}: local {tuple(param.shape)} {param.dtype}, "
                    f"published {slot.shape} {slot.dtype}"
                )
            start = slot.offset
            _as_bytes(param).copy_(self._staging[slot.bucket][start : start + slot.num_bytes])
        self.version = handle.version
