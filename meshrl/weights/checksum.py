"""Checksums of weights: what a published version carries and what a replica
checks its parameters against after a pull (`meshrl.weights.publisher`).

The copy and the sum run as one pass in `meshrl.weights.native` where it is
built; torch's chunked copy-then-sum (`_torch_copy_summed`) otherwise, and for
tensors off the CPU. Both give the same sums."""

from __future__ import annotations

import torch

from meshrl.weights import native

_WORD = 8
_CHUNK = 4 << 20  # bytes summed right after they are copied, while still in cache


def _word_sum(data: torch.Tensor) -> torch.Tensor:
    """Sum of uint8 `data` as little-endian int64 words (the last zero-padded),
    wrapping, as a 0-d tensor (no device sync)."""
    whole = data.numel() // _WORD * _WORD
    words = data[:whole]
    if words.storage_offset() % _WORD:  # a view of int64 needs aligned bytes
        words = words.clone()
    total = words.view(torch.int64).sum()
    if whole < data.numel():
        tail = torch.zeros(_WORD, dtype=torch.uint8, device=data.device)
        tail[: data.numel() - whole] = data[whole:]
        total = total + tail.view(torch.int64)[0]
    return total


def _torch_copy_summed(dst: torch.Tensor, src: torch.Tensor | None, summed: bool):
    if not summed:
        if src is not None:
            dst.copy_(src)
        return None
    if src is None:  # a read only: one pass, nothing to reuse from cache
        return _word_sum(dst)
    total = torch.zeros((), dtype=torch.int64, device=dst.device)
    for start in range(0, max(dst.numel(), 1), _CHUNK):
        chunk = dst[start : start + _CHUNK]
        chunk.copy_(src[start : start + _CHUNK])
        total += _word_sum(chunk)
    return total


def _in_kernel(tensor: torch.Tensor | None) -> bool:
    """Whether the compiled kernel can take it: contiguous bytes on the CPU."""
    return tensor is None or (tensor.device.type == "cpu" and tensor.is_contiguous())


def copy_sums(
    pairs: list[tuple[torch.Tensor, torch.Tensor | None]], summed: bool = True
) -> list[int | torch.Tensor | None]:
    """Copy each pair's uint8 `src` into `dst` (src None: no copy) and, with
    `summed`, return the checksum of each `dst` (`checksum`; an int, or a 0-d
    int64 tensor to take mod 2**64 where torch summed it, so a GPU's sum is read
    once at the end), else None for each. The CPU pairs go through the
    compiled kernel at once, split over this proc's threads."""
    fast = [k for k, (d, s) in enumerate(pairs) if _in_kernel(d) and _in_kernel(s)]
    # A read only is (bytes, None) here and (None, bytes) to the kernel.
    sums = native.copy_sums(
        [(None, d) if s is None else (d, s) for d, s in (pairs[k] for k in fast)]
    )
    done = dict(zip(fast, sums, strict=True)) if sums is not None else {}
    return [
        (done[k] if summed else None) if k in done else _torch_copy_summed(dst, src, summed)
        for k, (dst, src) in enumerate(pairs)
    ]


def copy_summed(dst: torch.Tensor, src: torch.Tensor | None, summed: bool):
    """`copy_sums` of one pair."""
    return copy_sums([(dst, src)], summed)[0]


def checksum(tensor: torch.Tensor) -> int:
    """The sum, mod 2**64, of `tensor`'s bytes read as little-endian 8-byte words
    (the last one zero-padded). It catches changed, missing and stale bytes and
    swapped parameters; not a reordering of words within one tensor, which no
    byte-range copy makes."""
    data = tensor.detach().reshape(-1).view(torch.uint8)
    return int(copy_summed(data, None, True)) % 2**64
