"""Multiprocessing helpers for the server's worker processes: spawn, stop, thread setup."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from multiprocessing.process import BaseProcess
from typing import Any

import psutil

from .logging import init_logger

logger = init_logger(__name__)
# When each process spawn() started began (psutil's create_time), to tell its pid from a reuse.
_CREATED: weakref.WeakKeyDictionary[BaseProcess, float] = weakref.WeakKeyDictionary()


def set_worker_threads(num_threads: int = 1) -> None:
    """Pin a helper process's torch / tokenizer threads so the scheduler keeps the cores."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    import torch

    torch.set_num_threads(num_threads)


def watch_parent(poll_s: float = 1.0) -> None:
    """Exit this process when the process that started it goes away (e.g. killed with SIGKILL),
    so that no orphaned worker outlives the server. That is multiprocessing's parent (its
    sentinel ends with it), not the OS parent: a worker forked by the fork server has the fork
    server as OS parent, which lives as long as any of its workers do."""
    parent = mp.parent_process()
    os_parent = os.getppid()

    def gone() -> bool:
        if parent is not None:
            return not parent.is_alive()
        return os.getppid() != os_parent

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if gone():
                pid = parent.pid if parent is not None else os_parent
                logger.error("parent process %s is gone; %s exits", pid, mp.current_process().name)
                os._exit(1)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def worker_setup() -> None:
    """Common start of every child: Ctrl-C is the launcher's business (the terminal sends
    SIGINT to the whole process group; the launcher then stops children with SIGTERM)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch_parent()


def start_method() -> str:
    """How worker processes start: forked from the fork server where the platform has one."""
    return "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


def start_fork_server(preload: Iterable[str]) -> None:
    """Start the process that `spawn` forks workers from, importing the `preload` modules first
    while this process goes on: a worker then starts with torch and its modules loaded, where a
    spawned one imports them itself (seconds a worker on two cores, all of them at once)."""
    if start_method() != "forkserver":
        return
    from multiprocessing import forkserver

    mp.get_context("forkserver").set_forkserver_preload(list(preload))
    forkserver.ensure_running()


def spawn(target: Callable[..., None], name: str, args: Iterable[Any]) -> BaseProcess:
    """Start `target(*args)` in a new process: forked from the fork server (a clean process that
    has only imported modules: none of this one's torch threads or zmq sockets), or where the
    platform has none, a fresh interpreter."""
    process = mp.get_context(start_method()).Process(target=target, name=name, args=tuple(args))
    process.start()
    try:  # (the pid with this start time is this process: running() asks it)
        _CREATED[process] = psutil.Process(process.pid).create_time()
    except psutil.NoSuchProcess:
        pass
    return process


def running(process: BaseProcess) -> bool:
    """Whether the process still runs. A worker forked by the fork server is reported dead
    (is_alive() false, join() returns, exit code 255) as soon as the fork server is: a SIGTERM
    to the whole process group kills that too, while the worker may still be writing the KV
    cache to the disk tier. So its pid is asked as well."""
    if process.is_alive():
        return True
    created = _CREATED.get(process)
    if created is None:  # not started by spawn(): its pid may be another process's by now
        return False
    try:
        found = psutil.Process(process.pid)
        return found.create_time() == created and found.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stop_processes(processes: Iterable[BaseProcess], timeout_s: float = 5.0) -> None:
    """SIGTERM every running process, wait until each has exited (up to `timeout_s` in total),
    then SIGKILL the rest."""
    processes = list(processes)
    for p in processes:
        if running(p):
            _signal(p, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
        while running(p) and time.monotonic() < deadline:
            time.sleep(0.02)
        if running(p):
            logger.warning("%s (pid %s) ignored SIGTERM; killing it", p.name, p.pid)
            _signal(p, signal.SIGKILL)
            p.join(1.0)


def _signal(process: BaseProcess, signum: int) -> None:
    # By pid: a worker whose fork server died already counts as exited to Process.terminate().
    try:
        os.kill(process.pid, signum)
    except (ProcessLookupError, TypeError):
        pass
