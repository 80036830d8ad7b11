"""Tool calling: a chat request's `tools` / `tool_choice` checked, the model's output parsed into
OpenAI `tool_calls` (Hermes / Qwen `<tool_call>{...}</tool_call>` blocks, Llama-3's bare JSON),
and `required` or a named function enforced with a JSON-schema constraint (as vLLM does: the
model then writes the calls as JSON, which become the message's tool_calls)."""

from __future__ import annotations

import json
import os
import re
import uuid
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from minisgl.core import StructuredOutput

from .responses import APIError

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


# Outputs are read leniently: a grammar's JSON strings may hold raw control characters (a
# sampled U+001E, say), which strict JSON refuses; call_dict writes the arguments back strict.
_DECODER = json.JSONDecoder(strict=False)


def _invalid(param: str, message: str) -> APIError:
    return APIError(f"{param}: {message}", param=param, code="invalid_value")


@dataclass
class ToolChoice:
    """What the request asks of its tools: `mode` auto | none | required | named (`name`)."""

    tools: list[dict[str, Any]]
    mode: str
    name: str | None = None
    parallel: bool = True  # parallel_tool_calls: several calls in one turn

    @property
    def active(self) -> bool:
        """Whether the output is parsed for calls (tools given and not turned off)."""
        return bool(self.tools) and self.mode != "none"

    def constraint(self) -> StructuredOutput | None:
        """The JSON schema `required` and a named choice hold the output to."""
        if self.mode == "named":
            return StructuredOutput("json", json.dumps(_parameters(self._tool(self.name))))
        if self.mode != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": tool["function"]["name"]},
                    "parameters": _parameters(tool),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for tool in self.tools
        ]
        # At most one call per tool (one without parallel calls) keeps the array bounded.
        most = len(self.tools) if self.parallel else 1
        schema = {"type": "array", "minItems": 1, "maxItems": most, "items": {"anyOf": calls}}
        return StructuredOutput("json", json.dumps(schema))

    def _tool(self, name: str | None) -> dict[str, Any]:
        return next(t for t in self.tools if t["function"]["name"] == name)


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool["function"].get("parameters")
    return params if isinstance(params, dict) else {"type": "object", "properties": {}}


def check_tools(tools: Any, tool_choice: Any, parallel: bool | None = None) -> ToolChoice:
    """The request's tools and choice, checked (a 400 naming `tools` / `tool_choice`)."""
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise _invalid("tools", "must be a list of function tools")
    names = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise _invalid("tools", f"tools[{i}] must be a function tool object, got {tool!r}")
        function = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise _invalid("tools", f"tools[{i}] must be {{'type': 'function', 'function': ...}}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise _invalid("tools", f"tools[{i}].function.name must be a non-empty string")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise _invalid("tools", f"tools[{i}].function.parameters must be a JSON schema")
        names.append(name)
    if tool_choice is None:
        return ToolChoice(tools, "auto" if tools else "none", None, parallel is not False)
    if isinstance(tool_choice, str):
        if tool_choice not in ("auto", "none", "required"):
            raise _invalid("tool_choice", f"{tool_choice!r} is not auto, none or required")
        if tool_choice == "required" and not tools:
            raise _invalid("tool_choice", "'required' needs tools")
        return ToolChoice(tools, tool_choice, None, parallel is not False)
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if name not in names:
        raise _invalid("tool_choice", f"names no function among the tools ({names})")
    return ToolChoice(tools, "named", name, parallel is not False)


def template_tools(choice: ToolChoice) -> list[dict[str, Any]] | None:
    """What the chat template renders: the tools, also with tool_choice 'none' (as vLLM: the
    model still knows them; its output is just not read for calls)."""
    return choice.tools or None


def call_dict(name: str, arguments: Any) -> dict[str, Any]:
    """One OpenAI tool call: an id, the function's name, its arguments as a JSON string."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": text},
    }


def parse_tool_calls(
    text: str, choice: ToolChoice, parser: str
) -> tuple[str | None, list[dict[str, Any]]]:
    """(the message's content, its tool calls) from the model's output text."""
    if choice.mode == "named":
        try:  # re-spelled as strict JSON (see _DECODER), where it parses
            arguments: Any = _DECODER.decode(text.strip())
        except json.JSONDecodeError:
            arguments = text.strip()
        return None, [call_dict(choice.name or "", arguments)]
    if choice.mode == "required":
        calls = _complete_items(text)
        if not calls:
            return text, []  # cut short (max_tokens) before the first call was whole
        return None, [call_dict(c["name"], c.get("parameters", {})) for c in calls]
    parse = _parse_hermes if parser == "hermes" else _parse_llama3_json
    return parse(text, {t["function"]["name"] for t in choice.tools})


def _complete_items(text: str) -> list[Any]:
    """The whole items of a JSON array, also when the text was cut off after some of them."""
    decoder, items, pos = _DECODER, [], text.find("[") + 1
    while 0 < pos < len(text):
        # raw_decode takes no leading whitespace, which a grammar lets a sampled array have
        # (after "[" and around commas: JSON's four whitespace characters).
        while pos < len(text) and text[pos] in " \t\n\r":
            pos += 1
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break
        items.append(item)
        while pos < len(text) and text[pos] in " \t\n\r,":
            pos += 1
        if pos < len(text) and text[pos] == "]":
            break
    return items


def _call_of(obj: Any, names: set[str]) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    return call_dict(obj["name"], obj.get("arguments", obj.get("parameters", {})))


def _parse_hermes(text: str, names: set[str]) -> tuple[str | None, list[dict[str, Any]]]:
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    for block in _HERMES_CALL.findall(text[start:]):
        try:
            call = _call_of(_DECODER.decode(block), names)
        except json.JSONDecodeError:
            call = None
        if call is not None:
            calls.append(call)
    if not calls:
        return text, []
    content = text[:start].strip()
    return content or None, calls


def _parse_llama3_json(text: str, names: set[str]) -> tuple[str | None, list[dict[str, Any]]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls = []
    for part in body.split(";"):  # Llama 3 separates parallel calls with ';'
        try:
            call = _call_of(_DECODER.decode(part), names)
        except json.JSONDecodeError:
            return text, []
        if call is None:
            return text, []
        calls.append(call)
    return None, calls


def tool_parser_for(choice: str, model_path: str | os.PathLike) -> str:
    """--tool-call-parser: the given parser, or (auto) the one the model's template teaches."""
    if choice != "auto":
        return choice
    from minisgl.tokenizer.tokenize import read_chat_template

    return detect_parser(read_chat_template(model_path))


def detect_parser(chat_template: str | None) -> str:
    """The output format a chat template teaches: Llama 3's python tag or bare JSON, else
    Hermes / Qwen `<tool_call>` blocks."""
    if (
        chat_template
        and "<tool_call>" not in chat_template
        and ("<|python_tag|>" in chat_template or "ipython" in chat_template)
    ):
        return "llama3_json"
    return "hermes"


HERMES_OPEN = "<tool_call>"


class ToolCalls:
    """One request's choices read for tool calls. Streamed, a choice's text goes out as it
    comes until a call may be starting (Hermes: a possible `<tool_call>` prefix is held back;
    Llama 3 JSON: an output that opens with `{` or `<`; forced choices: everything), and the
    calls are read once the text is whole."""

    def __init__(self, choice: ToolChoice, parser: str) -> None:
        self.choice, self.parser = choice, parser
        self.texts: defaultdict[int, list[str]] = defaultdict(list)
        self._sent: defaultdict[int, int] = defaultdict(int)  # characters streamed as content

    def feed(self, index: int, text: str) -> str:
        """Take a streamed piece; return the content that can go out now."""
        self.texts[index].append(text)
        whole = "".join(self.texts[index])
        sent = self._sent[index]
        safe = self._safe_length(whole)
        if safe <= sent:
            return ""
        self._sent[index] = safe
        return whole[sent:safe]

    def _safe_length(self, whole: str) -> int:
        """How much of the text so far is content for sure."""
        if self.choice.mode != "auto":
            return 0
        if self.parser == "llama3_json":
            head = whole.lstrip()
            return 0 if not head or head[0] in "{<" else len(whole)
        opened = whole.find(HERMES_OPEN)
        if opened >= 0:
            return opened
        for keep in range(min(len(HERMES_OPEN) - 1, len(whole)), 0, -1):
            if HERMES_OPEN.startswith(whole[-keep:]):  # the tag may be arriving in pieces
                return len(whole) - keep
        return len(whole)

    def finish(self, index: int) -> tuple[str, list[dict[str, Any]]]:
        """At a streamed choice's end: (the content not yet sent, its calls)."""
        sent = self._sent.pop(index, 0)
        content, calls = self.parse(index)
        if not calls:
            return (content or "")[sent:], []
        # Content before the calls was sent already, as far as it went.
        return (content or "")[sent:].rstrip() if content else "", calls

    def parse(self, index: int) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, calls) of a finished choice's text."""
        return parse_tool_calls("".join(self.texts.pop(index, [])), self.choice, self.parser)
