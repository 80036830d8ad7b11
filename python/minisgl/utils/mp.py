"""Multiprocessing and ZeroMQ helpers for the server's worker processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from multiprocessing.process import BaseProcess
from typing import Any

import zmq
import zmq.asyncio

from minisgl.message import BatchMsg, decode, encode

from .logging import init_logger

logger = init_logger(__name__)


def ipc_address(directory: str, name: str) -> str:
    """A ZeroMQ ipc endpoint inside `directory` (a private temp dir of the launcher)."""
    return f"ipc://{os.path.join(directory, name)}.sock"


def unbatch(msg: Any) -> list[Any]:
    """The messages inside one received frame."""
    return list(msg.items) if isinstance(msg, BatchMsg) else [msg]


def _configure(sock: zmq.Socket) -> None:
    # Unbounded queues: a slow peer must delay messages, never drop them or block the sender
    # forever; LINGER 0 so a closing process never waits on a peer that is already gone.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)


class ZmqPushQueue:
    """Sending end (PUSH, connects): `put` one message or `put_many` as one frame."""

    def __init__(self, address: str, context: zmq.Context | None = None) -> None:
        self.socket = (context or zmq.Context.instance()).socket(zmq.PUSH)
        _configure(self.socket)
        self.socket.connect(address)

    def put(self, msg: Any) -> None:
        self.socket.send(encode(msg), copy=False)

    def put_many(self, msgs: list[Any]) -> None:
        if msgs:
            self.put(msgs[0] if len(msgs) == 1 else BatchMsg(msgs))

    def close(self) -> None:
        self.socket.close()


class ZmqPullQueue:
    """Receiving end (PULL, binds): blocking or draining reads, batches unwrapped."""

    def __init__(self, address: str, context: zmq.Context | None = None) -> None:
        self.socket = (context or zmq.Context.instance()).socket(zmq.PULL)
        _configure(self.socket)
        self.socket.bind(address)

    def get(self) -> list[Any]:
        """Block until a frame arrives, then return it and everything else already queued."""
        msgs = unbatch(decode(self.socket.recv()))
        return msgs + self.drain()

    def drain(self) -> list[Any]:
        """Every message queued now, without blocking."""
        msgs: list[Any] = []
        while True:
            try:
                frame = self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return msgs
            msgs.extend(unbatch(decode(frame)))

    def close(self) -> None:
        self.socket.close()


class ZmqAsyncPullQueue:
    """asyncio receiving end (PULL, binds) for the API server's event loop."""

    def __init__(self, address: str) -> None:
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.PULL)
        _configure(self.socket)
        self.socket.bind(address)

    async def get(self) -> list[Any]:
        return unbatch(decode(await self.socket.recv()))

    def close(self) -> None:
        self.socket.close()
        self.context.term()


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


class ZmqAddresses:
    """Where each process's inbox (PULL socket) is bound; every sender connects to it."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.tokenizer = ipc_address(directory, "tokenizer")
        self.scheduler = ipc_address(directory, "scheduler")
        self.detokenizer = ipc_address(directory, "detokenizer")
        self.api_server = ipc_address(directory, "api_server")

    def __repr__(self) -> str:
        return f"ZmqAddresses({self.directory!r})"
