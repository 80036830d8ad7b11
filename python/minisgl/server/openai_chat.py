"""Serving a chat completion or completion request's sub-requests (prompts x n): whole, or
streamed as OpenAI's chunks, with logprobs, echo, tool calls and a reasoning split."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from minisgl.core import SamplingParams
from minisgl.message import TokenizeMsg
from minisgl.utils import init_logger

from .frontend import RequestGroup
from .generation import collect_outputs, start_group
from .logprobs import ChoiceLogprobs
from .protocol import GenerateRequest
from .reasoning import ReasoningStream, split_reasoning
from .responses import APIError, ResponseFormatter, total_usage, usage
from .sampling import sample_seed
from .state import ServerState
from .tools import ToolCalls

logger = init_logger(__name__)


async def serve(
    state: ServerState,
    request: Request,
    req: GenerateRequest,
    endpoint: ResponseFormatter,
    prompts: list[dict[str, Any]],
    sp: SamplingParams,
    param_names: dict[str, str],
    logprobs: ChoiceLogprobs | None = None,
    echo: list[str | None] | None = None,
    calls: ToolCalls | None = None,
    thinking: bool | None = None,
) -> Response:
    """Run the request's prompts x n; logprobs: where asked, their bodies per choice;
    echo: per prompt its text (None: the detokenizer's decode) put before the output;
    calls: where tools are on, how the output becomes tool calls; thinking: where a
    reasoning parser splits the output, whether it starts thinking (reasoning.py)."""
    text_options = {
        "skip_special_tokens": req.skip_special_tokens,
        "spaces_between_special_tokens": req.spaces_between_special_tokens,
    }
    msgs = []
    for prompt in prompts:
        for j in range(req.n):
            sp_j = sp if j == 0 else dataclasses.replace(sp, seed=sample_seed(sp.seed, j))
            rid = state.frontend.new_rid()
            msgs.append(TokenizeMsg(rid, sp_j, **prompt, **text_options))
    group = await start_group(state.frontend, msgs, param_names)
    prefixes: list[str | None] | None = None
    if echo is not None:
        prefixes = [echo[i // req.n] or group.prompt_texts[i] or "" for i in range(len(group.rids))]
    if req.stream:
        include_usage, continuous = req.usage_options
        thoughts = None
        if thinking is not None:
            thoughts = [ReasoningStream(thinking) for _ in group.rids]
        return StreamingResponse(
            stream(group, endpoint, include_usage, continuous, logprobs, prefixes, calls, thoughts),
            media_type="text/event-stream",
        )
    return await collect(request, group, endpoint, logprobs, prefixes, calls, thinking)


async def stream(
    group: RequestGroup,
    endpoint: ResponseFormatter,
    include_usage: bool,
    continuous: bool,
    logprobs: ChoiceLogprobs | None,
    prefixes: list[str | None] | None,
    calls: ToolCalls | None,
    thoughts: list[ReasoningStream] | None = None,
) -> AsyncIterator[str]:
    k = len(group.rids)
    completion, cached = [0] * k, [0] * k

    def so_far(i: int) -> dict[str, Any] | None:
        # Continuous usage: this choice's tokens so far and its prompt's (as vLLM).
        return usage(group.prompt_tokens[i], completion[i], cached[i]) if continuous else None

    try:
        if endpoint.chat:
            for i in range(k):
                yield endpoint.chunk(i, None, None, role=True, usage_body=so_far(i))
        async for i, out in group.outputs():
            completion[i], cached[i] = out.completion_tokens, out.cached_tokens
            text = out.text
            if prefixes is not None:  # echo: the prompt's text comes first
                text, prefixes[i] = (prefixes[i] or "") + text, None
            body, prompt_body = logprobs.piece(i, out) if logprobs else (None, None)
            thought = ""
            if thoughts is not None:  # thinking goes out as reasoning_content
                thought, text = thoughts[i].piece(text, out.finish_reason is not None)
            if calls is not None:  # content goes out until a call may be starting
                text = calls.feed(i, text)
            if text or thought or body is not None or prompt_body is not None:
                yield endpoint.chunk(
                    i, text, None, False, body, prompt_body, so_far(i), thought or None
                )
            if calls is not None and out.finish_reason is not None:
                content, found = calls.finish(i)
                if content:
                    yield endpoint.chunk(i, content, None, usage_body=so_far(i))
                if found:
                    yield endpoint.tool_calls_chunk(i, found)
                    out.finish_reason = "tool_calls"
            if out.finish_reason is not None:  # the reason comes on a chunk of its own
                yield endpoint.chunk(i, None, out.finish_reason, usage_body=so_far(i))
        if include_usage:
            yield endpoint.usage_chunk(
                total_usage(group.prompt_tokens, endpoint.n, completion, cached)
            )
        yield "data: [DONE]\n\n"
    except Exception as exc:  # headers are sent already: report in the stream
        if not isinstance(exc, APIError):
            logger.exception("streaming a response failed")
            exc = APIError(f"internal error: {exc}", status=500, type="server_error")
        yield f"data: {json.dumps(exc.body())}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        # Runs on normal end (nothing left to abort) and when the client went away
        # (the response task is cancelled): stop generating for nobody.
        group.abort("client disconnected mid-stream")


async def collect(
    request: Request,
    group: RequestGroup,
    endpoint: ResponseFormatter,
    logprobs: ChoiceLogprobs | None,
    prefixes: list[str | None] | None,
    calls: ToolCalls | None,
    thinking: bool | None = None,
) -> Response:
    outputs = await collect_outputs(request, group, logprobs.piece if logprobs else None)
    if outputs is None:
        return Response(status_code=499)  # nobody is listening
    completion = [o.completion_tokens for o in outputs]
    cached = [o.cached_tokens for o in outputs]
    texts: list[str | None] = [o.text for o in outputs]
    finish = [o.finish_reason for o in outputs]
    if prefixes is not None:
        texts = [(prefix or "") + (text or "") for prefix, text in zip(prefixes, texts)]
    reasoning = None
    if thinking is not None:
        split = [split_reasoning(text or "", thinking) for text in texts]
        reasoning, texts = [r for r, _ in split], [t for _, t in split]
    found = None
    if calls is not None:
        found = []
        for i in range(len(outputs)):
            calls.texts[i].append(texts[i] or "")
            texts[i], choice_calls = calls.parse(i)
            found.append(choice_calls)
            if choice_calls:
                finish[i] = "tool_calls"
    body = endpoint.response(
        texts,
        finish,
        total_usage(group.prompt_tokens, endpoint.n, completion, cached),
        None if logprobs is None else [logprobs.whole(i) for i in range(len(outputs))],
        found,
        reasoning,
    )
    return JSONResponse(body)
