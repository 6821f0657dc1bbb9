"""Copy and checksum in one pass, in C: the weight sync's only compiled code.

A checked publish copies every parameter into its slot and sums the bytes it
wrote (`meshrl.weights.checksum`). In torch that is two passes per chunk (a
copy, then a sum of what is still in cache); here each 8-byte word is summed
in the register it was copied through. Large aligned copies use streaming
stores, which skip reading the destination into the cache first: the slot is
read next by another process anyway. Work is split over the proc's torch
threads (`torch.get_num_threads()`, the share meshrl gives each proc), one
ctypes call per thread, which releases the GIL.

The C source below is compiled once per machine with the system's C compiler
(0.2-0.5 s; `meshrl.procs.compiled` says where it is kept and why that is safe).
No compiler, a failed build, or `MESHRL_NATIVE=0`: torch does the same work
(`available()` says which runs); the sums are equal either way.
"""

from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from meshrl.procs import compiled

SOURCE = r"""
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* Copy n bytes from src to dst (dst NULL: read only) and return the wrapping sum of
   the bytes as little-endian 8-byte words, the last one zero-padded. */
static uint64_t copy_sum(uint8_t *dst, const uint8_t *src, size_t n) {
    uint64_t acc[8] = {0};
    size_t i = 0;
#if defined(__SSE2__)
    /* Streaming stores for large copies into 16-byte aligned memory. */
    if (dst != NULL && ((uintptr_t)dst & 15) == 0 && n >= ((size_t)1 << 16)) {
        __m128i a0 = _mm_setzero_si128(), a1 = a0, a2 = a0, a3 = a0;
        for (; i + 64 <= n; i += 64) {
            __m128i x0 = _mm_loadu_si128((const __m128i *)(src + i));
            __m128i x1 = _mm_loadu_si128((const __m128i *)(src + i + 16));
            __m128i x2 = _mm_loadu_si128((const __m128i *)(src + i + 32));
            __m128i x3 = _mm_loadu_si128((const __m128i *)(src + i + 48));
            _mm_stream_si128((__m128i *)(dst + i), x0);
            _mm_stream_si128((__m128i *)(dst + i + 16), x1);
            _mm_stream_si128((__m128i *)(dst + i + 32), x2);
            _mm_stream_si128((__m128i *)(dst + i + 48), x3);
            a0 = _mm_add_epi64(a0, x0);
            a1 = _mm_add_epi64(a1, x1);
            a2 = _mm_add_epi64(a2, x2);
            a3 = _mm_add_epi64(a3, x3);
        }
        _mm_sfence();
        uint64_t w[8];
        _mm_storeu_si128((__m128i *)w, a0);
        _mm_storeu_si128((__m128i *)(w + 2), a1);
        _mm_storeu_si128((__m128i *)(w + 4), a2);
        _mm_storeu_si128((__m128i *)(w + 6), a3);
        for (int k = 0; k < 8; k++) acc[k] += w[k];
    }
#endif
    if (dst != NULL) {
        for (; i + 64 <= n; i += 64) {
            uint64_t w[8];
            memcpy(w, src + i, 64);
            memcpy(dst + i, w, 64);
            for (int k = 0; k < 8; k++) acc[k] += w[k];
        }
    } else {
        for (; i + 64 <= n; i += 64) {
            uint64_t w[8];
            memcpy(w, src + i, 64);
            for (int k = 0; k < 8; k++) acc[k] += w[k];
        }
    }
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, src + i, 8);
        if (dst != NULL) memcpy(dst + i, &w, 8);
        acc[0] += w;
    }
    if (i < n) {
        uint64_t w = 0;
        memcpy(&w, src + i, n - i);
        if (dst != NULL) memcpy(dst + i, src + i, n - i);
        acc[0] += w;
    }
    uint64_t sum = 0;
    for (int k = 0; k < 8; k++) sum += acc[k];
    return sum;
}

void meshrl_copy_sums(size_t count, uint8_t **dst, const uint8_t **src, const size_t *n,
                      uint64_t *out) {
    for (size_t k = 0; k < count; k++) out[k] = copy_sum(dst[k], src[k], n[k]);
}
"""

FLAGS = ["-O3", "-shared", "-fPIC"]
ENABLE_ENV = "MESHRL_NATIVE"  # "0": torch only
SPLIT_BYTES = 1 << 20  # less than this in all: one thread

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False
_pool: ThreadPoolExecutor | None = None
_pool_threads = 0


def library() -> ctypes.CDLL | None:
    """The compiled kernel, built at the first call; None where it cannot be."""
    global _library, _tried
    with _lock:
        if _tried:
            return _library
        _tried = True
        if os.environ.get(ENABLE_ENV, "1") == "0":
            return None
        path = compiled.compile_library("copy_sums", SOURCE, FLAGS)
        if path is None:
            return None
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            return None
        fn = lib.meshrl_copy_sums
        fn.restype = None
        fn.argtypes = [ctypes.c_size_t] + [ctypes.c_void_p] * 4
        _library = lib
        return lib


def available() -> bool:
    """Whether weight sync copies and sums with the compiled kernel."""
    return library() is not None


def _threads(count: int) -> ThreadPoolExecutor | None:
    global _pool, _pool_threads
    if count <= 1:
        return None
    with _lock:
        if _pool is None or _pool_threads != count:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(count, thread_name_prefix="meshrl-copy-sum")
            _pool_threads = count
        return _pool


def _run(lib: ctypes.CDLL, segments: list[tuple[int, int, int]]) -> list[int]:
    """One C call over (dst pointer or 0, src pointer, bytes) segments."""
    count = len(segments)
    dst = (ctypes.c_void_p * count)(*(d or None for d, _, _ in segments))
    src = (ctypes.c_void_p * count)(*(s for _, s, _ in segments))
    sizes = (ctypes.c_size_t * count)(*(n for _, _, n in segments))
    out = (ctypes.c_uint64 * count)()
    lib.meshrl_copy_sums(count, dst, src, sizes, out)
    return list(out)


def copy_sums(pairs: list[tuple[torch.Tensor | None, torch.Tensor]]) -> list[int] | None:
    """For each (dst, src) pair of contiguous uint8 CPU tensors of one size (dst
    None: only read src), copy src into dst and return the checksum of the
    bytes (`meshrl.weights.checksum.checksum`), split over this proc's torch
    threads. None when the kernel is not available."""
    lib = library()
    if lib is None:
        return None
    jobs = []
    for dst, src in pairs:
        assert dst is None or dst.numel() == src.numel(), (dst.numel(), src.numel())
        jobs.append((0 if dst is None else dst.data_ptr(), src.data_ptr(), src.numel()))
    total = sum(n for _, _, n in jobs)
    threads = min(torch.get_num_threads(), max(1, total // SPLIT_BYTES))
    pool = _threads(threads)
    if pool is None:
        return [s % 2**64 for s in _run(lib, jobs)]
    # Each thread takes an equal share of the bytes, cut at 64-byte boundaries of a
    # pair (whole words: the sums of a pair's parts add up to its sum; an empty
    # pair's is 0).
    share = -(-total // threads)
    parts: list[list[tuple[int, int, int, int]]] = [[] for _ in range(threads)]
    thread, room = 0, share  # (pair, dst, src, bytes) segments per thread
    for k, (d, s, n) in enumerate(jobs):
        at = 0
        while at < n:
            take = n - at
            if take > room and thread < threads - 1:
                take = min(take, max(64, room // 64 * 64))
            parts[thread].append((k, d + at if d else 0, s + at, take))
            at, room = at + take, room - take
            if room <= 0 and thread < threads - 1:
                thread, room = thread + 1, share
    sums = [0] * len(jobs)
    running = [(part, pool.submit(_run, lib, [j[1:] for j in part])) for part in parts if part]
    for part, future in running:
        for (k, *_), value in zip(part, future.result(), strict=True):
            sums[k] += value
    return [s % 2**64 for s in sums]
