"""OpenAI's Responses API (`POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`, `GET
/v1/responses/{id}/input_items`): a request is served by the chat path as the chat request it
means (responses_input.py); its output comes back as output items (`reasoning`, `message`,
`function_call`), whole or as the Responses stream of events. Stored responses
(response_store.py) carry a conversation on: a continuation renders to the same tokens as
the turns before it, so the radix cache serves their KV."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from minisgl.utils import init_logger

from .chat_job import ChatJob, ChatPiece, ChatResult, chat_result, stream_events
from .generation import collect_outputs
from .response_store import ResponseStore
from .responses import APIError, now
from .responses_input import (
    ResponsesInput,
    assistant_turn,
    chat_request,
    invalid,
    item_id,
)
from .validation import parse_json

logger = init_logger(__name__)


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + completion_tokens,
    }


def reasoning_item(rid: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}]
    return {"id": rid, "type": "reasoning", "summary": [], "content": content, "status": status}


def message_item(mid: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"id": mid, "type": "message", "role": "assistant", "status": status, "content": [part]}


def call_item(call: dict[str, Any], arguments: str | None = None) -> dict[str, Any]:
    """A chat tool call as a function_call item (`arguments`: as far as streamed)."""
    function = call["function"]
    return {
        "id": "fc_" + call["id"].removeprefix("call_"),
        "type": "function_call",
        "call_id": call["id"],
        "name": function["name"],
        "arguments": function["arguments"] if arguments is None else arguments,
        "status": "completed" if arguments is None else "in_progress",
    }


@dataclass
class ResponseDraft:
    """A response's fixed fields (the request's settings echoed back) and its outcome."""

    request: dict[str, Any]
    model: str
    id: str = field(default_factory=lambda: item_id("resp"))
    created_at: int = field(default_factory=now)

    def body(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        finish: str | None = None,
    ) -> dict[str, Any]:
        req = self.request
        text = req.get("text") if isinstance(req.get("text"), dict) else {}
        reasoning = req.get("reasoning") if isinstance(req.get("reasoning"), dict) else {}
        incomplete = None
        if status == "incomplete":
            incomplete = {"reason": "max_output_tokens" if finish == "length" else None}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": req.get("instructions"),
            "max_output_tokens": req.get("max_output_tokens"),
            "model": self.model,
            "output": output,
            "parallel_tool_calls": req.get("parallel_tool_calls", True),
            "previous_response_id": req.get("previous_response_id"),
            "reasoning": {"effort": reasoning.get("effort"), "summary": None},
            "store": req.get("store", True),
            "temperature": req.get("temperature", 1.0),
            "text": {"format": text.get("format") or {"type": "text"}},
            "tool_choice": req.get("tool_choice", "auto"),
            "tools": req.get("tools") or [],
            "top_p": req.get("top_p", 1.0),
            "truncation": "disabled",
            "usage": usage,
            "user": req.get("user"),
            "metadata": req.get("metadata") or {},
        }

    def finished(self, job: ChatJob, out: Any, calls: bool, output: list[dict[str, Any]]) -> dict:
        """The whole body once `out` (a finished output: ChoiceOutput or the engine's last
        OutputMsg) ended, with tool calls or not."""
        status = "completed" if calls or out.finish_reason == "stop" else "incomplete"
        usage = usage_body(job.prompt_tokens, out.completion_tokens, out.cached_tokens)
        return self.body(status, output, usage, out.finish_reason)


def output_text(body: dict[str, Any]) -> str:
    """The text of a response's message items (the SDK's `output_text`)."""
    messages = (item for item in body["output"] if item["type"] == "message")
    return "".join(part["text"] for item in messages for part in item["content"])


def output_items(result: ChatResult) -> list[dict[str, Any]]:
    items = []
    if result.reasoning is not None:
        items.append(reasoning_item(item_id("rs"), result.reasoning, "completed"))
    if result.text or not result.calls:
        status = "completed" if result.output.finish_reason == "stop" else "incomplete"
        items.append(message_item(item_id("msg"), result.text, status))
    return items + [call_item(call) for call in result.calls]


class ResponseEvents:
    """The Responses stream of events of one output: an item opened as its kind of text
    starts (reasoning, then message), closed when another starts or the output ends."""

    def __init__(
        self,
        job: ChatJob | None = None,
        draft: ResponseDraft | None = None,
        save: Callable[[dict[str, Any], list], None] | None = None,
    ) -> None:
        self.job, self.draft, self.save = job, draft, save  # (None: item events alone)
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.open_text = ""

    def event(self, kind: str, **data: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.output) - 1}

    def _start(self, item: dict[str, Any], part: dict[str, Any]) -> str:
        events = self.close()
        self.output.append(item)
        self.open, self.open_text = item, ""
        index = len(self.output) - 1
        events += self.event("response.output_item.added", output_index=index, item=item)
        return events + self.event(
            "response.content_part.added", **self._where(), content_index=0, part=part
        )

    def _delta(self, kind: str, text: str) -> str:
        """`text` into the open item of `kind` (reasoning or message), opened if another is."""
        events = ""
        if self.open is None or self.open["type"] != kind:
            make = reasoning_item if kind == "reasoning" else message_item
            item = make(item_id("rs" if kind == "reasoning" else "msg"), "", "in_progress")
            part = item["content"][0]
            item["content"] = []  # the part comes in its own event
            events = self._start(item, part)
        self.open_text += text
        if kind == "reasoning":
            delta = self.event(
                "response.reasoning_text.delta", **self._where(), content_index=0, delta=text
            )
        else:
            delta = self.event(
                "response.output_text.delta",
                **self._where(),
                content_index=0,
                delta=text,
                logprobs=[],
            )
        return events + delta

    def reasoning(self, text: str) -> str:
        return self._delta("reasoning", text)

    def text(self, text: str) -> str:
        return self._delta("message", text)

    def close(self, status: str = "completed") -> str:
        """The open item's done events; it takes its finished form in `output`."""
        if self.open is None:
            return ""
        where, text = self._where(), self.open_text
        if self.open["type"] == "reasoning":
            done = reasoning_item(self.open["id"], text, status)
            events = self.event("response.reasoning_text.done", **where, content_index=0, text=text)
        else:
            done = message_item(self.open["id"], text, status)
            events = self.event(
                "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
            )
        events += self.event(
            "response.content_part.done", **where, content_index=0, part=done["content"][0]
        )
        self.output[-1], self.open = done, None
        index = where["output_index"]
        return events + self.event("response.output_item.done", output_index=index, item=done)

    def start(self) -> str:
        assert self.draft is not None
        events = self.event("response.created", response=self.draft.body("in_progress", []))
        return events + self.event(
            "response.in_progress", response=self.draft.body("in_progress", [])
        )

    def finish(self, piece: ChatPiece) -> str:
        """The open item closed, the calls' items, then the whole response."""
        out = piece.finished
        assert out is not None and self.job is not None and self.draft is not None
        events = ""
        if not piece.calls and not any(i["type"] == "message" for i in self.output):
            events += self.text("")  # a response without calls has a message, if empty
        events += self.close("completed" if out.finish_reason == "stop" else "incomplete")
        events += "".join(self.call(call) for call in piece.calls)
        body = self.draft.finished(self.job, out, bool(piece.calls), self.output)
        if self.save is not None:
            self.save(body, piece.calls)
        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
        return events + self.event(kind, response=body)

    def error(self, exc: APIError) -> str:
        return self.event("error", code=exc.code, message=exc.message, param=exc.param)

    def call(self, call: dict[str, Any]) -> str:
        events = self.close()
        index, item = len(self.output), call_item(call)
        self.output.append(item)
        events += self.event(
            "response.output_item.added", output_index=index, item=call_item(call, "")
        )
        where = {"item_id": item["id"], "output_index": index}
        arguments = item["arguments"]
        events += self.event("response.function_call_arguments.delta", **where, delta=arguments)
        events += self.event(
            "response.function_call_arguments.done", **where, arguments=arguments, name=item["name"]
        )
        return events + self.event("response.output_item.done", output_index=index, item=item)


def register_responses_routes(
    app: FastAPI, prepare: Callable[[Request, dict[str, Any]], Any], store: ResponseStore
) -> None:
    """Add the Responses routes (`prepare`: the chat path's start of a chat request body,
    giving a ChatJob)."""

    def stored(response_id: str) -> dict[str, Any]:
        record = store.get(response_id)
        if record is None:
            raise APIError(
                f"no response with id {response_id!r} (never stored, dropped or deleted)",
                status=404,
                param="response_id",
                code="not_found",
            )
        return record

    def save(draft: ResponseDraft, parsed: ResponsesInput, body: dict, calls: list) -> None:
        if not draft.request.get("store", True):
            return
        conversation = [*parsed.conversation, assistant_turn(output_text(body), calls)]
        store.put(draft.id, {"response": body, "conversation": conversation, "input": parsed.items})

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        """OpenAI's Responses API, whole or as the Responses events; stored unless `store` is false."""
        raw = parse_json(await request.body())
        previous = raw.get("previous_response_id") if isinstance(raw, dict) else None
        history = None
        if previous is not None:
            record = store.get(previous) if isinstance(previous, str) else None
            if record is None:
                raise invalid(
                    "previous_response_id",
                    f"previous response with id {previous!r} not found",
                    code="previous_response_not_found",
                )
            history = record["conversation"]
        parsed = chat_request(raw, history)
        job: ChatJob = await prepare(request, parsed.chat)
        draft = ResponseDraft(raw, job.model)
        if raw.get("stream"):
            writer = ResponseEvents(
                job, draft, lambda body, calls: save(draft, parsed, body, calls)
            )
            return StreamingResponse(stream_events(job, writer), media_type="text/event-stream")
        outputs = await collect_outputs(request, job.group)
        if outputs is None:
            return Response(status_code=499)
        result = chat_result(job, outputs[0])
        body = draft.finished(job, result.output, bool(result.calls), output_items(result))
        save(draft, parsed, body, result.calls)
        return JSONResponse(body)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> dict[str, Any]:
        """A stored response by id (404 if never stored, dropped or deleted)."""
        return stored(response_id)["response"]

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        """Delete a stored response."""
        stored(response_id)
        store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(response_id: str, order: str = "desc", limit: int = 20) -> dict:
        """A stored response's input items (`order`, `limit`)."""
        if order not in ("asc", "desc") or not 1 <= limit <= 100:
            raise invalid("order" if order not in ("asc", "desc") else "limit", "out of range")
        items = list(stored(response_id)["input"])
        items = (items if order == "asc" else items[::-1])[:limit]
        first, last = (items[0]["id"], items[-1]["id"]) if items else (None, None)
        return {
            "object": "list",
            "data": items,
            "first_id": first,
            "last_id": last,
            "has_more": False,
        }
