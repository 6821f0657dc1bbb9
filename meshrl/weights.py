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
    slot: int = 0  # the slot this version is in
    sequence: int = 0  # this publisher's publish count (versions can go back on a rewind)
    changed: list[int] | None = None
    """Delta sync: per piece, the publish (`sequence`) in which its bytes last
    changed, so a replica that holds publish r of this source needs the pieces
    changed after r only; None: pull every piece."""
    piece_buffers: list | None = None  # delta over RDMA: per slot, one RDMABuffer per piece

    @property
    def lineage(self) -> str:
        """Names the publisher: versions of one lineage can be pulled as deltas."""
        return self.paths[0]


@dataclass
class WeightHandle:
    """A published version: where each owning proc's bytes are."""

    version: int
    sources: list[WeightSource]

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
        last (in the other slot); the handle says in which version each piece last
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
        for i, (piece, (_, param)) in enumerate(zip(self.pieces, self.parameters(), strict=True)):
            local, _ = _local_piece(piece.name, param)
            source = _as_bytes(local)
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
            summed = copy_summed(data[span], source, verify)
            self.sums[i] = int(summed) % 2**64 if verify else None
        self.header(slot).fill_(2 * version + 2)  # complete
        self.held[slot], self.held_sequence[slot] = version, self.sequence
        self.next_slot = 1 - slot
        self._register(delta)
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
            self._piece_buffers if delta else None,
        )
        return WeightHandle(version, [source])

    def _register(self, pieces: bool) -> None:
        """The slots as RDMA buffers, once; with `pieces`, each piece of each too."""
        if not self.rdma or (self._buffers is not None and (self._piece_buffers or not pieces)):
            return
        from monarch.rdma import RDMABuffer, RDMATcpFallbackWarning

        with warnings.catch_warnings(), without_cuda_probe_line():
            # Reported once through rdma_backend() in the run metrics instead.
            warnings.simplefilter("ignore", RDMATcpFallbackWarning)
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
    bytes_moved: int = 0  # bytes copied or read into it (0: every piece served in place)


class WeightReceiver:
    """Replica side. `pull(handle)` makes the local model equal to that version.

    With `zero_copy`, parameters whose piece lies whole in a shared-memory slot on
    this host (a replicated trainer's, in the replica's dtype, on the CPU) are
    not copied: they become views of the published slot, so a same-host sync is
    the trainer's one copy into the slot. Only a receiver that pulls every
    version before it serves again may do so (policy replicas): the trainer
    writes that slot again two publishes later. `intact()` says whether the
    slots it serves from still hold its version (the seqlock header), and a
    replica checks it before and after it serves."""

    def __init__(
        self,
        model: torch.nn.Module,
        timeout_s: int = 120,
        prefix: str | None = None,
        shared_memory: bool = True,
        zero_copy: bool = False,
    ):
        # With `prefix`, `model` is a part of the published one (a critic's backbone
        # is the policy's `model.` submodule): only the names under it are taken.
        # shared_memory=False pulls over RDMA even on the trainer's host (to measure it).
        self.shared_memory = shared_memory
        self.zero_copy = zero_copy
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
        self._sums: dict[tuple[str, int], int] = {}  # of the pieces held, last verified
        self._lineage: dict[str, int] = {}  # source lineage -> its publish held (delta)
        self._views: dict[str, str] = {}  # parameter -> the slot file it is a view of

    def _check_layout(self, handle: WeightHandle) -> None:
        published = {p.name for s in handle.sources for p in s.pieces}
        missing = set(self.params) - published
        if not self.partial:
            missing |= published - set(self.params)
        if missing:
            raise ValueError(f"published weights do not match this model: {sorted(missing)[:5]}")

    def intact(self) -> bool:
        """Whether every slot this replica serves parameters from still holds its
        version, complete (always true for parameters of its own)."""
        expected = 2 * self.version + 2
        return all(
            int(self._mapped[path][:8].view(torch.int64).item()) == expected
            for path in set(self._views.values())
        )

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
        silently did not apply. A source published with `delta` is read only
        where it changed since the version of it this replica holds."""
        self._check_layout(handle)
        lineage, self._lineage = self._lineage, {}  # a failed pull leaves no delta base
        self.version, self.torn = -1, True  # until every byte of the new version is in
        self._summed = all(s.checksums is not None for s in handle.sources)
        self._held = {}
        local = [
            s
            for s in handle.sources
            if self.shared_memory and s.host == self.host and os.path.exists(s.paths[0])
        ]
        remote = [s for s in handle.sources if s not in local]
        moved = rdma_bytes = 0
        for source in [] if skip_copy else local:
            slot = self._shared(source, source.slot)
            moved += self._copy(
                source, slot, handle.version, True, lineage, source.paths[source.slot]
            )
        if remote and not skip_copy:
            # Monarch's RDMA timeouts are whole seconds.
            timeout = max(1, math.ceil(timeout_s or self.timeout_s))
            rdma_bytes = self._pull_rdma(remote, handle, timeout, lineage)
            moved += rdma_bytes
        verified = self._verify(handle) if self._summed else False
        self.path = "rdma" if remote else "shm"
        self.version, self.torn = handle.version, False
        self._lineage = {s.lineage: s.sequence for s in handle.sources}
        # Slots of sources gone (a trainer replaced) are unmapped once nothing views them.
        keep = {path for s in handle.sources for path in s.paths} | set(self._views.values())
        self._mapped = {path: t for path, t in self._mapped.items() if path in keep}
        delta = any(s.changed is not None for s in handle.sources)
        relay = self.serve(shm_prefix, verify=verified, delta=delta) if serve else None
        return Pulled(self.version, self.path, rdma_bytes, relay, verified, moved)

    def _target(self, piece: ParamPiece) -> torch.Tensor | None:
        """The part of this receiver's parameter that `piece` fills (None: not held).
        A parameter that was a view of a slot gets memory of its own first."""
        param = self.params.get(piece.name)
        if param is None:  # partial receiver: not part of this model
            return None
        cast = param.dtype.is_floating_point and piece.dtype.is_floating_point
        if tuple(param.shape) != piece.full_shape or (param.dtype != piece.dtype and not cast):
            raise ValueError(
                f"parameter {piece.name}: local {tuple(param.shape)} {param.dtype}, "
                f"published {piece.full_shape} {piece.dtype}"
            )
        if self._views.pop(piece.name, None) is not None:
            param.data = torch.empty_like(param.data)
        return param.data[piece.row : piece.row + piece.shape[0]] if piece.shape else param.data

    def _viewable(self, piece: ParamPiece) -> bool:
        """Whether `piece` can be served in place from a slot: the whole parameter,
        in this replica's dtype, on the CPU."""
        param = self.params.get(piece.name)
        return (
            self.zero_copy
            and param is not None
            and piece.row == 0
            and piece.shape == piece.full_shape == tuple(param.shape)
            and param.dtype == piece.dtype
            and param.device.type == "cpu"
        )

    @torch.no_grad()
    def _verify(self, handle: WeightHandle) -> bool:
        """Check every piece this receiver holds against `handle`'s checksums (sums
        taken as the pieces were copied in, else read now). Raises
        `WeightMismatch` naming the pieces that differ."""
        wrong = []
        for source in handle.sources:
            for piece, expected in zip(source.pieces, source.checksums, strict=True):
                target = self._target_now(piece)
                if target is None:
                    continue
                key = (piece.name, piece.row)
                held = self._held.get(key)
                held = checksum(target) if held is None else int(held) % 2**64
                self._held[key] = held
                if held != expected:
                    wrong.append(piece.name)
        if wrong:
            self._sums = {}
            raise WeightMismatch(
                f"{self.owner}, version {handle.version}: {len(wrong)} parameter(s) differ from the "
                f"trainer's checksums after the pull ({', '.join(wrong[:3])}"
                f"{', ...' if len(wrong) > 3 else ''}); not served"
            )
        self._sums = dict(self._held)
        return True

    def _target_now(self, piece: ParamPiece) -> torch.Tensor | None:
        """What this receiver serves of `piece` now (a view or its own memory)."""
        param = self.params.get(piece.name)
        if param is None:
            return None
        return param.data[piece.row : piece.row + piece.shape[0]] if piece.shape else param.data

    def serve(
        self, shm_prefix: str | None = None, verify: bool = True, delta: bool = False
    ) -> WeightHandle:
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
        return self._relay.publish(self.version, verify, delta)

    def close(self) -> None:
        if self._relay is not None:
            self._relay.close()

    def _shared(self, source: WeightSource, slot: int) -> torch.Tensor:
        path = source.paths[slot]
        if path not in self._mapped:
            self._mapped[path] = _map_file(path, HEADER_BYTES + source.data_bytes)
        return self._mapped[path]

    def _unchanged(self, source: WeightSource, lineage: dict[str, int]) -> Callable[[int], bool]:
        """Which of `source`'s pieces this replica holds as published: those that
        last changed at or before the publish of it it holds."""
        held = lineage.get(source.lineage)
        if source.changed is None or held is None:
            return lambda i: False
        return lambda i: source.changed[i] <= held

    def _copy(
        self,
        source: WeightSource,
        slot: torch.Tensor,
        version: int,
        torn_check: bool,
        lineage: dict[str, int],
        view_of: str | None = None,
    ) -> int:
        """Take a source's pieces from `slot` (header + data): as views of it when
        `view_of` names its shared-memory file and the piece allows (`zero_copy`),
        else copied into the parameters; pieces unchanged since the version held
        (delta) are left as they are. Returns the bytes copied."""
        header = slot[:8].view(torch.int64)
        if int(header.item()) != 2 * version + 2:
            raise TornWeights(f"version {version} is not complete in its slot")
        data = slot[HEADER_BYTES:]
        unchanged = self._unchanged(source, lineage)
        moved = 0
        for i, piece in enumerate(source.pieces):
            key = (piece.name, piece.row)
            published = data[piece.offset : piece.offset + piece.num_bytes]
            if view_of is not None and self._viewable(piece):
                param = self.params[piece.name]
                param.data = published.view(piece.dtype).view(piece.shape)
                self._views[piece.name] = view_of
                self._held[key] = copy_summed(published, None, self._summed)
                continue
            if unchanged(i) and piece.name not in self._views:
                if key in self._sums:
                    self._held[key] = self._sums[key]  # as verified at the version held
                continue
            target = self._target(piece)
            if target is None:
                continue
            if target.dtype == piece.dtype:
                summed = copy_summed(_as_bytes(target), published, self._summed)
            else:  # a replica in its own dtype: the bytes checked as they came, then cast
                summed = copy_summed(published, None, self._summed)
                target.copy_(published.view(piece.dtype).view(piece.shape))
            self._held[key] = summed
            moved += piece.num_bytes
        if torn_check and int(header.item()) != 2 * version + 2:
            raise TornWeights(f"version {version} was overwritten while it was read")
        return moved

    def _pull_rdma(
        self,
        sources: list[WeightSource],
        handle: WeightHandle,
        timeout_s: int,
        lineage: dict[str, int],
    ) -> int:
        """Every remote source's slot (its changed pieces only, for a delta) in one
        RDMA action into staging, checked, then into the parameters. Returns the
        bytes read."""
        from monarch.rdma import RDMAAction

        action = RDMAAction()
        device = next(iter(self.params.values())).device
        staged, read = [], 0
        for i, source in enumerate(sources):
            size = HEADER_BYTES + source.data_bytes
            if i not in self._staging or self._staging[i].numel() != size:
                self._staging[i] = torch.empty(size, dtype=torch.uint8, device=device)
            staging = self._staging[i]
            unchanged = self._unchanged(source, lineage)
            partial = source.piece_buffers is not None and not self._views
            if not partial or not any(unchanged(j) for j in range(len(source.pieces))):
                action.read_remote(staging, source.buffers[source.slot])
                read += size
            else:  # the header, then each changed piece
                action.read_remote(staging[:HEADER_BYTES], source.headers[source.slot])
                read += HEADER_BYTES
                for j, piece in enumerate(source.pieces):
                    buffer = source.piece_buffers[source.slot][j]
                    if unchanged(j) or buffer is None:
                        continue
                    start = HEADER_BYTES + piece.offset
                    action.read_remote(staging[start : start + piece.num_bytes], buffer)
                    read += piece.num_bytes
            staged.append((source, staging))
        with without_cuda_probe_line():  # this process's first RDMA call, maybe
            action.submit(timeout=timeout_s).get()
        # The headers again, after the data: a version overwritten meanwhile shows.
        again = RDMAAction()
        headers = [torch.empty(HEADER_BYTES, dtype=torch.uint8, device=device) for _ in staged]
        for (source, _), header in zip(staged, headers, strict=True):
            again.read_remote(header, source.headers[source.slot])
        again.submit(timeout=timeout_s).get()
        read += HEADER_BYTES * len(staged)
        for (source, slot), header in zip(staged, headers, strict=True):
            if not torch.equal(header[:8], slot[:8]):
                raise TornWeights(f"version {handle.version} was overwritten while it was read")
            self._copy(source, slot, handle.version, False, lineage)
        return read
