"""How many threads the engine computes with on the CPU: the cores that are actually free.

Every parallel region waits for its slowest thread. With one of two cores taken by another
process, the second thread is descheduled for whole time slices at every barrier: a decode
step of 0.02 s took up to 2.4 s in the server, and W1 3-5x its quiet time, where one thread
took 2x. So the thread count follows the cores other processes leave. A sampling thread reads,
every `interval_s` (idle or not), the busy time of this process's CPUs (/proc/stat) minus this
process's own CPU time: what the others used. The threads are the CPUs minus that, rounded:
fewer at once, more only once two readings agree. The C kernels take a new count from their
next call (`set_thread_cap`), torch's own ops from the next step (`update`, in the stepping
thread), so the readings cost the steps nothing.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from minisgl.kernel.cpu import NO_CAP, set_thread_cap
from minisgl.utils import init_logger

logger = init_logger(__name__)

# /proc/stat's per-CPU columns that count as busy: user, nice, system, irq, softirq, steal
# (a core the hypervisor lends elsewhere is not ours either); idle and iowait are free.
_BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def busy_seconds(cpus: frozenset[int]) -> float | None:
    """CPU-seconds the given CPUs have been busy since boot; None without /proc/stat."""
    try:
        with open("/proc/stat") as f:
            lines = f.readlines()
    except OSError:
        return None
    ticks = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            values = rest.split()
            ticks += sum(int(values[i]) for i in _BUSY_COLUMNS if i < len(values))
    return ticks / _CLOCK_TICKS


def own_seconds() -> float:
    """CPU-seconds this process has used (all its threads)."""
    times = os.times()
    return times.user + times.system


def _affinity() -> frozenset[int]:
    return frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()


def _sample_forever(ref: weakref.ref[CpuThreads], stop: threading.Event, interval_s: float) -> None:
    while not stop.wait(interval_s):
        governor = ref()
        if governor is None or not governor.adaptive:  # gone, or its readings failed
            return
        governor.sample()
        del governor


@dataclass
class CpuThreads:
    """Keeps torch's thread count (which the C kernels follow) at the cores others leave free.

    Call `update()` before each step from the thread that runs the step (OpenMP's thread count
    belongs to the calling thread); `close()` stops the sampling thread.
    """

    max_threads: int
    adaptive: bool = True
    interval_s: float = 0.25
    cpus: frozenset[int] = field(default_factory=_affinity)
    # Where readings come from, and whether a thread of its own takes them (tests: neither).
    read_busy: Callable[[frozenset[int]], float | None] = busy_seconds
    read_own: Callable[[], float] = own_seconds
    clock: Callable[[], float] = time.monotonic
    background: bool = True
    wanted: int = field(init=False)
    _last: tuple[float, float, float] | None = field(init=False, default=None)
    _candidate: int | None = field(init=False, default=None)
    _stop: threading.Event = field(init=False, default_factory=threading.Event)

    def __post_init__(self) -> None:
        linux = sys.platform.startswith("linux")
        self.adaptive = self.adaptive and linux and self.max_threads > 1 and bool(self.cpus)
        self.wanted = self.max_threads
        torch.set_num_threads(self.wanted)
        set_thread_cap(self.wanted)
        if self.adaptive:
            self.sample()  # the first reading: later ones measure from here
            if self.background:
                args = (weakref.ref(self), self._stop, self.interval_s)
                threading.Thread(
                    target=_sample_forever, args=args, name="minisgl-cpu-threads", daemon=True
                ).start()

    def sample(self) -> None:
        """One reading: what other processes used since the last, and the count it calls for."""
        busy = self.read_busy(self.cpus)
        if busy is None:
            self.adaptive = False
            return
        now, own = self.clock(), self.read_own()
        last, self._last = self._last, (now, busy, own)
        if last is None or now <= last[0]:
            return
        others = max(0.0, (busy - last[1]) - (own - last[2])) / (now - last[0])
        count = max(1, min(self.max_threads, int(len(self.cpus) - others + 0.5)))
        if count < self.wanted or (count > self.wanted and count == self._candidate):
            logger.debug("threads %d -> %d: others used %.2f CPUs", self.wanted, count, others)
            self.wanted = count
            set_thread_cap(count)
        self._candidate = count

    def update(self) -> int:
        """Apply the latest count in the calling thread; returns it."""
        wanted = self.wanted
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)
        return wanted

    def close(self) -> None:
        """Stop sampling and lift the kernels' cap."""
        self._stop.set()
        set_thread_cap(NO_CAP)
