"""Host memory for CPU serving: glibc's allocator kept from giving memory back between steps, and
the weights and KV cache on transparent huge pages.

keep_freed_memory:

By default glibc serves a large allocation with a fresh mmap and returns freed memory at the top of
its heap to the kernel, so a step whose buffers differ in size from the last one's (a prefill
after decodes, a batch that grew) faults its pages in anew, each zeroed by the kernel: on the
development VM a 32-row decode step took 117-230 ms instead of 33-41 ms right after a prefill, and
the first prefill of a server 1.0-1.2 s instead of 0.8 s (2026-12-04). vLLM's CPU docs preload
tcmalloc for the same reason. Here glibc is told once, at start: requests under its largest mmap
threshold come from the heap, the heap grows 256 MiB at a time (without it a 32-row decode step
still took 170-280 ms now and then, where the heap had to grow), and it is never trimmed.

on_huge_pages, huge_page_zeros: a decode step streams every weight once, and its attention reads
each row's scattered KV blocks; on 4 KiB pages both pay a TLB miss (and a hardware prefetcher
that stops) every few KiB. Memory asked of the kernel with MADV_HUGEPAGE is backed by 2 MiB pages
where the kernel allows it (transparent_hugepage "madvise" or "always"; "never" leaves 4 KiB
pages, and nothing else changes): the packed decoder weights streamed at 34.1-34.9 GB/s against
29.0-30.5 on 4 KiB pages (120 matrices of the embedded model, one row, 2026-12-04).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap

import numpy as np
import torch

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # mallopt's parameters (malloc.h)
TOP_PAD = 256 << 20  # the heap grows this much beyond a request at a time
LARGEST_MMAP_THRESHOLD = 32 << 20  # glibc refuses more on 64-bit (4 MiB x sizeof(long))
NEVER_TRIM = (1 << 63) - 1


def keep_freed_memory() -> bool:
    """Whether glibc took the settings (False: another C library, which keeps its own policy)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_long], ctypes.c_int
    took = (
        mallopt(M_MMAP_THRESHOLD, LARGEST_MMAP_THRESHOLD)
        and mallopt(M_TRIM_THRESHOLD, NEVER_TRIM)
        and mallopt(M_TOP_PAD, TOP_PAD)
    )
    if not took:
        log.warning("glibc refused the allocator settings: steps may fault their buffers in anew")
    return bool(took)


HUGE_PAGE = 2 << 20


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled tensor in fresh anonymous memory advised for huge pages, 2 MiB-aligned. The
    kernel zeroes its pages on first touch, so what is never used costs nothing (as calloc)."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    raw = np.frombuffer(region, dtype=np.uint8)  # keeps the mapping alive while the tensor lives
    start = -raw.ctypes.data % HUGE_PAGE
    return torch.from_numpy(raw[start : start + nbytes]).view(dtype).view(shape)


def on_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` (contiguous) in huge_page_zeros' memory."""
    return huge_page_zeros(tuple(tensor.shape), tensor.dtype).copy_(tensor)
