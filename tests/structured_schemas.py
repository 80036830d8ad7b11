"""JSON schemas for the structured-output tests: nested objects, arrays, enums, numbers,
required and optional fields."""

from __future__ import annotations

from typing import Any

NAME = {"type": "string", "minLength": 1, "maxLength": 24}
# A bounded integer: an unbounded one sampled at temperature 1 can run on to max_tokens.
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
ROW = {"type": "array", "items": DIGIT, "minItems": 1, "maxItems": 3}


def _object(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


SCHEMAS: list[dict[str, Any]] = [
    _object({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 130}}),
    _object({"city": NAME, "population": {"type": "integer", "minimum": 0}}),
    _object({"answer": {"type": "boolean"}}),
    _object({"color": {"enum": ["red", "green", "blue"]}}),
    _object({"temperature": {"type": "number", "minimum": -50, "maximum": 60}}),
    _object({"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}}),
    _object({"point": _object({"x": {"type": "integer"}, "y": {"type": "integer"}})}),
    _object(
        {"title": NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2100}},
        required=["title"],
    ),
    _object({"scores": {"type": "array", "items": {"type": "number"}, "maxItems": 4}}),
    _object({"status": {"enum": ["ok", "error"]}, "code": {"type": "integer"}}),
    _object(
        {
            "user": _object({"id": {"type": "integer"}, "email": NAME}),
            "active": {"type": "boolean"},
        }
    ),
    _object({"items": {"type": "array", "items": _object({"sku": NAME}), "maxItems": 2}}),
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 5},
    _object({"nickname": {"type": ["string", "null"], "maxLength": 16}}),
    _object({"level": {"type": "integer", "enum": [1, 2, 3]}}),
    _object({"language": {"const": "en"}, "words": {"type": "integer", "minimum": 1}}),
    _object(
        {"a": _object({"b": _object({"c": {"type": "string", "maxLength": 8}})})},
    ),
    _object({"price": {"type": "number"}, "currency": {"enum": ["EUR", "USD"]}}),
    _object({"matrix": {"type": "array", "items": ROW, "minItems": 1, "maxItems": 2}}),
    _object({"ok": {"type": "boolean"}, "reason": NAME}, required=["ok"]),
]
