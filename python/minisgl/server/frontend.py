"""The API server's side of the pipeline: submit requests, route results back to handlers."""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from minisgl.message import (
    AbortMsg,
    AcceptedMsg,
    DecodedMsg,
    EncodedMsg,
    ErrorMsg,
    FlushCacheReply,
    LoraAdapterReply,
    OutputMsg,
    StatsMsg,
    TokenizeMsg,
)
from minisgl.message.queue import ZmqAddresses, ZmqAsyncPullQueue, ZmqPushQueue
from minisgl.utils import init_logger

from .metrics import ServerMetrics
from .responses import APIError

logger = init_logger(__name__)

# The one reply of a message that `FrontendManager.call` sends (no token stream).
REPLY_TYPES = (EncodedMsg, DecodedMsg, FlushCacheReply, LoraAdapterReply)


@dataclass
class _Tracked:
    """A submitted request, from the frontend's point of view."""

    queue: asyncio.Queue
    index: int
    arrival: float
    prompt_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None


class FrontendManager:
    """Sends requests to the tokenizer and dispatches what comes back to per-request queues.

    It also turns the token stream into metrics (token counters, TTFT, inter-token latency)
    and the scheduler's stats messages into gauges.
    """

    def __init__(self, addrs: ZmqAddresses, metrics: ServerMetrics) -> None:
        self.addrs = addrs
        self.metrics = metrics
        self._rids = itertools.count()
        self._tracked: dict[int, _Tracked] = {}
        self._inbox: ZmqAsyncPullQueue | None = None
        self._outbox: ZmqPushQueue | None = None
        self._task: asyncio.Task | None = None
        self.failure: str | None = None  # set once the pipeline is known to be broken
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._inbox = ZmqAsyncPullQueue(self.addrs.api_server)
        self._outbox = ZmqPushQueue(self.addrs.tokenizer)
        self._task = asyncio.create_task(self._receive_loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._inbox is not None:
            self._inbox.close()
        if self._outbox is not None:
            self._outbox.close()

    @property
    def healthy(self) -> bool:
        return self.failure is None and self._task is not None and not self._task.done()

    def new_rid(self) -> int:
        return next(self._rids)

    def submit(self, msgs: list[Any], queue: asyncio.Queue, arrival: float) -> None:
        """Start requests whose results go to `queue` as (index in msgs, message)."""
        if not self.healthy:
            raise APIError(
                f"the server is shutting down: {self.failure}", status=503, type="server_error"
            )
        assert self._outbox is not None
        try:
            self._outbox.put_many(list(msgs))
        except Exception as exc:  # validation let through what cannot be encoded: a bug
            logger.exception("cannot send request(s) %s to the tokenizer", [m.rid for m in msgs])
            raise APIError(
                f"the request could not be sent to the engine: {exc}",
                status=500,
                code="request_failed",
                type="server_error",
            ) from exc
        # Tracked only once sent, so a refused submission leaves nothing behind. (Replies are
        # dispatched by this event loop, so none can arrive before this returns.)
        for index, msg in enumerate(msgs):
            self._tracked[msg.rid] = _Tracked(queue, index, arrival)

    async def call(self, msg: Any) -> Any:
        """Send a message that gets one reply (EncodeMsg, DecodeMsg, FlushCacheMsg) and wait
        for it: one of REPLY_TYPES, or an ErrorMsg (also when the pipeline breaks)."""
        queue: asyncio.Queue = asyncio.Queue()
        self.submit([msg], queue, time.perf_counter())
        try:
            _, reply = await queue.get()
        finally:  # cancelled (client gone): a late reply finds nobody and is dropped
            self._tracked.pop(msg.rid, None)
        return reply

    def abort(self, rids: list[int], why: str, client_gone: bool = True) -> None:
        """Abort requests still running (synchronous: safe in a cancelled task's cleanup)."""
        live = [rid for rid in rids if self._tracked.pop(rid, None) is not None]
        if not live or self._outbox is None:
            return
        self._outbox.put_many([AbortMsg(rid) for rid in live])
        self.metrics.requests.labels("abort").inc(len(live))
        if client_gone:
            self.metrics.aborted.inc(len(live))
        logger.info("aborted request(s) %s: %s", live, why)

    def fail_all(self, reason: str) -> None:
        """The pipeline is broken (a worker died): end every waiting request with an error."""
        self.failure = reason
        for rid, tracked in self._tracked.items():
            tracked.queue.put_nowait((tracked.index, ErrorMsg(rid, reason, code="server_error")))
        self._tracked.clear()

    def fail_all_threadsafe(self, reason: str) -> None:
        """`fail_all` from another thread (the launcher's child monitor)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.fail_all, reason)
        else:
            self.failure = reason

    async def _receive_loop(self) -> None:
        assert self._inbox is not None
        try:
            while True:
                for msg in await self._inbox.get():
                    try:
                        self._dispatch(msg)
                    except Exception as exc:
                        self._fail_request(msg, exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("API server receive loop failed")
            self.fail_all(f"internal error: {exc}")

    def _fail_request(self, msg: Any, exc: Exception) -> None:
        """Handling one message failed: that request alone ends with an error."""
        rid = getattr(msg, "rid", None)
        logger.exception("API server: handling %s of request %s failed", type(msg).__name__, rid)
        tracked = self._tracked.pop(rid, None) if rid is not None else None
        if tracked is None:
            return
        error = ErrorMsg(rid, f"internal error: {exc}", code="request_failed")
        tracked.queue.put_nowait((tracked.index, error))
        if self._outbox is not None:
            self._outbox.put_many([AbortMsg(rid)])

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, StatsMsg):
            self.metrics.update_stats(msg)
            return
        tracked = self._tracked.get(msg.rid)
        if tracked is None:  # aborted by us already
            return
        if isinstance(msg, AcceptedMsg):
            tracked.prompt_tokens = msg.prompt_tokens
        elif isinstance(msg, OutputMsg):
            self._record(msg, tracked)
        elif isinstance(msg, (ErrorMsg, *REPLY_TYPES)):  # an error: counted by the handler
            del self._tracked[msg.rid]
        tracked.queue.put_nowait((tracked.index, msg))

    def _record(self, msg: OutputMsg, tracked: _Tracked) -> None:
        m, now = self.metrics, time.perf_counter()
        if msg.num_tokens:
            m.generation_tokens.inc(msg.num_tokens)
            if tracked.first_token_at is None:
                tracked.first_token_at = now
                m.ttft.observe(now - tracked.arrival)
                gaps = msg.num_tokens - 1
            else:
                gaps = msg.num_tokens
            if gaps and tracked.last_token_at is not None:
                for _ in range(gaps):  # tokens that arrived together share the interval
                    m.itl.observe((now - tracked.last_token_at) / gaps)
            tracked.last_token_at = now
        if msg.finish_reason is not None:
            del self._tracked[msg.rid]
            m.requests.labels(msg.finish_reason).inc()
            m.prompt_tokens.inc(tracked.prompt_tokens)
            m.cached_tokens.inc(msg.cached_tokens)
            m.e2e.observe(now - tracked.arrival)


def api_error(msg: ErrorMsg, param_names: dict[str, str]) -> APIError:
    """The HTTP error for a pipeline's ErrorMsg. Codes "server_error" (the server is going
    down: 503), "server_busy" (too much of something is running to take this request now, e.g.
    grammar compiles past their time limit: 503, try later) and "request_failed" (this request
    alone failed: 500) are the server's fault; any other is a rejection of the request (400),
    its pipeline parameter name ("prompt", "max_tokens") renamed to the endpoint's
    (`param_names`, e.g. "prompt" -> "messages")."""
    if msg.code in ("server_error", "server_busy"):
        return APIError(msg.message, status=503, code=msg.code, type="server_error")
    if msg.code == "request_failed":
        return APIError(msg.message, status=500, code=msg.code, type="server_error")
    pipeline_param = msg.param or "prompt"
    param = param_names.get(pipeline_param, pipeline_param)
    message = msg.message
    if pipeline_param == "max_tokens" and param != pipeline_param:  # as the client named it
        message = re.sub(r"\bmax_tokens\b", param, message)
    return APIError(message, status=400, param=param, code=msg.code or "invalid_value")


class RequestGroup:
    """The sub-requests (prompts x n) of one HTTP request, sharing one result queue.

    `param_names` renames the pipeline's parameter names in errors to the endpoint's.
    """

    def __init__(
        self, frontend: FrontendManager, msgs: list[TokenizeMsg], param_names: dict[str, str]
    ) -> None:
        self.frontend = frontend
        self.param_names = param_names
        self.rids = [m.rid for m in msgs]
        self.queue: asyncio.Queue = asyncio.Queue()
        self.prompt_tokens = [0] * len(msgs)
        self.prompt_texts: list[str | None] = [None] * len(msgs)  # with echo: decoded
        self.unfinished = set(range(len(msgs)))
        self._early: list[tuple[int, OutputMsg]] = []
        frontend.submit(msgs, self.queue, time.perf_counter())

    async def wait_accepted(self) -> None:
        """Wait until the scheduler queued every sub-request; raise its error if one failed."""
        waiting = set(range(len(self.rids)))
        while waiting:
            index, msg = await self.queue.get()
            if isinstance(msg, ErrorMsg):
                self.unfinished.discard(index)
                self.abort("another prompt of the request was rejected", client_gone=False)
                raise api_error(msg, self.param_names)
            if isinstance(msg, AcceptedMsg):
                self.prompt_tokens[index] = msg.prompt_tokens
                self.prompt_texts[index] = msg.prompt_text
                waiting.discard(index)
            else:  # a sub-request may produce tokens before a sibling is accepted
                self._early.append((index, msg))

    async def outputs(self) -> AsyncIterator[tuple[int, OutputMsg]]:
        """Text pieces of every sub-request until all have finished."""
        for index, msg in self._early:
            yield self._seen(index, msg)
        self._early.clear()
        while self.unfinished:
            index, msg = await self.queue.get()
            if isinstance(msg, ErrorMsg):
                self.unfinished.discard(index)
                self.abort("another choice of the request failed", client_gone=False)
                raise api_error(msg, self.param_names)
            yield self._seen(index, msg)

    def _seen(self, index: int, msg: OutputMsg) -> tuple[int, OutputMsg]:
        if msg.finish_reason is not None:
            self.unfinished.discard(index)
        return index, msg

    def abort(self, why: str, client_gone: bool = True) -> None:
        """Abort every sub-request that has not finished (no-op when all have)."""
        self.frontend.abort([self.rids[i] for i in sorted(self.unfinished)], why, client_gone)
        self.unfinished.clear()
