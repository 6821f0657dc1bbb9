"""Versioned weight publishing and pulling: shared memory on one host, Monarch
RDMA buffers across hosts.

Each trainer proc that owns weights (rank 0 of a replicated trainer, every rank
of an FSDP2-sharded one) lays its parameters (its shards, when sharded) out
once in a few byte slots: files in /dev/shm, mapped by the trainer and
registered once as `RDMABuffer`s. There are two slots (double buffering):
version v is written into slot v % 2, so replicas may still be reading
version v - 1 while the trainer writes v.

Every slot starts with a header that makes versions safe to read (a seqlock):
the trainer sets it to 2v + 1 before writing version v and to 2v + 2 after. A
reader checks the header before and after copying; a version overwritten
while it was read is detected and never served (`TornWeights`).

A replica pulls every source (one per owning trainer proc) of a
`WeightHandle`: from the shared-memory file when it runs on the same host
(one memcpy), else with one `RDMAAction` of all reads, over ibverbs where the
host has it and Monarch's TCP fallback otherwise. A sharded trainer's
replicas take each shard straight from the proc that owns it; nothing is
gathered on one proc first. `WeightReceiver.path` says which way the last
pull went.

Each version carries a checksum per piece (one parameter, or its shard), taken
by the trainer over the bytes it writes into the slot, as it writes them
(`meshrl.checksum`). A replica checks
what it then serves, its parameters, against them (`WeightMismatch` names
what differs): a corrupted or missing slot, a pull that did not land, a
version other than the one asked for all fail the pull instead of being
served.

A replica can relay: `pull(handle, serve=True)` also publishes the version it
now holds from slots of its own (the same layout, seqlock and double
buffering as the trainer's), and returns that handle, so other replicas pull
it from there instead of from the trainer (`meshrl.weight_sync` arranges the
tree). Its header says "writing" from before the copy until the last byte is
in, so a child never takes a torn relay copy either.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import socket
import sys
import tempfile
import uuid
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from meshrl.checksum import checksum, copy_summed
from meshrl.mesh import HOST_TAG_ENV, debugging

HEADER_BYTES = 64
SLOTS = 2
SHM_DIR = "/dev/shm"


def host_id() -> str:
    """This machine: host name and boot id (shared memory is per boot), and the
    `process` job host the proc runs on, if any (each counts as a machine)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    tag = os.environ.get(HOST_TAG_ENV)
    return f"{socket.gethostname()}/{boot}" + (f"/{tag}" if tag else "")


class TornWeights(RuntimeError):
    """A version was overwritten while a replica read it."""


class WeightMismatch(RuntimeError):
    """A replica's parameters after a pull differ from the trainer's checksums."""


@dataclass(frozen=True)
class ParamPiece:
    """Where (a dim-0 block of) one parameter lives in a source's slots."""

    name: str
    offset: int  # bytes into the slot's data
    shape: tuple[int, ...]  # of this piece
    dtype: torch.dtype
    row: int  # first dim-0 row of the full parameter this piece holds
    full_shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        n = torch.Size(self.shape).numel()
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class WeightSource:
    """One trainer proc's published bytes (small to pickle)."""

    host: str
    paths: list[str]  # one shared-memory file per slot
    buffers: list  # one RDMABuffer per slot (header + data)
    headers: list  # one RDMABuffer per slot's header, to read it again after the data
    pieces: list[ParamPiece]
    data_bytes: int
    checksums: list[int] | None = None  # per piece, of the published version; None: unchecked


@dataclass
class WeightHandle:
    """A published version: where each owning proc's bytes are."""

    version: int
    sources: list[WeightSource]

    @property
    def slot(self) -> int:
        return self.version % SLOTS

    @staticmethod
    def merge(handles: list[WeightHandle | None]) -> WeightHandle:
        """One handle from the per-rank handles of a trainer's publish (ranks that
        own nothing return None)."""
        owned = [h for h in handles if h is not None]
        versions = {h.version for h in owned}
        assert len(versions) == 1, f"trainer ranks published versions {versions}"
        return WeightHandle(owned[0].version, [s for h in owned for s in h.sources])


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).view(torch.uint8)


def _local_piece(name: str, param: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This proc's part of `param` and its first dim-0 row: the whole tensor, or
    an FSDP2 shard (`Shard(0)`, split like `torch.chunk`)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return param.detach(), 0
    local = param.to_local().detach()
    mesh = param.device_mesh
    rows = param.shape[0]
    chunk = -(-rows // mesh.size())
    row = min(mesh.get_local_rank() * chunk, rows)
    assert local.shape[0] == max(0, min(chunk, rows - row)), (name, local.shape, row)
    return local, row


def _map_file(path: str, size: int) -> torch.Tensor:
    """The shared-memory file at `path` as a uint8 tensor (mapped, shared)."""
    return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)


CUDA_PROBE = "[RdmaXcel] Can't open libcuda.so.1"
"""What Monarch's RDMA library prints on a host without CUDA, every time: expected."""
_probed = False


@contextlib.contextmanager
def without_cuda_probe_line():
    """Run the block with this process's stderr (fd 2, where Monarch's C library
    writes) captured, then pass on every line but the CUDA probe's. The library
    probes once per process, at its first RDMA call: later blocks run as they
    are. On a GPU host, or with MESHRL_DEBUG set, nothing is filtered."""
    global _probed
    if _probed or debugging() or torch.cuda.is_available():
        yield
        return
    _probed = True
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            lines = captured.read().decode(errors="replace").splitlines(keepends=True)
            kept = [line for line in lines if not line.startswith(CUDA_PROBE)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def rdma_backend() -> str:
    """'ibverbs', 'tcp' (Monarch's fallback) or 'none'."""
    from monarch.rdma import get_rdma_backend

    return get_rdma_backend()


class WeightPublisher:
    """Trainer side: `publish(version)` after an optimizer step. Every proc that
    owns weights has one; `close()` (or process exit) removes its files."""

    def __init__(
        self,
        model: torch.nn.Module | None,
        prefix: str | None = None,
        rdma: bool = True,
        parameters: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None = None,
    ):
        """`parameters` gives the (name, tensor) pairs to publish, called at each
        publish (default: the model's parameters; LoRA: the merged weights)."""
        self.parameters = parameters or model.named_parameters
        self.pieces, offset = [], 0
        for name, param in self.parameters():
            local, row = _local_piece(name, param)
            piece = ParamPiece(
                name, offset, tuple(local.shape), local.dtype, row, tuple(param.shape)
            )
            self.pieces.append(piece)
            offset += -(-piece.num_bytes // 64) * 64  # aligned: whole words to sum
        self.data_bytes = offset
        prefix = prefix or f"meshrl-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.paths = [f"{SHM_DIR}/{prefix}-{uuid.uuid4().hex[:6]}-slot{i}" for i in range(SLOTS)]
        self.slots = []
        for path in self.paths:
            with open(path, "wb") as f:
                f.truncate(HEADER_BYTES + self.data_bytes)
            self.slots.append(_map_file(path, HEADER_BYTES + self.data_bytes))
        atexit.register(self.close)
        # Registered lazily (needs a Monarch actor context); rdma=False: same host only.
        self._buffers: list | None = None if rdma else []
        self._headers: list = []
        self.host = host_id()

    def header(self, slot: int) -> torch.Tensor:
        return self.slots[slot][:8].view(torch.int64)

    @torch.no_grad()
    def publish(self, version: int, verify: bool = True) -> WeightHandle:
        """Write `version` into slot version % 2 and return its handle. `verify`:
        the handle carries each piece's checksum, taken over the slot's bytes
        chunk by chunk as they are written."""
        slot = version % SLOTS
        data = self.slots[slot][HEADER_BYTES:]
        self.header(slot).fill_(2 * version + 1)  # writing
        sums = []
        for piece, (_, param) in zip(self.pieces, self.parameters(), strict=True):
            local, _ = _local_piece(piece.name, param)
            target = data[piece.offset : piece.offset + piece.num_bytes]
            sums.append(copy_summed(target, _as_bytes(local), verify))
        self.header(slot).fill_(2 * version + 2)  # complete
        if self._buffers is None:
            from monarch.rdma import RDMABuffer, RDMATcpFallbackWarning

            with warnings.catch_warnings(), without_cuda_probe_line():
                # Reported once through rdma_backend() in the run metrics instead.
                warnings.simplefilter("ignore", RDMATcpFallbackWarning)
                self._buffers = [RDMABuffer(s) for s in self.slots]
                self._headers = [RDMABuffer(s[:HEADER_BYTES]) for s in self.slots]
        source = WeightSource(
            self.host,
            self.paths,
            self._buffers,
            self._headers,
            self.pieces,
            self.data_bytes,
            [int(s) % 2**64 for s in sums] if verify else None,
        )
        return WeightHandle(version, [source])

    def corrupt(self, version: int) -> None:
        """Flip one byte of `version`'s slot (the `faults.weights` corrupt drill)."""
        self.slots[version % SLOTS][HEADER_BYTES + self.data_bytes // 2] ^= 0xFF

    def close(self) -> None:
        for path in self.paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


@dataclass
class Pulled:
    """What a replica reports after a pull."""

    version: int  # the version it now serves
    path: str  # 'shm' (every source on its host) or 'rdma'
    rdma_bytes: int  # bytes it read over RDMA (0 on the shared-memory path)
    relay: WeightHandle | None = None  # where others can pull this version from it
    verified: bool = False  # its parameters matched the trainer's checksums


class WeightReceiver:
    """Replica side. `pull(handle)` makes the local model equal to that version."""

    def __init__(
        self,
        model: torch.nn.Module,
        timeout_s: int = 120,
        prefix: str | None = None,
        shared_memory: bool = True,
    ):
        # With `prefix`, `model` is a part of the published one (a critic's backbone
        # is the policy's `model.` submodule): only the names under it are taken.
        # shared_memory=False pulls over RDMA even on the trainer's host (to measure it).
        self.shared_memory = shared_memory
        self.partial = prefix is not None
        self.params = {f"{prefix or ''}{n}": p for n, p in model.named_parameters()}
        self.owner = "replica"  # named in errors; actors set their role and rank
        self.version = -1
        self.torn = False
        """True while a pull is under way or after one failed: the model may be
        mixed, and must not be served."""
        self.path = ""
        """How the last pull went: 'shm' (same host) or 'rdma'."""
        self.timeout_s = timeout_s
        self.host = host_id()
        self._mapped: dict[str, torch.Tensor] = {}
        self._staging: dict[int, torch.Tensor] = {}
        self._relay: WeightPublisher | None = None  # made at the first `serve`
        self._summed, self._held = False, {}  # this pull's: checked, and the sums taken

    def _check_layout(self, handle: WeightHandle) -> None:
        published = {p.name for s in handle.sources for p in s.pieces}
        missing = set(self.params) - published
        if not self.partial:
            missing |= published - set(self.params)
        if missing:
            raise ValueError(f"published weights do not match this model: {sorted(missing)[:5]}")

    @torch.no_grad()
    def pull(
        self,
        handle: WeightHandle,
        serve: bool = False,
        shm_prefix: str | None = None,
        timeout_s: float | None = None,
        skip_copy: bool = False,
    ) -> Pulled:
        """Make the parameters equal to `handle`'s version, and check them against
        its checksums when it has them. `serve`: then publish it from this
        replica's own slots (files named `shm_prefix`-...) for others to pull
        (`Pulled.relay`). `timeout_s` bounds the RDMA reads (default: the
        receiver's), so a source that died fails the pull soon. `skip_copy`
        (the `faults.weights` skip_pull drill) moves no bytes, as a pull that
        silently did not apply."""
        self._check_layout(handle)
        self.version, self.torn = -1, True  # until every byte of the new version is in
        self._summed = all(s.checksums is not None for s in handle.sources)
        self._held = {}
        local = [
            s
            for s in handle.sources
            if self.shared_memory and s.host == self.host and os.path.exists(s.paths[0])
        ]
        remote = [s for s in handle.sources if s not in local]
        for source in [] if skip_copy else local:
            self._copy(source, self._shared(source, handle.slot), handle.version, torn_check=True)
        if remote and not skip_copy:
            # Monarch's RDMA timeouts are whole seconds.
            self._pull_rdma(remote, handle, max(1, math.ceil(timeout_s or self.timeout_s)))
        verified = self._verify(handle) if self._summed else False
        self.path = "rdma" if remote else "shm"
        self.version, self.torn = handle.version, False
        rdma_bytes = sum(HEADER_BYTES * 2 + s.data_bytes for s in remote)
        relay = self.serve(shm_prefix, verify=verified) if serve else None
        return Pulled(self.version, self.path, rdma_bytes, relay, verified)

    def _target(self, piece: ParamPiece) -> torch.Tensor | None:
        """The part of this receiver's parameter that `piece` fills (None: not held)."""
        param = self.params.get(piece.name)
        if param is None:  # partial receiver: not part of this model
            return None
        cast = param.dtype.is_floating_point and piece.dtype.is_floating_point
        if tuple(param.shape) != piece.full_shape or (param.dtype != piece.dtype and not cast):
            raise ValueError(
                f"parameter {piece.name}: local {tuple(param.shape)} {param.dtype}, "
                f"published {piece.full_shape} {piece.dtype}"
            )
        return param.data[piece.row : piece.row + piece.shape[0]] if piece.shape else param.data

    @torch.no_grad()
    def _verify(self, handle: WeightHandle) -> bool:
        """Check every piece this receiver holds against `handle`'s checksums (sums
        taken as the pieces were copied in, else read now). Raises
        `WeightMismatch` naming the pieces that differ."""
        wrong = []
        for source in handle.sources:
            for piece, expected in zip(source.pieces, source.checksums, strict=True):
                target = self._target(piece)
                if target is None:
                    continue
                held = self._held.get((piece.name, piece.row))
                held = checksum(target) if held is None else int(held) % 2**64
                if held != expected:
                    wrong.append(piece.name)
        if wrong:
            raise WeightMismatch(
                f"{self.owner}, version {handle.version}: {len(wrong)} parameter(s) differ from the "
                f"trainer's checksums after the pull ({', '.join(wrong[:3])}"
                f"{', ...' if len(wrong) > 3 else ''}); not served"
            )
        return True

    def serve(self, shm_prefix: str | None = None, verify: bool = True) -> WeightHandle:
        """Publish the version this replica holds from its own slots (a relay),
        with checksums of what it holds when `verify`."""
        if self.partial:
            raise ValueError("a receiver of part of the model cannot relay the whole")
        if self.torn:
            raise TornWeights("this replica holds no complete version to relay")
        if self._relay is None:
            self._relay = WeightPublisher(
                None, prefix=shm_prefix, parameters=lambda: iter(self.params.items())
            )
        return self._relay.publish(self.version, verify)

    def close(self) -> None:
        if self._relay is not None:
            self._relay.close()

    def _shared(self, source: WeightSource, slot: int) -> torch.Tensor:
        path = source.paths[slot]
        if path not in self._mapped:
            self._mapped[path] = _map_file(path, HEADER_BYTES + source.data_bytes)
        return self._mapped[path]

    def _copy(
        self, source: WeightSource, slot: torch.Tensor, version: int, torn_check: bool
    ) -> None:
        """Copy a source's pieces from `slot` (header + data) into the parameters."""
        header = slot[:8].view(torch.int64)
        if int(header.item()) != 2 * version + 2:
            raise TornWeights(f"version {version} is not complete in its slot")
        data = slot[HEADER_BYTES:]
        for piece in source.pieces:
            target = self._target(piece)
            if target is None:
                continue
            published = data[piece.offset : piece.offset + piece.num_bytes]
            if target.dtype == piece.dtype:
                summed = copy_summed(_as_bytes(target), published, self._summed)
            else:  # a replica in its own dtype: the bytes checked as they came, then cast
                summed = copy_summed(published, None, self._summed)
                target.copy_(published.view(piece.dtype).view(piece.shape))
            self._held[(piece.name, piece.row)] = summed
        if torn_check and int(header.item()) != 2 * version + 2:
            raise TornWeights(f"version {version} was overwritten while it was read")

    def _pull_rdma(self, sources: list[WeightSource], handle: WeightHandle, timeout_s: int) -> None:
        """Every remote source's slot in one RDMA action into staging, checked,
        then into the parameters."""
        from monarch.rdma import RDMAAction

        action = RDMAAction()
        device = next(iter(self.params.values())).device
        staged = []
        for i, source in enumerate(sources):
            size = HEADER_BYTES + source.data_bytes
            if i not in self._staging or self._staging[i].numel() != size:
                self._staging[i] = torch.empty(size, dtype=torch.uint8, device=device)
            action.read_remote(self._staging[i], source.buffers[handle.slot])
            staged.append((source, self._staging[i]))
        with without_cuda_probe_line():  # this process's first RDMA call, maybe
            action.submit(timeout=timeout_s).get()
        # The headers again, after the data: a version overwritten meanwhile shows.
        again = RDMAAction()
        headers = [torch.empty(HEADER_BYTES, dtype=torch.uint8, device=device) for _ in staged]
        for (source, _), header in zip(staged, headers, strict=True):
            again.read_remote(header, source.headers[handle.slot])
        again.submit(timeout=timeout_s).get()
        for (source, slot), header in zip(staged, headers, strict=True):
            if not torch.equal(header[:8], slot[:8]):
                raise TornWeights(f"version {handle.version} was overwritten while it was read")
            self._copy(source, slot, handle.version, torn_check=False)
