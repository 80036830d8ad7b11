"""Structured-output request fields -> one `StructuredOutput`: OpenAI's `response_format`
(`json_object`, `json_schema`) and vLLM's `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar` and `structured_outputs` ({json, regex, choice, grammar}). At most one
constraint per request; each is checked here by building its grammar (xgrammar, no tokenizer
needed), so a bad schema, regex or grammar is a 400 naming the parameter."""

from __future__ import annotations

import json
from typing import Any

from minisgl.core import StructuredOutput
from minisgl.scheduler.grammar import json_schema_grammar

from .responses import APIError

# vLLM's field -> our kind; `structured_outputs` takes the same keys without the prefix.
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


# Every field read here (from the request's extras).
STRUCTURED_FIELDS = ("response_format", *GUIDED_FIELDS, "structured_outputs")


def _invalid(param: str, message: str) -> APIError:
    return APIError(f"{param}: {message}", param=param, code="invalid_value")


def _from_response_format(value: Any) -> StructuredOutput | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise _invalid("response_format", "must be an object with a 'type'")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json")
    if kind != "json_schema":
        raise _invalid("response_format", f"type {kind!r} is not text, json_object or json_schema")
    spec = value.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise _invalid("response_format", "json_schema.schema must be a JSON schema object")
    return StructuredOutput("json", json.dumps(schema))


def _from_guided(param: str, kind: str, value: Any) -> StructuredOutput:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise _invalid(param, f"not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise _invalid(param, "must be a JSON schema object")
        return StructuredOutput("json", json.dumps(value))
    if kind == "choice":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise _invalid(param, "must be a non-empty list of non-empty strings")
        return StructuredOutput("choice", json.dumps(value))
    if not isinstance(value, str) or not value:
        raise _invalid(param, "must be a non-empty string")
    return StructuredOutput(kind, value)


_byte_compiler: Any = None


def _admits_a_first_byte(grammar: Any) -> bool:
    """Whether the grammar lets an output start: some first byte, or the end (its language
    holds the empty string). Compiled for a vocabulary of the 256 bytes and an end token, so
    any tokenizer's first step allows nothing exactly when this one does (no text at all
    matches: the engine's logits would be all masked, a server error)."""
    import torch
    import xgrammar as xgr

    global _byte_compiler
    if _byte_compiler is None:
        vocab = [bytes([b]) for b in range(256)] + [b"</s>"]
        info = xgr.TokenizerInfo(vocab, stop_token_ids=[256])
        _byte_compiler = xgr.GrammarCompiler(info, max_threads=1)
    matcher = xgr.GrammarMatcher(_byte_compiler.compile_grammar(grammar))
    bitmask = xgr.allocate_token_bitmask(1, 257)
    matcher.fill_next_token_bitmask(bitmask)
    return bool(torch.count_nonzero(bitmask))


def check_builds(param: str, spec: StructuredOutput) -> None:
    """Build the constraint's grammar once (no tokenizer): its errors are the client's, and so
    is a constraint that no text satisfies (a regex of an empty character class, say)."""
    import xgrammar as xgr

    try:
        if spec.kind == "json" and spec.spec:
            grammar = json_schema_grammar(spec.spec)
        elif spec.kind == "regex":
            grammar = xgr.Grammar.from_regex(spec.spec)
        elif spec.kind == "grammar":
            grammar = xgr.Grammar.from_ebnf(spec.spec)
        else:
            return
    except Exception as exc:  # xgrammar's errors name what it could not parse
        raise _invalid(param, f"cannot be compiled: {exc}") from None
    if not _admits_a_first_byte(grammar):
        shown = spec.spec if len(spec.spec or "") <= 60 else f"{spec.spec[:57]}..."
        raise _invalid(param, f"no text satisfies it, so nothing can be generated (got {shown!r})")


def structured_output(fields: dict[str, Any]) -> StructuredOutput | None:
    """The request's one constraint from its fields (the body's extras), or None."""
    found: list[tuple[str, StructuredOutput | None]] = []
    if fields.get("response_format") is not None:
        found.append(("response_format", _from_response_format(fields["response_format"])))
    for param, kind in GUIDED_FIELDS.items():
        if fields.get(param) is not None:
            found.append((param, _from_guided(param, kind, fields[param])))
    outputs = fields.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise _invalid("structured_outputs", "must be an object")
        for key, kind in ((k.removeprefix("guided_"), k) for k in GUIDED_FIELDS):
            if outputs.get(key) is not None:
                param = f"structured_outputs.{key}"
                found.append((param, _from_guided(param, GUIDED_FIELDS[kind], outputs[key])))
    found = [(param, spec) for param, spec in found if spec is not None]
    if len(found) > 1:
        raise _invalid(found[1][0], f"a request takes one constraint, {found[0][0]} is given")
    if not found:
        return None
    param, spec = found[0]
    assert spec is not None
    check_builds(param, spec)
    return spec
