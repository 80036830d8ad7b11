"""Busy-loop processes beside an engine, to measure how it degrades on a busy machine.

`BusyLoops(n)` starts n processes that spin on plain Python bytecode, each pinned to one CPU
of this process's affinity set, taken from the end (2 CPUs, n=1: CPU 1 spins), and kills them
when its `with` block ends, on Ctrl-C and SIGTERM too (the benchmarks turn SIGTERM into
SystemExit). A spinner also dies with this process when it is killed outright: it asks the
kernel for SIGKILL on its parent's death and checks its parent between bursts. Standard
library only, so that a spinner starts in milliseconds (`python -I -S contention.py --spin`).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from types import TracebackType

# Bytecodes between two checks that the parent still lives (about a millisecond each).
SPIN_BURST = 100_000
PR_SET_PDEATHSIG = 1


def spin(cpu: int, parent: int) -> None:
    """The spinner's body: pin to `cpu`, say so on stdout, spin until `parent` is gone."""
    try:
        import ctypes

        # Delivered by the kernel even while this process is stopped (SIGSTOP).
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (ImportError, OSError, AttributeError):  # no prctl: the parent check below remains
        pass
    os.sched_setaffinity(0, {cpu})
    print("spinning", flush=True)
    while os.getppid() == parent:
        for _ in range(SPIN_BURST):
            pass


def busy_cpus(count: int) -> list[int]:
    """The CPUs `count` spinners take: the last `count` of this process's affinity set."""
    cpus = sorted(os.sched_getaffinity(0))
    if not 1 <= count < len(cpus):
        raise ValueError(
            f"busy-loop count {count}: want 1 <= count < {len(cpus)} (the CPUs this process "
            f"may use: {format_cpus(cpus)}), so that the engine keeps at least one"
        )
    return cpus[-count:]


def format_cpus(cpus: Sequence[int]) -> str:
    """`0-3` for a contiguous run, else `0,2,5`."""
    if len(cpus) > 1 and list(cpus) == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))


class BusyLoops:
    """A context manager: `count` spinning processes, one per CPU, for the `with` block.

    With `paused` they start stopped (SIGSTOP, no CPU used) until `resume()`; `pause()` stops
    them again. Must be entered from a thread that outlives the block: the kernel's
    parent-death signal follows the thread that started them.
    """

    def __init__(self, count: int, paused: bool = False) -> None:
        self.count = count
        self.cpus = busy_cpus(count)
        self.paused = paused
        self.procs: list[subprocess.Popen[str]] = []

    def describe(self) -> str:
        """E.g. `1 busy-loop process on CPU 1 (of 0-1)`."""
        every = format_cpus(sorted(os.sched_getaffinity(0)))
        plural = "es" if self.count > 1 else ""
        return (
            f"{self.count} busy-loop process{plural} on CPU{'s' if self.count > 1 else ''} "
            f"{format_cpus(self.cpus)} (of {every})"
        )

    def __enter__(self) -> BusyLoops:
        try:
            for cpu in self.cpus:
                self._start(cpu)
            if self.paused:
                self.pause()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _start(self, cpu: int) -> None:
        cmd = [sys.executable, "-I", "-S", __file__, "--spin", str(cpu), str(os.getpid())]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        self.procs.append(proc)  # before the checks, so that stop() reaches it if they fail
        assert proc.stdout is not None
        ready = proc.stdout.readline().strip()
        if ready != "spinning":
            raise RuntimeError(f"busy loop for CPU {cpu} did not start (exit {proc.poll()})")
        pinned = os.sched_getaffinity(proc.pid)
        if pinned != {cpu}:
            raise RuntimeError(f"busy loop for CPU {cpu} runs on CPUs {sorted(pinned)}")

    def _signal(self, sig: signal.Signals) -> None:
        for proc in self.procs:
            try:
                proc.send_signal(sig)
            except ProcessLookupError:  # already gone (killed from outside)
                pass

    def pause(self) -> None:
        """Stop the spinners (SIGSTOP); they keep their CPUs but use no time."""
        self._signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        """Let the spinners spin again (SIGCONT)."""
        self._signal(signal.SIGCONT)
        self.paused = False

    def set_spinning(self, spinning: bool) -> None:
        """`resume()` or `pause()`, whichever is not the current state."""
        if spinning and self.paused:
            self.resume()
        elif not spinning and not self.paused:
            self.pause()

    def stop(self) -> None:
        """Kill every spinner (SIGKILL works on stopped ones too) and reap it."""
        self._signal(signal.SIGKILL)
        for proc in self.procs:
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        self.procs.clear()


def add_contention_option(p: argparse.ArgumentParser, what: str) -> None:
    """`--contention N` (default 0: none); `what` says which runs it repeats under load."""
    p.add_argument(
        "--contention",
        type=int,
        default=0,
        metavar="N",
        help=f"also {what} with N busy-loop processes spinning on the last N CPUs; print the "
        "slowdown against the quiet runs (N must leave at least one CPU)",
    )


def check_contention(p: argparse.ArgumentParser, count: int) -> None:
    """Reject a --contention count that is negative or leaves the engine no CPU (0: off)."""
    if count != 0:
        try:
            busy_cpus(count)
        except ValueError as exc:
            p.error(f"--contention: {exc}")


def slowdown(quiet: float | None, contended: float | None) -> str | None:
    """contended / quiet as `2.13x` (None when either is missing or quiet is 0)."""
    if quiet is None or contended is None or quiet == 0:
        return None
    return f"{contended / quiet:.2f}x"


def slowdown_rows(
    metrics: Sequence[tuple[str, float | None, float | None]],
) -> list[list[object]]:
    """Table rows `[metric, quiet, contended, contended / quiet]` for format_table."""
    return [[name, q, c, slowdown(q, c)] for name, q, c in metrics]


def main(argv: list[str] | None = None) -> None:
    """`contention.py --spin CPU PARENT_PID`: the spinner process (started by BusyLoops)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spin", nargs=2, type=int, metavar=("CPU", "PARENT_PID"), required=True)
    args = p.parse_args(argv)
    spin(*args.spin)


if __name__ == "__main__":
    main()
