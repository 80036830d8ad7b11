"""Tool calling: a chat request's `tools` / `tool_choice` checked, the model's output parsed into
OpenAI `tool_calls` (Hermes / Qwen `<tool_call>{...}</tool_call>` blocks, Llama-3's bare JSON),
and `required` or a named function enforced with a JSON-schema constraint (as vLLM does: the
model then writes the calls as JSON, which become the message's tool_calls)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from minisgl.core import StructuredOutput

from .responses import APIError

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _invalid(param: str, message: str) -> APIError:
    return APIError(f"{param}: {message}", param=param, code="invalid_value")


@dataclass
class ToolChoice:
    """What the request asks of its tools: `mode` auto | none | required | named (`name`)."""

    tools: list[dict[str, Any]]
    mode: str
    name: str | None = None

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
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        return StructuredOutput("json", json.dumps(schema))

    def _tool(self, name: str | None) -> dict[str, Any]:
        return next(t for t in self.tools if t["function"]["name"] == name)


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool["function"].get("parameters")
    return params if isinstance(params, dict) else {"type": "object", "properties": {}}


def check_tools(tools: Any, tool_choice: Any) -> ToolChoice:
    """The request's tools and choice, checked (a 400 naming `tools` / `tool_choice`)."""
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise _invalid("tools", "must be a list of function tools")
    names = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise _invalid("tools", f"tools[{i}] must be {{'type': 'function', 'function': ...}}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise _invalid("tools", f"tools[{i}].function.name must be a non-empty string")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise _invalid("tools", f"tools[{i}].function.parameters must be a JSON schema")
        names.append(name)
    if tool_choice is None:
        return ToolChoice(tools, "auto" if tools else "none")
    if isinstance(tool_choice, str):
        if tool_choice not in ("auto", "none", "required"):
            raise _invalid("tool_choice", f"{tool_choice!r} is not auto, none or required")
        if tool_choice == "required" and not tools:
            raise _invalid("tool_choice", "'required' needs tools")
        return ToolChoice(tools, tool_choice)
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if name not in names:
        raise _invalid("tool_choice", f"names no function among the tools ({names})")
    return ToolChoice(tools, "named", name)


def template_tools(choice: ToolChoice) -> list[dict[str, Any]] | None:
    """What the chat template renders: the tools, unless turned off ('none')."""
    return choice.tools if choice.active else None


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
        return None, [call_dict(choice.name or "", text.strip())]
    if choice.mode == "required":
        try:
            calls = json.loads(text)
        except json.JSONDecodeError:
            return text, []  # cut short (max_tokens): no valid call to report
        return None, [call_dict(c["name"], c.get("parameters", {})) for c in calls]
    parse = _parse_hermes if parser == "hermes" else _parse_llama3_json
    return parse(text, {t["function"]["name"] for t in choice.tools})


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
            call = _call_of(json.loads(block), names)
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
            call = _call_of(json.loads(part), names)
        except json.JSONDecodeError:
            return text, []
        if call is None:
            return text, []
        calls.append(call)
    return None, calls


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
