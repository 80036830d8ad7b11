"""Host memory placement: transparent huge pages for large CPU buffers, and a heap that keeps
what it frees."""

from __future__ import annotations

import ctypes
import math
import sys

import torch

from .misc import align_down, align_up

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14  # Linux <sys/mman.h>
# glibc <malloc.h> mallopt parameters.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux to back a large CPU tensor with transparent huge pages; call it before the
    tensor is first written (pages already touched stay small). Returns whether it was asked.

    The KV pool is read row by row at scattered slots: with 4 KB pages nearly every row is a TLB
    miss, with 2 MB pages a whole run of slots shares one entry. Systems with THP set to
    `madvise` (the common default) only give huge pages to memory that asks."""
    if tensor.device.type != "cpu" or not sys.platform.startswith("linux"):
        return False
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = align_up(start, HUGE_PAGE_BYTES)
    length = align_down(end - first, HUGE_PAGE_BYTES) if end > first else 0
    if length <= 0:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(first, length, _MADV_HUGEPAGE) == 0


def empty_on_huge_pages(specs: list[tuple[torch.Size, torch.dtype]]) -> list[torch.Tensor]:
    """Uninitialised CPU tensors of the given (shape, dtype)s laid back to back (64-byte
    aligned) in one buffer backed by transparent huge pages; pages are only taken as they are
    first written, so filling them one by one while freeing the originals keeps memory flat.

    Weights stream whole every decode step. On 4 KB pages, and on separate allocations whose few
    2 MB-aligned stretches are all a per-tensor advice can cover, streaming SmolLM2's 120 layer
    weights one after another ran at 12.7 GB/s on a VM where one buffer on huge pages gave 21.4
    (page walks there are two-level, guest and host)."""
    offsets, total = [], 0
    for shape, dtype in specs:
        offsets.append(total)
        total = align_up(total + math.prod(shape) * dtype.itemsize, 64)
    buffer = torch.empty(total + HUGE_PAGE_BYTES, dtype=torch.uint8)
    start = align_up(buffer.data_ptr(), HUGE_PAGE_BYTES) - buffer.data_ptr()
    buffer = buffer[start : start + total]
    advise_huge_pages(buffer)
    return [
        buffer[offset : offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
        for (shape, dtype), offset in zip(specs, offsets)
    ]


def keep_freed_memory() -> bool:
    """Make glibc's malloc serve blocks up to 32 MB from its heap and keep freed memory there.

    By default every block over 128 KB (a prefill's activations: a 2,048-token batch makes
    ~12 MB ones per layer) is a fresh mmap, so each forward pass page-faults and zero-fills its
    whole working set again: ~100k faults and ~5% of a W1 run here. Returns whether it applied
    (glibc on Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other libcs
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(
        mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    )
