"""Child processes the benchmarks start (servers, peers): stopping a whole process group, and
SIGTERM that unwinds like Ctrl-C so that `finally` blocks stop them."""

from __future__ import annotations

import os
import signal
import subprocess
from types import FrameType


def stop_process_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM a child's process group (start_new_session=True), SIGKILL it after grace_s."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # the group is gone already
            return
        try:
            proc.wait(timeout=wait_s)
            if sig == signal.SIGTERM:
                # The leader is gone; make sure no worker of its group lingers.
                os.killpg(proc.pid, signal.SIGKILL)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def exit_on_sigterm() -> None:
    """Make SIGTERM unwind like Ctrl-C, so `finally` blocks stop peers and servers."""

    def _raise_exit(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _raise_exit)
