"""Multiprocessing helpers for the server's worker processes: spawn, stop, thread setup."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from multiprocessing.process import BaseProcess
from typing import Any

from .logging import init_logger

logger = init_logger(__name__)


def set_worker_threads(num_threads: int = 1) -> None:
    """Pin a helper process's torch / tokenizer threads so the scheduler keeps the cores."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    import torch

    torch.set_num_threads(num_threads)


def watch_parent(poll_s: float = 1.0) -> None:
    """Exit this process when its parent goes away (e.g. killed with SIGKILL), so that no
    orphaned worker outlives the server."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                logger.error(
                    "parent process %d is gone; %s exits", parent, mp.current_process().name
                )
                os._exit(1)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def worker_setup() -> None:
    """Common start of every child: Ctrl-C is the launcher's business (the terminal sends
    SIGINT to the whole process group; the launcher then stops children with SIGTERM)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch_parent()


def spawn(target: Callable[..., None], name: str, args: Iterable[Any]) -> BaseProcess:
    """Start `target(*args)` in a fresh interpreter (spawn: no forked torch/zmq state)."""
    process = mp.get_context("spawn").Process(target=target, name=name, args=tuple(args))
    process.start()
    return process


def stop_processes(processes: Iterable[BaseProcess], timeout_s: float = 5.0) -> None:
    """SIGTERM every live process, wait up to `timeout_s` in total, then SIGKILL the rest."""
    processes = list(processes)
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + timeout_s
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            logger.warning("%s (pid %s) ignored SIGTERM; killing it", p.name, p.pid)
            p.kill()
            p.join(1.0)
