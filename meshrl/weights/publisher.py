"""Versioned weight publishing: shared memory on one host, Monarch RDMA buffers
across hosts (the replica side is `meshrl.weights.receiver`).

Each trainer proc that owns weights (rank 0 of a replicated trainer, every rank
of an FSDP2-sharded one) lays its parameters (its shards, when sharded) out
once in a few byte slots: files in /dev/shm, mapped by the trainer and
registered once as `RDMABuffer`s. There are two slots (double buffering): each
publish writes the one the last publish did not, so replicas may still read,
or serve, version v - 1 while the trainer writes v.

Every slot starts with a header that makes versions safe to read (a seqlock):
the trainer sets it to 2v + 1 before writing version v and to 2v + 2 after. A
reader checks the header before and after copying; a version overwritten
while it was read is detected and never served (`TornWeights`).

A replica pulls every source (one per owning trainer proc) of a
`WeightHandle`: on the same host it serves the slot in place (its parameters
become views of it) or copies out of it (one memcpy), else it reads with one
`RDMAAction` of all reads, over ibverbs where the host has it and Monarch's
TCP fallback otherwise. A sharded trainer's replicas take each shard straight
from the proc that owns it; nothing is gathered on one proc first.

Each version carries a checksum per piece (one parameter, or its shard), taken
by the trainer over the bytes it writes into the slot, as it writes them
(`meshrl.weights.checksum`). A replica checks what it then serves against them
(`WeightMismatch` names what differs): a corrupted or missing slot, a pull
that did not land, a version other than the one asked for all fail the pull
instead of being served. With `delta`, the handle also says in which publish
each piece last changed, so a replica reads only what changed since the
publish it holds.

A replica can relay: `pull(handle, serve=True)` also publishes the version it
now holds from slots of its own (the same layout, seqlock and double
buffering as the trainer's), and returns that handle, so other replicas pull
it from there instead of from the trainer (`meshrl.loop.weight_sync` arranges the
tree). Its header says "writing" from before the copy until the last byte is
in, so a child never takes a torn relay copy either.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import math
import os
import socket
import stat
import sys
import tempfile
import uuid
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from meshrl.procs.mesh import HOST_TAG_ENV, debugging
from meshrl.procs.reshard import Block, reads, relative, span
from meshrl.weights.checksum import copy_sums

HEADER_BYTES = 64
SLOTS = 2
SHM_DIR = "/dev/shm"
FLUSH_BYTES = 256 << 20
"""A publish copies and sums its pieces in one batch, over every thread
(`meshrl.weights.checksum.copy_sums`), or in several where the batch would hold
more than this many bytes of pieces it had to make first (the rows of a
tensor-parallel column block, a GPU parameter's host copy)."""


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
    """Where (a block of) one parameter lives in a source's slots: the whole
    parameter, an FSDP2 shard of dim 0, a tensor-parallel shard of dim 0 or 1,
    or both (FSDP2 over tensor parallelism), laid out row-major."""

    name: str
    offset: int  # bytes into the slot's data
    shape: tuple[int, ...]  # of this piece
    dtype: torch.dtype
    start: tuple[int, ...]  # per dim, where this piece starts in the full parameter
    full_shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def block(self) -> tuple[tuple[int, int], ...]:
        """[start, stop) per dim (`meshrl.procs.reshard.Block`)."""
        return span(self.start, self.shape)


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
    slot: int = 0  # the slot this version is in
    sequence: int = 0  # this publisher's publish count (versions can go back on a rewind)
    changed: list[int] | None = None
    """Delta sync: per piece, the publish (`sequence`) in which its bytes last
    changed, so a replica that holds publish r of this source needs the pieces
    changed after r only; None: pull every piece."""
    piece_buffers: list | None = None  # delta over RDMA: per slot, one RDMABuffer per piece
    precision: str = "fp32"
    """What its bytes are (`meshrl.weights.precision`): a trainer publishes each
    version once per precision its replicas hold, and each replica reads the
    sources of its own (`WeightHandle.of_precision`)."""

    @property
    def lineage(self) -> str:
        """Names the publisher: versions of one lineage can be pulled as deltas."""
        return self.paths[0]


@dataclass
class WeightHandle:
    """A published version: where each owning proc's bytes are."""

    version: int
    sources: list[WeightSource]

    @property
    def precisions(self) -> list[str]:
        """The precisions this version was published in."""
        return list(dict.fromkeys(s.precision for s in self.sources))

    @property
    def num_bytes(self) -> int:
        """The bytes of this version's pieces, over its sources (one precision's
        handle: what a replica that holds all of it takes)."""
        return sum(p.num_bytes for s in self.sources for p in s.pieces)

    def of_precision(self, precision: str) -> WeightHandle:
        """This version's sources of `precision`; else its fp32 ones, where a
        replica casts what it reads (bf16); else one clear error."""
        for wanted in (precision, "fp32"):
            sources = [s for s in self.sources if s.precision == wanted]
            if sources and (wanted == precision or precision == "bf16"):
                return WeightHandle(self.version, sources)
        raise ValueError(
            f"version {self.version} was published in {', '.join(self.precisions)}, not "
            f"{precision}: the trainer publishes each precision its replicas hold "
            "(Trainer(precisions=...), from policy.precision)"
        )

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


_dtensor: type | None = None  # torch's DTensor, imported at first use (a slow import)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    global _dtensor
    if _dtensor is None:
        from torch.distributed.tensor import DTensor

        _dtensor = DTensor
    return isinstance(tensor, _dtensor)


def _local_piece(name: str, param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], bool]:
    """This proc's part of `param`, where it starts in the full parameter (per
    dim), and whether this proc publishes it: the whole tensor (published by
    the owner of whole tensors), or a DTensor's local block (FSDP2, tensor
    parallelism, both), published by the proc whose coordinate is 0 on every
    mesh dim that replicates it (`meshrl.procs.reshard.owns`)."""
    if not _is_dtensor(param):
        return param.detach(), (0,) * param.dim(), True
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = param.to_local().detach()
    mesh = param.device_mesh
    shape, start = compute_local_shape_and_global_offset(param.shape, mesh, param.placements)
    assert tuple(local.shape) == tuple(shape), (name, local.shape, shape)
    # Coordinate 0 on the dims of its mesh that replicate it, and on the dims of the
    # whole trainer mesh that its mesh leaves out (FSDP2's dp mesh beside tp).
    coordinate = mesh.get_coordinate() or []
    owned = all(
        c == 0
        for c, placement in zip(coordinate, param.placements, strict=True)
        if isinstance(placement, Replicate)
    )
    root = mesh._get_root_mesh()
    names = mesh.mesh_dim_names or ()
    if root is not mesh and root.mesh_dim_names:
        for dim, other in enumerate(root.mesh_dim_names):
            # (A pipeline's "pp" dim: each stage's procs hold parameters of their own.)
            if other not in names and other != "pp":
                owned = owned and root.get_coordinate()[dim] == 0
    return local, tuple(start), owned


def _map_fd(fd: int, size: int) -> torch.Tensor:
    """The file open at `fd` as a uint8 tensor (mapped, shared). Mapped through
    `/proc/self/fd`, which names the file already open, not a path to resolve again."""
    return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=size, dtype=torch.uint8)


def _create_slot(path: str, size: int) -> torch.Tensor:
    """A new shared-memory file at `path`, this user's only (0600), mapped. Made
    with O_EXCL | O_NOFOLLOW: a file or link already at that name (another user's,
    in the world-writable /dev/shm) is an error, never opened, truncated or
    followed."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise FileExistsError(
            errno.EEXIST, f"weight slot {path} already exists (not made by this publisher): refused"
        ) from None
    try:
        os.fchmod(fd, 0o600)  # exactly, whatever the umask
        os.ftruncate(fd, size)
        return _map_fd(fd, size)
    finally:
        os.close(fd)


def _map_file(path: str, size: int) -> torch.Tensor:
    """The shared-memory file at `path` (a publisher's slot) as a uint8 tensor
    (mapped, shared). Opened without following a link, and only if it is a
    regular file of this user's that no one else may read or write (as
    `_create_slot` makes them) and holds `size` bytes: a PermissionError otherwise."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
            raise PermissionError(
                errno.EACCES,
                f"weight slot {path} is not a private file of this user's "
                f"(owner uid {info.st_uid}, mode {stat.filemode(info.st_mode)}): refused",
            )
        if info.st_size < size:
            raise PermissionError(
                errno.EACCES, f"weight slot {path} holds {info.st_size} bytes, not {size}: refused"
            )
        return _map_fd(fd, size)
    finally:
        os.close(fd)


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


@contextlib.contextmanager
def registering():
    """Register RDMA buffers in this block: Monarch's TCP-fallback warning is left
    out (reported once through `rdma_backend()` in the run metrics instead), and
    the CUDA probe's line (`without_cuda_probe_line`)."""
    from monarch.rdma import RDMATcpFallbackWarning

    with warnings.catch_warnings(), without_cuda_probe_line():
        warnings.simplefilter("ignore", RDMATcpFallbackWarning)
        yield


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
        owns_whole: bool = True,
        split: Callable[[str, tuple[int, ...]], list[Block]] | None = None,
        by_piece: bool = False,
        precision: str = "fp32",
        placed: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] | None = None,
    ):
        """`parameters` gives the (name, tensor) pairs to publish, called at each
        publish (default: the model's parameters; LoRA: the merged weights).
        `owns_whole`: this proc publishes the parameters it holds whole (plain
        tensors); a DTensor's block is published by its owner (`_local_piece`).
        `split(name, shape)`: the blocks the replicas' procs hold (tensor-parallel
        replicas, `meshrl.procs.reshard.block`); each owned block is laid out as its
        parts within them, each part contiguous, so a replica proc reads exactly
        the parts it holds. None: one piece per owned block.
        `by_piece` (implied by `split`): each piece is its own RDMA buffer too, so a
        replica proc that holds some of them reads only those (a tensor-parallel
        relay's blocks). `precision`: what `parameters` gives (its handles say so;
        `meshrl.weights.precision.source` converts a trainer's).
        `placed`: plain tensors that are this proc's block of a larger parameter
        (expert parallelism's experts, `meshrl.procs.expert_parallel.expert_blocks`):
        name -> (where the block starts, the whole parameter's shape); this proc
        publishes its block of each."""
        from torch.distributed.tensor import DTensor

        source = parameters or model.named_parameters
        self.pieces, offset, published = [], 0, set()
        self._cuts: list[tuple[slice, ...]] = []  # each piece's part of its local block
        placed = placed or {}
        for name, param in source():
            local, start, owned = _local_piece(name, param)
            whole = tuple(param.shape)
            if name in placed:  # a block of a parameter split over the procs by hand
                start, whole = placed[name]
            elif not (owned if isinstance(param, DTensor) else owns_whole):
                continue
            mine = span(start, tuple(local.shape))
            theirs = split(name, whole) if split else [mine]
            # Each part once (replicas that all hold the whole parameter share it).
            parts = list(dict.fromkeys(part for _, part in reads(mine, dict(enumerate(theirs)))))
            for part in parts or [mine]:  # (an empty shard: one empty piece)
                shape = tuple(b - a for a, b in part)
                start = tuple(a for a, _ in part)
                piece = ParamPiece(name, offset, shape, local.dtype, start, whole)
                self.pieces.append(piece)
                self._cuts.append(relative(part, mine))
                offset += -(-piece.num_bytes // 64) * 64  # aligned: whole words to sum
            published.add(name)
        self.precision = precision
        self.by_piece = by_piece or split is not None
        self.data_bytes = offset
        self.parameters = lambda: ((n, p) for n, p in source() if n in published)
        prefix = prefix or f"meshrl-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._made: list[str] = []  # the slots this publisher created (and removes)
        self.paths = [f"{SHM_DIR}/{prefix}-{uuid.uuid4().hex[:6]}-slot{i}" for i in range(SLOTS)]
        self.slots = []
        atexit.register(self.close)
        for path in self.paths:
            self.slots.append(_create_slot(path, HEADER_BYTES + self.data_bytes))
            self._made.append(path)
        # Registered lazily (needs a Monarch actor context); rdma=False: same host only.
        self.rdma = rdma
        self._buffers: list | None = None if rdma else []
        self._headers: list = []
        self._piece_buffers: list | None = None  # per slot, per piece (delta over RDMA)
        self.host = host_id()
        # Each publish writes the slot the last one did not: a replica may read or
        # serve the newest version while the next is written (double buffering).
        self.next_slot = 0
        self.held: list[int | None] = [None] * SLOTS  # the complete version in each slot
        self.sequence = 0  # publishes so far
        self.held_sequence: list[int | None] = [None] * SLOTS  # the publish in each slot
        self.changed_at: list[int | None] = [None] * len(self.pieces)  # delta: see publish
        self.sums: list[int | None] = [None] * len(self.pieces)  # of each piece's newest bytes

    def header(self, slot: int) -> torch.Tensor:
        return self.slots[slot][:8].view(torch.int64)

    @torch.no_grad()
    def publish(self, version: int, verify: bool = True, delta: bool = False) -> WeightHandle:
        """Write `version` into the slot the last publish did not write, and return
        its handle. `verify`: the handle carries each piece's checksum, taken over
        the slot's bytes chunk by chunk as they are written.

        `delta`: each piece is compared, byte for byte, with the version published
        last (in the other slot); the handle says in which publish each piece last
        changed, and only pieces changed since the version this slot held are
        written. A replica that holds an earlier version of this publisher then
        reads only what changed since (`WeightReceiver.pull`). Changes are
        counted in publishes (`sequence`), not versions, which go back when the
        trainer rewinds to a checkpoint."""
        slot = self.next_slot
        self.sequence += 1
        data = self.slots[slot][HEADER_BYTES:]
        last = self.slots[1 - slot][HEADER_BYTES:]
        last_sequence, in_slot = self.held_sequence[1 - slot], self.held_sequence[slot]
        self.held[slot] = self.held_sequence[slot] = None
        self.header(slot).fill_(2 * version + 1)  # writing
        blocks: dict[str, torch.Tensor] = {}
        params = self.parameters()
        batch: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (piece, slot bytes, source)
        pending = 0  # bytes in the batch

        def flush() -> None:
            # Copied and summed together: one pass over the bytes, on every thread.
            sums = copy_sums([(dst, src) for _, dst, src in batch], verify)
            for (k, _, _), summed in zip(batch, sums, strict=True):
                self.sums[k] = int(summed) % 2**64 if verify else None
            batch.clear()

        for i, (piece, cut) in enumerate(zip(self.pieces, self._cuts, strict=True)):
            while piece.name not in blocks:
                name, param = next(params)
                blocks = {name: _local_piece(name, param)[0]}
            part = blocks[piece.name][cut]
            made = not part.is_contiguous() or part.device != last.device
            if not part.is_contiguous():  # a block of columns: its rows gathered once
                part = part.contiguous()
            source = _as_bytes(part)
            if source.device != last.device:
                # A GPU trainer's piece: copied to the host once, then compared with
                # the slot (torch.equal needs both on one device) and written from there.
                source = source.to(last.device)
            span = slice(piece.offset, piece.offset + piece.num_bytes)
            if not delta:
                self.changed_at[i] = None
            elif (
                last_sequence is None
                or self.changed_at[i] is None
                or not torch.equal(source, last[span])
            ):
                self.changed_at[i] = self.sequence
            current = (
                delta
                and in_slot is not None
                and self.changed_at[i] <= in_slot
                and (not verify or self.sums[i] is not None)
            )
            if current:  # this slot's bytes of it are this version's already
                continue
            batch.append((i, data[span], source))
            pending += source.numel() if made else 0
            if pending >= FLUSH_BYTES:
                flush()
                pending = 0
        flush()
        for _ in params:  # the rest converted too: a sharded fp8 source reduces over every rank
            pass
        self.header(slot).fill_(2 * version + 2)  # complete
        self.held[slot], self.held_sequence[slot] = version, self.sequence
        self.next_slot = 1 - slot
        self._register(delta or self.by_piece)
        source = WeightSource(
            self.host,
            self.paths,
            self._buffers,
            self._headers,
            self.pieces,
            self.data_bytes,
            list(self.sums) if verify else None,
            slot,
            self.sequence,
            list(self.changed_at) if delta else None,
            self._piece_buffers if delta or self.by_piece else None,
            self.precision,
        )
        return WeightHandle(version, [source])

    def _register(self, pieces: bool) -> None:
        """The slots as RDMA buffers, once; with `pieces`, each piece of each too."""
        if not self.rdma or (self._buffers is not None and (self._piece_buffers or not pieces)):
            return
        from monarch.rdma import RDMABuffer

        with registering():
            if self._buffers is None:
                self._buffers = [RDMABuffer(s) for s in self.slots]
                self._headers = [RDMABuffer(s[:HEADER_BYTES]) for s in self.slots]
            if pieces:
                self._piece_buffers = [
                    [
                        RDMABuffer(
                            s[HEADER_BYTES + p.offset : HEADER_BYTES + p.offset + p.num_bytes]
                        )
                        if p.num_bytes
                        else None
                        for p in self.pieces
                    ]
                    for s in self.slots
                ]

    def corrupt(self, version: int) -> None:
        """Flip one byte of `version`'s slot (the `faults.weights` corrupt drill)."""
        slot = self.held.index(version)
        self.slots[slot][HEADER_BYTES + self.data_bytes // 2] ^= 0xFF

    @torch.no_grad()
    def overwrite(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Write `tensors` over their pieces in `version`'s slot, its checksums
        left as they were (the `unmerged` drill). Returns the pieces written."""
        data = self.slots[self.held.index(version)][HEADER_BYTES:]
        pieces = {p.name: p for p in self.pieces}
        written = 0
        for name, tensor in tensors:
            piece = pieces[name]
            data[piece.offset : piece.offset + piece.num_bytes].copy_(_as_bytes(tensor))
            written += 1
        return written

    def close(self) -> None:
        for path in self._made:  # never a file at one of its names that it did not make
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
