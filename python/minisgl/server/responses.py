"""OpenAI response bodies: errors, completions and their streamed (SSE) chunks."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse


class APIError(Exception):
    """An error returned to the client as `{"error": {message, type, param, code}}`."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass
class ResponseFormatter:
    """Shapes one request's output as OpenAI chat or text completions (JSON or SSE)."""

    chat: bool
    id: str
    model: str
    created: int
    n: int  # samples per prompt

    def __post_init__(self) -> None:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        # What every streamed chunk starts with.
        self._head = {"id": self.id, "object": obj, "created": self.created, "model": self.model}
        # The chunk of almost every streamed token (one choice's new text, nothing else) is
        # this head, the index, the text as a JSON string and a fixed tail, not a dict dumped
        # whole: the API server's CPU per streamed token went from 42-49 to 32-34 us.
        self._text_head = "data: " + json.dumps(self._head, ensure_ascii=False)[:-1]
        self._text_head += ', "choices": '
        self._text_key = '"delta": {"content": ' if self.chat else '"text": '
        close_delta = "}" if self.chat else ""
        self._text_tail = close_delta + ', "logprobs": null, "finish_reason": null}]}\n\n'

    def chunk(
        self,
        index: int,
        text: str | None,
        finish: str | None,
        role: bool = False,
        logprobs: dict[str, Any] | None = None,
        prompt_logprobs: list[Any] | None = None,
        usage_body: dict[str, Any] | None = None,
        reasoning: str | None = None,
    ) -> str:
        """One SSE event: a choice's new text (with its tokens' logprobs where asked), its role
        (chat's first event) or its finish; with `usage_body`, the usage so far too (vLLM's
        continuous_usage_stats); `reasoning`: new thinking, as delta.reasoning_content."""
        plain = logprobs is None and prompt_logprobs is None and usage_body is None
        plain = plain and not reasoning
        if text and finish is None and not role and plain:
            return (
                f'{self._text_head}[{{"index": {index}, {self._text_key}'
                f"{json.dumps(text, ensure_ascii=False)}{self._text_tail}"
            )
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            if reasoning:
                delta["reasoning_content"] = reasoning
            choice: dict[str, Any] = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": text or ""}
        choice.update(logprobs=logprobs, finish_reason=finish)
        if prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs
        if usage_body is not None:
            return self._sse({"choices": [choice], "usage": usage_body})
        return self._sse({"choices": [choice]})

    def _sse(self, payload: dict[str, Any]) -> str:
        return f"data: {json.dumps(self._head | payload, ensure_ascii=False)}\n\n"

    def usage_chunk(self, usage_body: dict[str, Any]) -> str:
        return self._sse({"choices": [], "usage": usage_body})

    def tool_calls_chunk(self, index: int, calls: list[dict[str, Any]]) -> str:
        """One SSE event with a choice's tool calls, each whole (as a first delta carries)."""
        deltas = [{"index": k, **call} for k, call in enumerate(calls)]
        choice = {"index": index, "delta": {"tool_calls": deltas}}
        return self._sse({"choices": [choice | {"logprobs": None, "finish_reason": None}]})

    def response(
        self,
        texts: list[str | None],
        finish: list[str | None],
        usage_body: dict[str, Any],
        logprobs: list[tuple[dict[str, Any], Any]] | None = None,
        tool_calls: list[list[dict[str, Any]]] | None = None,
        reasoning: list[str | None] | None = None,
    ) -> dict[str, Any]:
        """The whole completion; logprobs: each choice's (`logprobs`, `prompt_logprobs` or
        None) where the request asked for them; tool_calls: each chat choice's calls;
        reasoning: each chat choice's thinking (a reasoning parser's reasoning_content)."""
        choices = []
        for i, (text, reason) in enumerate(zip(texts, finish)):
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if reasoning is not None:
                    message["reasoning_content"] = reasoning[i]
                if tool_calls is not None and tool_calls[i]:
                    message["tool_calls"] = tool_calls[i]
                choice: dict[str, Any] = {"index": i, "message": message}
            else:
                choice = {"index": i, "text": text}
            body, prompt_body = logprobs[i] if logprobs is not None else (None, None)
            choice.update(logprobs=body, finish_reason=reason)
            if prompt_body is not None:
                choice["prompt_logprobs"] = prompt_body
            choices.append(choice)
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage_body,
        }


def total_usage(
    prompt_tokens: list[int], n: int, completion: list[int], cached: list[int]
) -> dict[str, Any]:
    """Usage over all choices (choice i is sample i % n of prompt i // n)."""
    # Each prompt is counted once however many samples (n) it has, as OpenAI bills it.
    firsts = range(0, len(prompt_tokens), n)
    return usage(
        sum(prompt_tokens[i] for i in firsts),
        sum(completion),
        sum(cached[i] for i in firsts),
    )
