"""serving.py's load generator: streaming completions of token-id prompts, sent at Poisson (or
all-at-once) arrival times with at most C in flight, each SSE event's arrival time recorded."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import httpx
import numpy as np

T = TypeVar("T")
# New tokens of each untimed warm-up request.
WARMUP_TOKENS = 4
# Read timeout of one stream: a request queued behind many others may wait long for its first
# token on a slow CPU, and the benchmark should measure that rather than give up.
STREAM_TIMEOUT_S = 900.0


@dataclass
class RequestResult:
    """One streamed request, as the client saw it (times in seconds)."""

    prompt_len: int
    sent: float = 0.0  # perf_counter when the request went out
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int = 0  # from the final usage chunk: the server's exact count
    # Arrival time (since `sent`) and text of every chunk that carried text.
    chunk_times: list[float] = field(default_factory=list)
    chunk_texts: list[str] = field(default_factory=list)
    error: str | None = None
    # Arrival time and raw payload of every SSE event, parsed once the run is over.
    events: list[tuple[float, bytes]] = field(default_factory=list, repr=False)

    @property
    def ok(self) -> bool:
        """It completed without error and streamed text."""
        return self.error is None and self.ttft is not None and self.e2e is not None

    @property
    def tpot(self) -> float | None:
        """(e2e - TTFT) / (output tokens - 1); None for a failed or one-token request."""
        if not self.ok or self.output_tokens < 2:
            return None
        assert self.e2e is not None and self.ttft is not None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def parse_events(self) -> None:
        """Fill TTFT, chunk times and texts and the token count from the raw events (a
        request that failed on the way keeps its error and drops them)."""
        if self.error is not None:
            self.events.clear()
            return
        try:
            for at, data in self.events:
                event = json.loads(data)
                if "error" in event:  # the server reports mid-stream failures in-band
                    self.error = str(event["error"].get("message", event["error"]))
                    return
                if event.get("usage"):
                    self.output_tokens = int(event["usage"]["completion_tokens"])
                for choice in event.get("choices", []):
                    # Chunks with no text (the finish reason) mark no new token.
                    if choice.get("text"):
                        if self.ttft is None:
                            self.ttft = at
                        self.chunk_times.append(at)
                        self.chunk_texts.append(choice["text"])
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            self.error = f"bad stream event: {type(exc).__name__}: {exc}"
            return
        finally:
            self.events.clear()
        if self.output_tokens == 0:
            self.error = "no usage chunk in the stream"


async def stream_one(
    session: aiohttp.ClientSession,
    url: str,
    model_name: str,
    ids: list[int],
    max_tokens: int,
) -> RequestResult:
    """Send one streaming completion; record when each SSE event arrives.

    Only arrival times and raw payloads are kept here: JSON parsing waits until the run is
    over, since anything heavier would compete with the server for the same cores while it is
    being measured.
    """
    result = RequestResult(prompt_len=len(ids))
    body = {
        "model": model_name,
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result.sent = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                text = (await response.read()).decode(errors="replace")
                result.error = f"HTTP {response.status}: {text[:200]}"
                return result
            async for line in response.content:  # one SSE line at a time
                if not line.startswith(b"data: "):
                    continue  # blank separators between SSE events
                data = line[6:].rstrip()
                if data == b"[DONE]":
                    break
                result.events.append((time.perf_counter() - result.sent, data))
        result.e2e = time.perf_counter() - result.sent
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def arrival_offsets(n: int, rate: float, rng: np.random.Generator) -> list[float]:
    """Send times (s after the start) of a Poisson process at `rate` req/s; 0s when inf."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = rng.exponential(1.0 / rate, n)
    gaps[0] = 0.0  # the first request opens the run instead of waiting a random gap
    return np.cumsum(gaps).tolist()


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` on uvloop where installed: the client's own CPU time per streamed chunk
    competes with the server it measures."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


async def run_load(
    url: str,
    model_name: str,
    prompts: list[list[int]],
    max_tokens: int,
    offsets: list[float],
    concurrency: int | None,
    headers: dict[str, str],
) -> tuple[list[RequestResult], float]:
    """Send every prompt at its offset, at most `concurrency` in flight; (results, wall s)."""
    gate = asyncio.Semaphore(concurrency or len(prompts))
    # No connection limit below the concurrency: queueing inside the client would count as
    # server latency.
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=STREAM_TIMEOUT_S)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, headers=headers
    ) as session:
        start = time.perf_counter()

        async def one(ids: list[int], offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            # TTFT counts from when the request is sent, not from when it was due: time spent
            # waiting here for a free slot is the closed loop's, not the server's.
            async with gate:
                return await stream_one(session, url, model_name, ids, max_tokens)

        results = await asyncio.gather(*(one(p, o) for p, o in zip(prompts, offsets)))
        wall = time.perf_counter() - start
    for result in results:
        result.parse_events()
    return list(results), wall


def served_model(url: str, headers: dict[str, str]) -> tuple[str, str | None]:
    """The model name the server expects in requests, and its folder (if it says)."""
    reply = httpx.get(f"{url}/v1/models", headers=headers, timeout=10.0)
    reply.raise_for_status()
    card = reply.json()["data"][0]
    return card["id"], card.get("root")
