"""Queue order policies: which waiting request is admitted next."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from minisgl.core import Req
from minisgl.utils import Registry

# Past this queue length, longest-prefix-match costs more than it can win: fall back to FCFS.
LPM_MAX_QUEUE = 128

SCHEDULE_POLICIES: Registry[Callable[[deque[Req], Callable[[Req], int]], None]] = Registry(
    "schedule_policy"
)


@SCHEDULE_POLICIES.register("fcfs")
def fcfs(waiting: deque[Req], cached_len: Callable[[Req], int]) -> None:
    """First come, first served: keep arrival order."""


@SCHEDULE_POLICIES.register("lpm")
def lpm(waiting: deque[Req], cached_len: Callable[[Req], int]) -> None:
    """Longest cached prefix first (stable, so ties keep arrival order)."""
    if len(waiting) > LPM_MAX_QUEUE:
        return
    ordered = sorted(waiting, key=lambda r: -cached_len(r))
    waiting.clear()
    waiting.extend(ordered)


@SCHEDULE_POLICIES.register("priority")
def priority(waiting: deque[Req], cached_len: Callable[[Req], int]) -> None:
    """Highest `SamplingParams.priority` first (SGLang's: larger = more important), then
    arrival order (uid: a retracted request keeps its place among its equals)."""
    ordered = sorted(waiting, key=lambda r: (-r.sampling_params.priority, r.uid))
    waiting.clear()
    waiting.extend(ordered)
