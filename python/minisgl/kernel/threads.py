"""How many threads a C kernel call runs on: torch's count, capped by the engine's thread
governor (`set_thread_cap`)."""

from __future__ import annotations

import torch

# At most this many threads per C kernel call, whatever torch's count in the calling thread. The
# engine's thread governor sets it from its sampling thread, so a step already running takes
# fewer threads from its next kernel on when a core turns busy (torch's own count, a per-thread
# OpenMP setting, only changes between steps).
NO_CAP = 1 << 30
_thread_cap = NO_CAP


def set_thread_cap(threads: int) -> None:
    """Cap the threads of every later C kernel call (any int >= 1)."""
    global _thread_cap
    _thread_cap = max(1, threads)


def kernel_threads() -> int:
    """Threads a C kernel call runs on: torch's count, capped by `set_thread_cap`."""
    return min(torch.get_num_threads(), _thread_cap)
