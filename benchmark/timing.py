"""Timing a call: every run after an untimed warm-up call, and the best or median of them; a\ntimed comparison of two ways to do the same work."""

from __future__ import annotations

import time
from collections.abc import Callable

# A timed comparison (cpu_kernels.py's rows): label, baseline's name, baseline s, kernel s.
Comparison = tuple[str, str, float, float]


def call_seconds(fn: Callable[[], object], repeat: int) -> list[float]:
    """The wall time of each of `repeat` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def best_seconds(fn: Callable[[], object], repeat: int) -> float:
    """The fastest call: for a bound, which no run should beat."""
    return min(call_seconds(fn, repeat))


def median_seconds(fn: Callable[[], object], repeat: int) -> float:
    """The median call (the upper middle one for an even count)."""
    times = sorted(call_seconds(fn, repeat))
    return times[len(times) // 2]
