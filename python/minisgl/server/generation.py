"""Running a generation for an HTTP handler, whatever its response shape: submit the
sub-requests, wait until they are queued, and collect their outputs while watching for the
client leaving (then everything is aborted)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from minisgl.message import OutputMsg, TokenizeMsg

from .frontend import FrontendManager, RequestGroup


@dataclass
class ChoiceOutput:
    """One sub-request's whole output."""

    pieces: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    matched_stop: str | int | None = None
    embedding: list[float] | None = None  # an embedding request's pooled vector

    @property
    def text(self) -> str:
        return "".join(self.pieces)


async def start_group(
    frontend: FrontendManager, msgs: list[TokenizeMsg], param_names: dict[str, str]
) -> RequestGroup:
    """Submit the sub-requests and wait until the scheduler queued them all; a rejection is
    raised as its APIError (with `param_names` renaming the pipeline's parameters)."""
    group = RequestGroup(frontend, msgs, param_names)
    try:
        await group.wait_accepted()
    except asyncio.CancelledError:
        group.abort("request cancelled")
        raise
    return group


async def wait_disconnect(request: Request) -> None:
    """Return once the client has gone away."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect_outputs(
    request: Request,
    group: RequestGroup,
    on_output: Callable[[int, OutputMsg], Any] | None = None,
) -> list[ChoiceOutput] | None:
    """Every sub-request's output once all have finished; None when the client went away
    first (everything is aborted then). A mid-generation error is raised as its APIError.
    on_output: also sees each output message (e.g. to gather its logprobs)."""
    outputs = [ChoiceOutput() for _ in group.rids]

    async def consume() -> None:
        async for index, out in group.outputs():
            if on_output is not None:
                on_output(index, out)
            o = outputs[index]
            o.pieces.append(out.text)
            o.completion_tokens, o.cached_tokens = out.completion_tokens, out.cached_tokens
            if out.finish_reason is not None:
                o.finish_reason, o.matched_stop = out.finish_reason, out.matched_stop
                o.embedding = out.embedding

    consumer = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        gone = not consumer.done()  # the client left (or this handler was cancelled)
        if gone:
            consumer.cancel()
            group.abort("client disconnected")
    if gone:
        return None
    consumer.result()  # re-raises a mid-generation error
    return outputs


def sse(payload: Any) -> str:
    """One server-sent event carrying a JSON payload (or the literal [DONE])."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"
