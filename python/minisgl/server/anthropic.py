"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`): a request is
translated into the chat request it means (system, content blocks, tools, tool_choice,
thinking) and served by the chat path; its output comes back as content blocks (`thinking`,
`text`, `tool_use`), whole or as Anthropic's stream of events; errors in Anthropic's shape."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .chat_job import CHAT_EXTENSIONS, ChatJob, ChatPiece, chat_result, stream_events
from .generation import collect_outputs
from .responses import APIError
from .validation import parse_json

TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


def anthropic_error(exc: APIError) -> JSONResponse:
    """Anthropic's error body for an APIError: `{"type": "error", "error": {type, message}}`."""
    kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
        exc.status, "api_error" if exc.status >= 500 else "invalid_request_error"
    )
    message = exc.message if exc.param is None else f"{exc.param}: {exc.message}"
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return JSONResponse(body, status_code=exc.status)


def _invalid(param: str, message: str) -> APIError:
    return APIError(message, param=param, code="invalid_value")


def _text(content: Any, where: str) -> str:
    """A string, or the text of a list of text blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid(where, "must be a string or a list of content blocks")
    parts = []
    for i, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise _invalid(f"{where}[{i}]", "only text blocks are supported here")
        parts.append(str(block.get("text", "")))
    return "".join(parts)


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation as chat messages: the system prompt, then each turn's blocks (tool
    results as tool messages, tool uses as the assistant's calls)."""
    out: list[dict[str, Any]] = []
    if body.get("system") is not None:
        out.append({"role": "system", "content": _text(body["system"], "system")})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _invalid("messages", "must be a non-empty list of messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise _invalid(f"{where}.role", f"must be 'user' or 'assistant', got {role!r}")
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise _invalid(f"{where}.content", "must be a string or a list of content blocks")
        text, calls = [], []
        for j, block in enumerate(blocks):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                text.append(str(block.get("text", "")))
            elif kind == "tool_use" and role == "assistant":
                arguments = json.dumps(block.get("input", {}))
                function = {"name": block.get("name"), "arguments": arguments}
                calls.append({"id": block.get("id"), "type": "function", "function": function})
            elif kind == "tool_result" and role == "user":
                result = _text(block.get("content", ""), f"{where}.content[{j}].content")
                out.append(
                    {"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": result}
                )
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # earlier thinking is not shown to the model again (as Anthropic's)
            else:
                raise _invalid(f"{where}.content[{j}]", f"unsupported content block {kind!r}")
        if text or calls or role == "assistant":
            turn: dict[str, Any] = {"role": role, "content": "".join(text) or None}
            if calls:
                turn["tool_calls"] = calls
            out.append(turn)
    return out


def _tools(body: dict[str, Any]) -> dict[str, Any]:
    """tools and tool_choice as chat's."""
    tools = body.get("tools")
    if tools is None:
        return {}
    if not isinstance(tools, list):
        raise _invalid("tools", "must be a list of tools")
    functions = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise _invalid(f"tools[{i}]", "a tool needs a name (and an input_schema)")
        function = {"name": tool["name"], "parameters": tool.get("input_schema") or {}}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        functions.append({"type": "function", "function": function})
    out: dict[str, Any] = {"tools": functions}
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind == "tool":
            out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        elif kind in TOOL_CHOICES:
            out["tool_choice"] = TOOL_CHOICES[kind]
        else:
            raise _invalid("tool_choice.type", f"must be auto, any, tool or none, got {kind!r}")
        if choice.get("disable_parallel_tool_use"):
            out["parallel_tool_calls"] = False
    return out


def chat_body(body: Any) -> dict[str, Any]:
    """The chat completion request a Messages request means (max_tokens required, as
    Anthropic's; `thinking` turns the template's enable_thinking on or off)."""
    if not isinstance(body, dict):
        raise _invalid("body", "must be a JSON object")
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise _invalid("max_tokens", f"is required, an integer >= 1; got {max_tokens!r}")
    chat: dict[str, Any] = {"messages": _messages(body), "max_tokens": max_tokens}
    for name in ("model", "temperature", "top_p", "stream", *CHAT_EXTENSIONS):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled"):
            raise _invalid("thinking.type", f"must be enabled or disabled, got {kind!r}")
        chat["chat_template_kwargs"] = {"enable_thinking": kind == "enabled"}
    given = body.get("chat_template_kwargs")
    if given is not None:
        if not isinstance(given, dict):
            raise _invalid("chat_template_kwargs", "must be an object")
        chat["chat_template_kwargs"] = {**chat.get("chat_template_kwargs", {}), **given}
    chat.update(_tools(body))
    return chat


def stop_reason(finish: str | None, matched: str | int | None, calls: bool) -> tuple[str, Any]:
    """(stop_reason, stop_sequence) of a finished output."""
    if calls:
        return "tool_use", None
    if finish == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return STOP_REASONS.get(finish or "", "end_turn"), None


def tool_use_blocks(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat tool calls as tool_use blocks (their arguments as objects)."""
    blocks = []
    for call in calls:
        arguments = call["function"]["arguments"]
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = {"arguments": arguments}
        block_id = "toolu_" + call["id"].removeprefix("call_")
        blocks.append(
            {"type": "tool_use", "id": block_id, "name": call["function"]["name"], "input": parsed}
        )
    return blocks


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, int]:
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "output_tokens": completion_tokens,
        "cache_read_input_tokens": cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class MessageStream:
    """Anthropic's events for one streamed output: content blocks opened as their kind of
    text starts, closed when another starts or the message ends."""

    def __init__(self, job: ChatJob, message_id: str) -> None:
        self.job, self.message_id, self.index, self.open = job, message_id, -1, None

    def start(self) -> str:
        message = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.job.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage_body(self.job.prompt_tokens, 0, 0),
        }
        return _event("message_start", {"message": message})

    def _switch(self, kind: str, block: dict[str, Any]) -> str:
        events = self.close()
        self.index, self.open = self.index + 1, kind
        return events + _event("content_block_start", {"index": self.index, "content_block": block})

    def close(self) -> str:
        if self.open is None:
            return ""
        self.open = None
        return _event("content_block_stop", {"index": self.index})

    def reasoning(self, text: str) -> str:
        events = (
            ""
            if self.open == "thinking"
            else self._switch("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        )
        delta = {"type": "thinking_delta", "thinking": text}
        return events + _event("content_block_delta", {"index": self.index, "delta": delta})

    def text(self, text: str) -> str:
        events = "" if self.open == "text" else self._switch("text", {"type": "text", "text": ""})
        delta = {"type": "text_delta", "text": text}
        return events + _event("content_block_delta", {"index": self.index, "delta": delta})

    def tool_use(self, block: dict[str, Any]) -> str:
        events = self._switch("tool_use", {**block, "input": {}})
        delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        return events + _event("content_block_delta", {"index": self.index, "delta": delta})

    def finish(self, piece: ChatPiece) -> str:
        """The calls' blocks, then the stop reason and the message's end."""
        out = piece.finished
        assert out is not None
        events = "".join(self.tool_use(block) for block in tool_use_blocks(piece.calls))
        events += self.close()
        reason, sequence = stop_reason(out.finish_reason, out.matched_stop, bool(piece.calls))
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        usage = {"output_tokens": out.completion_tokens}
        events += _event("message_delta", {"delta": delta, "usage": usage})
        return events + _event("message_stop", {})

    def error(self, exc: APIError) -> str:
        body = json.loads(anthropic_error(exc).body)
        return f"event: error\ndata: {json.dumps(body)}\n\n"


def register_anthropic_routes(
    app: FastAPI,
    prepare: Callable[[Request, dict[str, Any]], Any],
    count_tokens: Callable[[dict[str, Any]], Any],
) -> None:
    """Add /v1/messages (`prepare`: the chat path's start of a chat request body, giving a
    ChatJob) and /v1/messages/count_tokens (`count_tokens`: a chat body's prompt tokens)."""

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        """Anthropic's Messages API, whole or as Anthropic's events."""
        body = chat_body(parse_json(await request.body()))
        job: ChatJob = await prepare(request, body)
        message_id = f"msg_{uuid.uuid4().hex[:24]}"  # Anthropic's form of an id
        if body.get("stream"):
            events = stream_events(job, MessageStream(job, message_id))
            return StreamingResponse(events, media_type="text/event-stream")
        outputs = await collect_outputs(request, job.group)
        if outputs is None:
            return Response(status_code=499)
        result = chat_result(job, outputs[0])
        out, calls = result.output, result.calls
        blocks: list[dict[str, Any]] = []
        if result.reasoning is not None:
            blocks.append({"type": "thinking", "thinking": result.reasoning, "signature": ""})
        if result.text:
            blocks.append({"type": "text", "text": result.text})
        blocks += tool_use_blocks(calls)
        reason, sequence = stop_reason(out.finish_reason, out.matched_stop, bool(calls))
        return JSONResponse(
            {
                "id": message_id,
                "type": "message",
                "role": "assistant",
                "model": job.model,
                "content": blocks,
                "stop_reason": reason,
                "stop_sequence": sequence,
                "usage": usage_body(job.prompt_tokens, out.completion_tokens, out.cached_tokens),
            }
        )

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(request: Request) -> Response:
        """Anthropic's token count of a Messages request's prompt."""
        raw = parse_json(await request.body())
        if isinstance(raw, dict):
            raw = {**raw, "max_tokens": raw.get("max_tokens", 1)}  # not needed to count
        body = chat_body(raw)
        return JSONResponse({"input_tokens": await count_tokens(body)})
