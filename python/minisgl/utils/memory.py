"""Host memory placement: transparent huge pages for large CPU buffers, and a heap that keeps
what it frees."""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

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


def drop_pages(address: int, nbytes: int) -> bool:
    """Let go of the pages of a file mapping's byte range that this process has read (they stay
    in the page cache; touching them again maps them back). Returns whether it was asked."""
    if nbytes <= 0 or not sys.platform.startswith("linux"):
        return False
    first = align_down(address, mmap.PAGESIZE)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(first, address + nbytes - first, mmap.MADV_DONTNEED) == 0


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


@dataclass
class _HeapPolicy:
    """What this process asked of glibc's heap (mallopt cannot be read back)."""

    keep_freed: bool = False


_HEAP = _HeapPolicy()
_GLIBC_DEFAULT_THRESHOLD = 128 << 10


def _glibc(name: str) -> Any | None:
    """A glibc function, or None off Linux and with other libcs (musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL("libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def _set_heap(mmap_threshold: int, trim_threshold: int) -> bool:
    mallopt = _glibc("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        mallopt(_M_TRIM_THRESHOLD, trim_threshold)
    )


def keep_freed_memory() -> bool:
    """Make glibc's malloc serve blocks up to 32 MB from its heap and keep freed memory there.

    By default every block over 128 KB (a prefill's activations: a 2,048-token batch makes
    ~12 MB ones per layer) is a fresh mmap, so each forward pass page-faults and zero-fills its
    whole working set again: ~100k faults and ~5% of a W1 run here. Returns whether it applied
    (glibc on Linux only)."""
    _HEAP.keep_freed = _set_heap(_MMAP_THRESHOLD_MAX, 1 << 30)
    return _HEAP.keep_freed


# oneDNN's primitive cache and PyTorch's cache of its matmuls keep an entry (~0.5 MB each) per
# weight shape and row count: at their defaults (1,024 each) a server whose prompts vary in
# length grew ~600 MB over its first few thousand requests (the default GGUF model's prefill
# multiplies dequantized weights through oneDNN). A dense model's step needs a few entries (its
# layers share them); a float32 MoE's decode two per distinct expert row count (~70 at batch
# 32); a missing one costs ~0.5-1 ms to create.
ONEDNN_CACHE_CAPACITY = 128
_ONEDNN_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_onednn_caches(capacity: int = ONEDNN_CACHE_CAPACITY) -> None:
    """Cap oneDNN's and PyTorch's per-shape matmul caches at `capacity` entries where the
    environment sets no capacity of its own. Both read it once, at their first matmul: a
    process that ran one before keeps the defaults."""
    if capacity < 1:  # PyTorch's cache crashes at 0
        raise ValueError(f"capacity must be at least 1, got {capacity}")
    for name in _ONEDNN_CACHE_VARIABLES:
        os.environ.setdefault(name, str(capacity))


@contextlib.contextmanager
def freed_memory_returned() -> Iterator[None]:
    """Within: every block over 128 KB is its own mmap, unmapped when freed, and the heap is
    trimmed as glibc does by default; on exit `keep_freed_memory`'s settings come back where
    they were in force. For a model load: kept by the heap, its temporaries (fused and
    converted weights, 8-12 MB each for Qwen3-0.6B) piled up to 250 MB of free but resident
    heap, as the blocks between them were never free at once."""
    _set_heap(_GLIBC_DEFAULT_THRESHOLD, _GLIBC_DEFAULT_THRESHOLD)
    try:
        yield
    finally:
        if _HEAP.keep_freed:
            keep_freed_memory()


def release_freed_memory() -> bool:
    """Hand the memory glibc's heap holds free back to the OS (malloc_trim). Returns whether it
    applied (glibc on Linux only)."""
    malloc_trim = _glibc("malloc_trim")
    if malloc_trim is None:
        return False
    malloc_trim.argtypes = [ctypes.c_size_t]
    malloc_trim(0)
    return True


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field!r} line")


def rss_bytes() -> int:
    """This process's resident memory now (Linux)."""
    return _status_kib("VmRSS") << 10


def peak_rss_bytes() -> int:
    """This process's largest resident memory since it started or `reset_peak_rss` (Linux)."""
    return _status_kib("VmHWM") << 10


def reset_peak_rss() -> bool:
    """Restart the peak `peak_rss_bytes` reports from the current RSS; returns whether Linux
    allowed it (writing 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True
