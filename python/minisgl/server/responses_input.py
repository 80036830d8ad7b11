"""A Responses API request (`POST /v1/responses`) as the chat request it means: input items
(messages, function calls and their outputs) as chat messages after the conversation a
`previous_response_id` continues, instructions as the system message, function tools,
`text.format` as the response format, `reasoning.effort` as the template's thinking switch."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from .chat_job import CHAT_EXTENSIONS
from .responses import APIError

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
# reasoning.effort values that mean no thinking (Qwen3's enable_thinking off)
NO_EFFORT = ("none", "minimal")


def invalid(param: str, message: str, code: str = "invalid_value", status: int = 400) -> APIError:
    return APIError(message, status=status, param=param, code=code)


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class ResponsesInput:
    """The chat request body, the conversation so far with this request's input (chat
    messages, no instructions: a continuation takes its own) and the input as items."""

    chat: dict[str, Any]
    conversation: list[dict[str, Any]]
    items: list[dict[str, Any]]


def _text(content: Any, where: str) -> str:
    """A string, or the text of a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(where, f"must be a string or a list of content parts, got {content!r}")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise invalid(f"{where}[{j}]", f"unsupported content part {kind!r} (text only)")
        texts.append(str(part.get("text", part.get("refusal", ""))))
    return "".join(texts)


def _message_item(role: str, text: str) -> dict[str, Any]:
    kind = "output_text" if role == "assistant" else "input_text"
    return {
        "id": item_id("msg"),
        "type": "message",
        "role": role,
        "status": "completed",
        "content": [{"type": kind, "text": text}],
    }


def input_messages(raw: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`input` as chat messages and as stored items (with ids)."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}], [_message_item("user", raw)]
    if not isinstance(raw, list) or not raw:
        raise invalid("input", "must be a string or a non-empty list of input items")
    messages: list[dict[str, Any]] = []
    items: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(where, f"must be an input item object, got {item!r}")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise invalid(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
            text = _text(item.get("content"), f"{where}.content")
            messages.append({"role": role, "content": text})
            items.append(_message_item(role, text))
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            arguments = item.get("arguments", "{}")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise invalid(where, "a function_call item needs a call_id and a name")
            if not isinstance(arguments, str):
                raise invalid(f"{where}.arguments", "must be a JSON string")
            call = {"id": call_id, "type": "function", "function": {"name": name}}
            call["function"]["arguments"] = arguments
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            items.append({**item, "id": item.get("id") or item_id("fc"), "status": "completed"})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise invalid(f"{where}.call_id", "a function_call_output item needs a call_id")
            output = _text(item.get("output", ""), f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
            items.append({**item, "id": item.get("id") or item_id("fco"), "status": "completed"})
        elif kind == "reasoning":
            continue  # earlier reasoning is not shown to the model again (as chat templates)
        else:
            raise invalid(f"{where}.type", f"unsupported input item type {kind!r}")
    return messages, items


def _tools(body: dict[str, Any]) -> dict[str, Any]:
    """Function tools, tool_choice and parallel_tool_calls as chat's."""
    out: dict[str, Any] = {}
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise invalid("tools", "must be a list of tools")
        functions = []
        for i, tool in enumerate(tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise invalid(f"tools[{i}].type", f"only function tools are served, got {kind!r}")
            if not isinstance(tool.get("name"), str):
                raise invalid(f"tools[{i}].name", "a function tool needs a name")
            function = {"name": tool["name"], "parameters": tool.get("parameters") or {}}
            if tool.get("description") is not None:
                function["description"] = tool["description"]
            functions.append({"type": "function", "function": function})
        out["tools"] = functions
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise invalid("tool_choice", f"must name a function tool, got {choice!r}")
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        out["tool_choice"] = choice
    if body.get("parallel_tool_calls") is not None:
        out["parallel_tool_calls"] = body["parallel_tool_calls"]
    return out


def _text_format(body: dict[str, Any]) -> dict[str, Any] | None:
    """`text.format` as chat's response_format (None: plain text)."""
    text = body.get("text")
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {"name": fmt.get("name", "response"), "schema": fmt.get("schema")}
        if fmt.get("strict") is not None:
            schema["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": schema}
    raise invalid("text.format.type", f"must be text, json_object or json_schema, got {kind!r}")


def _effort(body: dict[str, Any]) -> str | None:
    reasoning = body.get("reasoning")
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise invalid("reasoning", f"must be an object, got {reasoning!r}")
    effort = reasoning.get("effort")
    if effort is not None and effort not in (*NO_EFFORT, "low", "medium", "high", "xhigh"):
        raise invalid("reasoning.effort", f"must be none, minimal, low, medium or high: {effort!r}")
    return effort


# Fields passed to the chat request as they are.
PASSED = ("model", "temperature", "top_p", "stream", "user", "stop", *CHAT_EXTENSIONS)

UNSUPPORTED = {
    "background": "background responses are not served",
    "conversation": "conversations are not served; chain with previous_response_id",
    "prompt": "stored prompts are not served",
}


# OpenAI's bounds on a response's metadata: key-value pairs of strings.
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512


def _check_metadata(metadata: Any) -> None:
    """Metadata is echoed back in the response: an object of up to 16 string pairs."""
    if metadata is None:
        return
    if not isinstance(metadata, dict) or len(metadata) > METADATA_PAIRS:
        raise invalid("metadata", f"must be an object of at most {METADATA_PAIRS} pairs")
    for key, value in metadata.items():
        if len(key) > METADATA_KEY_CHARS or not isinstance(value, str):
            raise invalid(
                "metadata",
                f"key {key[:80]!r}: keys up to {METADATA_KEY_CHARS} characters, values strings",
            )
        if len(value) > METADATA_VALUE_CHARS:
            raise invalid(
                "metadata", f"value of {key!r}: at most {METADATA_VALUE_CHARS} characters"
            )


def chat_request(body: Any, history: list[dict[str, Any]] | None) -> ResponsesInput:
    """The chat request a Responses request means; `history`: the stored conversation its
    previous_response_id continues."""
    if not isinstance(body, dict):
        raise invalid("body", "must be a JSON object")
    for name, why in UNSUPPORTED.items():
        if body.get(name):
            raise invalid(name, why, code="unsupported_parameter")
    if "input" not in body:
        raise invalid("input", "is required", code="missing_required_parameter")
    for flag in ("store", "stream"):
        if body.get(flag) is not None and not isinstance(body[flag], bool):
            raise invalid(flag, f"must be a boolean, got {body[flag]!r}")
    _check_metadata(body.get("metadata"))
    messages, items = input_messages(body["input"])
    conversation = [*(history or []), *messages]
    chat: dict[str, Any] = {"messages": list(conversation)}
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid("instructions", "must be a string")
        chat["messages"].insert(0, {"role": "system", "content": instructions})
    for name in PASSED:
        if body.get(name) is not None:
            chat[name] = body[name]
    limit = body.get("max_output_tokens")
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise invalid("max_output_tokens", f"must be an integer >= 1, got {limit!r}")
        chat["max_tokens"] = limit
    response_format = _text_format(body)
    if response_format is not None:
        chat["response_format"] = response_format
    kwargs: dict[str, Any] = {}
    effort = _effort(body)
    if effort is not None:
        kwargs = {"enable_thinking": effort not in NO_EFFORT, "reasoning_effort": effort}
    given = body.get("chat_template_kwargs")
    if given is not None:
        if not isinstance(given, dict):
            raise invalid("chat_template_kwargs", "must be an object")
        kwargs.update(given)  # what the client names outright wins
    if kwargs:
        chat["chat_template_kwargs"] = kwargs
    chat.update(_tools(body))
    return ResponsesInput(chat, conversation, items)


def assistant_turn(text: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat message an output adds to the conversation (its reasoning left out, as chat
    templates leave out earlier turns' thinking)."""
    turn: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        turn["tool_calls"] = [
            {"id": c["id"], "type": "function", "function": dict(c["function"])} for c in calls
        ]
    return turn
