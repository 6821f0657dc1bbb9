"""The replica side of weight sync: `WeightReceiver.pull(handle)` makes a model
equal to a published version (`meshrl.weights.publisher` describes the slots, the
seqlock and the checksums it reads)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from meshrl.procs.reshard import Block, intersect, relative, span
from meshrl.weights.checksum import checksum, copy_sums
from meshrl.weights.precision import precision_of
from meshrl.weights.publisher import (
    HEADER_BYTES,
    ParamPiece,
    TornWeights,
    WeightHandle,
    WeightMismatch,
    WeightPublisher,
    WeightSource,
    _as_bytes,
    _is_dtensor,
    _local_piece,
    _map_file,
    host_id,
    without_cuda_probe_line,
)


@dataclass
class Pulled:
    """What a replica reports after a pull."""

    version: int  # the version it now serves
    path: str  # 'shm' (every source on its host) or 'rdma'
    rdma_bytes: int  # bytes it read over RDMA (0 on the shared-memory path)
    relay: WeightHandle | None = None  # where others can pull this version from it
    verified: bool = False  # its parameters matched the trainer's checksums
    bytes_moved: int = 0  # bytes copied or read into it (0: every piece served in place)
    precision: str = "fp32"  # of the bytes it took (`meshrl.weights.precision`)
    version_bytes: int = 0  # the bytes of the version in that precision (what travels)


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
        # The block of each parameter held here: all of it, or a tensor-parallel
        # replica's part (a DTensor's local block); only the pieces in it are read.
        self.held: dict[str, Block] = {}
        for name, param in self.params.items():
            local, start, _ = _local_piece(name, param)
            self.held[name] = span(start, tuple(local.shape))
        self.whole = all(
            block == tuple((0, n) for n in self.params[name].shape)
            for name, block in self.held.items()
        )
        self.precision = precision_of(model)
        """What it holds, and so which of a version's sources it reads (a bf16 one
        casts the trainer's fp32 where no bf16 was published)."""
        self.owner = "replica"  # named in errors; actors set their role and rank
        self.publishes_whole = True
        """Whether a relay of this receiver publishes the parameters it holds whole
        (false on a tensor-parallel replica's followers: the leader does)."""
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
        """Every parameter published, and every element this receiver holds of
        each in some piece: a handle short of a block (a proc that did not
        publish) would else pull "verified" with the block left as it was."""
        published = {p.name for s in handle.sources for p in s.pieces}
        missing = set(self.params) - published
        if not self.partial:
            missing |= published - set(self.params)
        if missing:
            raise ValueError(f"published weights do not match this model: {sorted(missing)[:5]}")
        covered = dict.fromkeys(self.held, 0)
        for source in handle.sources:  # (a version's pieces do not overlap)
            for piece in source.pieces:
                common = self._overlap(piece)
                if common is not None:
                    covered[piece.name] += math.prod(b - a for a, b in common)
        short = [
            name
            for name, block in self.held.items()
            if covered[name] < math.prod(b - a for a, b in block)
        ]
        if short:
            raise ValueError(
                f"{self.owner}: version {handle.version} holds only part of "
                f"{len(short)} parameter(s) ({', '.join(short[:3])}"
                f"{', ...' if len(short) > 3 else ''}); not pulled"
            )

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
        where it changed since the version of it this replica holds. Of a
        handle published in several precisions, the sources of this
        receiver's own are read (`WeightHandle.of_precision`)."""
        try:
            handle = handle.of_precision(self.precision)
        except ValueError as error:
            raise ValueError(f"{self.owner}: {error}") from None
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
        precision = handle.sources[0].precision if handle.sources else self.precision
        return Pulled(
            self.version,
            self.path,
            rdma_bytes,
            relay,
            verified,
            moved,
            precision,
            self._version_bytes(handle),
        )

    def _version_bytes(self, handle: WeightHandle) -> int:
        """The bytes of `handle`'s pieces this receiver holds a part of."""
        return sum(
            p.num_bytes for s in handle.sources for p in s.pieces if self._overlap(p) is not None
        )

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
        return self._target_now(piece)

    def _viewable(self, piece: ParamPiece) -> bool:
        """Whether `piece` can be served in place from a slot: the whole parameter,
        in this replica's dtype, on the CPU."""
        param = self.params.get(piece.name)
        return (
            self.zero_copy
            and param is not None
            and not _is_dtensor(param)
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
                key = (piece.name, piece.start)
                held = self._held.get(key)  # summed as it came in: a piece held here
                if held is None:
                    target = self._target_now(piece)
                    if target is None:
                        continue
                    held = checksum(target)
                held = self._held[key] = int(held) % 2**64
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
        """What this receiver serves of `piece` now (a view or its own memory): the
        part of the block it holds of the parameter that `piece` covers; None when
        it holds none of it."""
        param = self.params.get(piece.name)
        common = self._overlap(piece)
        if common is None:
            return None
        local = param.to_local() if _is_dtensor(param) else param.data
        return local[relative(common, self.held[piece.name])]

    def _overlap(self, piece: ParamPiece) -> Block | None:
        """The part of `piece` this receiver holds (`reshard.intersect`); None: none."""
        if piece.name not in self.params:
            return None
        return intersect(piece.block, self.held[piece.name])

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
            # A tensor-parallel replica's procs each publish the blocks they own; the
            # leader alone its whole parameters (`publishes_whole`). Their handles
            # merged are the relay's, read per piece by the procs that need them.
            self._relay = WeightPublisher(
                None,
                prefix=shm_prefix,
                parameters=lambda: iter(self.params.items()),
                owns_whole=self.publishes_whole,
                by_piece=not self.whole,
                precision=self.precision,
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
        # Copied (or, for views, read) and summed at once, over every thread.
        pairs: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        keys: list[tuple[str, tuple[int, ...]]] = []
        for i, piece in enumerate(source.pieces):
            key = (piece.name, piece.start)
            published = data[piece.offset : piece.offset + piece.num_bytes]
            if view_of is not None and self._viewable(piece):
                param = self.params[piece.name]
                param.data = published.view(piece.dtype).view(piece.shape)
                self._views[piece.name] = view_of
                if self._summed:
                    pairs.append((published, None))
                    keys.append(key)
                continue
            if unchanged(i) and piece.name not in self._views:
                if key in self._sums:
                    self._held[key] = self._sums[key]  # as verified at the version held
                continue
            target = self._target(piece)
            if target is None:
                continue
            common = self._overlap(piece)
            if common == piece.block and target.dtype == piece.dtype and target.is_contiguous():
                pairs.append((_as_bytes(target), published))
                keys.append(key)
            else:  # its own dtype, a block of columns, a part: the bytes checked as they came
                if self._summed:
                    pairs.append((published, None))
                    keys.append(key)
                whole = published.view(piece.dtype).view(piece.shape)
                target.copy_(whole[relative(common, piece.block)])
            moved += piece.num_bytes
        for key, summed in zip(keys, copy_sums(pairs, self._summed), strict=True):
            self._held[key] = summed
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
            changed = self._unchanged(source, lineage)

            def unchanged(j: int, source=source, changed=changed) -> bool:
                """Not to be read: unchanged since the version held, or not held here."""
                return changed(j) or self._overlap(source.pieces[j]) is None

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
