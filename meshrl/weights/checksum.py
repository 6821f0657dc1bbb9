"""Checksums of weights: what a published version carries and what a replica
checks its parameters against after a pull (`meshrl.weights.publisher`)."""

from __future__ import annotations

import torch

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


def copy_summed(dst: torch.Tensor, src: torch.Tensor | None, summed: bool) -> torch.Tensor | None:
    """Copy uint8 `src` into `dst` (None: no copy) and, with `summed`, return the
    checksum of `dst` (0-d int64 tensor; `checksum`), each chunk summed right
    after it is copied, so the bytes are read from cache, not memory again."""
    if not summed:
        if src is not None:
            dst.copy_(src)
        return None
    if src is None:  # a read only: one pass, nothing to reuse from cache
        return _word_sum(dst)
    total = torch.zeros((), dtype=torch.int64, device=dst.device)
    for start in range(0, max(dst.numel(), 1), _CHUNK):
        chunk = dst[start : start + _CHUNK]
        if src is not None:
            chunk.copy_(src[start : start + _CHUNK])
        total += _word_sum(chunk)
    return total


def checksum(tensor: torch.Tensor) -> int:
    """The sum, mod 2**64, of `tensor`'s bytes read as little-endian 8-byte words
    (the last one zero-padded). It catches changed, missing and stale bytes and
    swapped parameters; not a reordering of words within one tensor, which no
    byte-range copy makes."""
    data = tensor.detach().reshape(-1).view(torch.uint8)
    return int(copy_summed(data, None, True)) % 2**64
