"""ZeroMQ queues that carry msgpack-encoded messages between the server's processes."""

from __future__ import annotations

import os
from typing import Any

import zmq
import zmq.asyncio

from .codec import decode, encode
from .messages import BatchMsg


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

    def put_encodable(self, msgs: list[Any]) -> list[tuple[Any, Exception]]:
        """`put_many`, except that a message that cannot be encoded does not take the others
        down: they are sent, and it is returned with the encoder's error."""
        if not msgs:
            return []
        try:
            frame = encode(msgs[0] if len(msgs) == 1 else BatchMsg(msgs))
        except Exception:
            sendable, failed = [], []
            for msg in msgs:
                try:
                    encode(msg)
                    sendable.append(msg)
                except Exception as exc:
                    failed.append((msg, exc))
            self.put_many(sendable)
            return failed
        self.socket.send(frame, copy=False)
        return []

    def close(self) -> None:
        self.socket.close()


class ZmqPullQueue:
    """Receiving end (PULL, binds): blocking or draining reads, batches unwrapped."""

    def __init__(self, address: str, context: zmq.Context | None = None) -> None:
        self.socket = (context or zmq.Context.instance()).socket(zmq.PULL)
        _configure(self.socket)
        self.socket.bind(address)

    def get(self, timeout_s: float | None = None) -> list[Any]:
        """Block until a frame arrives (or `timeout_s` passes: then []), then return it and
        everything else already queued."""
        if timeout_s is not None and not self.socket.poll(int(timeout_s * 1000)):
            return []
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
