"""Request bodies at the edge: strict parsing, a 400 naming the parameter for what does not
validate, and a WARNING naming the fields the server does not know (and ignores)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any, ClassVar, TypeVar

import pydantic_core
from pydantic import BaseModel, ConfigDict, ValidationError

from minisgl.utils import init_logger

from .responses import APIError

logger = init_logger(__name__)

M = TypeVar("M", bound="Strict")

# The most sub-requests (prompts x n) one HTTP request may make: --max-batch-prompts' default.
MAX_BATCH_PROMPTS = 1024


# SGLang request fields and the value at which this server already behaves as they ask (stop
# strings trimmed, no hidden states, reasoning streamed as it comes).
SGLANG_DEFAULTS: dict[str, Any] = {
    "no_stop_trim": False,
    "return_hidden_states": False,
    "stream_reasoning": True,
}


class Strict(BaseModel):
    """A request body: types strictly (no coercion), floats finite. Fields it does not declare
    are kept in `model_extra`, then ignored with a warning (`parse_request`) unless the model
    handles them by name (`handled_extras`: refused, or read from the extras)."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    # Undeclared fields that the model handles itself (a 400, or read), so not "ignored".
    handled_extras: ClassVar[tuple[str, ...]] = ()

    def ignored_fields(self, prefix: str = "") -> list[str]:
        """Dotted names of the undeclared fields, here and in nested models (list items as
        `name[]`), that nothing reads (SGLang's own fields at the values this server behaves
        as anyway are not listed: sglang-router adds them to every request it forwards)."""
        out = [
            f"{prefix}{name}"
            for name, value in (self.model_extra or {}).items()
            if name not in self.handled_extras and SGLANG_DEFAULTS.get(name, ...) != value
        ]
        for name in type(self).model_fields:
            for path, value in _nested(f"{prefix}{name}", getattr(self, name)):
                out.extend(value.ignored_fields(f"{path}."))
        return sorted(set(out))


def _nested(path: str, value: Any) -> Iterable[tuple[str, Strict]]:
    if isinstance(value, Strict):
        yield path, value
    elif isinstance(value, list):
        for item in value:
            yield from _nested(f"{path}[]", item)


# A union's members appear in an error's location as tags ("str", "list[constrained-int]"):
# not part of the parameter's path.
_UNION_TAG = re.compile(r"[\[\]-]|^(str|int|float|bool|none)$")


def _path(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(x for x in loc if not (isinstance(x, str) and _UNION_TAG.search(x)))


def _where(path: tuple[Any, ...]) -> str:
    out = ""
    for x in path:
        out += f"[{x}]" if isinstance(x, int) else (f".{x}" if out else str(x))
    return out


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def validation_error(exc: ValidationError, prefix: str | None = None) -> APIError:
    """The 400 for a body that does not validate, naming the parameter and the value. A union
    reports a type mismatch for each member it tried, so a value error (a number out of range,
    a string too long) is reported first, and a type error lists what each member expected.
    `prefix`: the body is that parameter's object, and a field of it is named "prefix.field"."""
    errors = exc.errors()
    # The deepest type error is where a union member came closest to matching.
    deepest = max(errors, key=lambda e: len(_path(e.get("loc", ()))))
    err = next((e for e in errors if not e["type"].endswith("_type")), deepest)
    if err["type"] == "json_invalid":
        return APIError(
            f"the request body is not valid JSON (UTF-8): {err['msg']}", code="invalid_json"
        )
    path = _path(err.get("loc", ()))
    if prefix is not None:
        path = (prefix, *path)
    if not path:  # e.g. an array or a string where the body's object belongs
        return APIError(
            f"the request body must be a JSON object (got {_shown(err.get('input'))})",
            code="invalid_type",
        )
    msg = err["msg"]
    if err["type"].endswith("_type"):
        expected = dict.fromkeys(
            e["msg"].removeprefix("Input should be ")
            for e in errors
            if _path(e.get("loc", ())) == path[prefix is not None :] and e["type"].endswith("_type")
        )
        msg = "Input should be " + " or ".join(expected)
    if err["type"] == "missing":
        code = "missing_required_parameter"
        message = f"{_where(path)}: {msg}"
    else:
        code = "invalid_type" if err["type"].endswith("_type") else "invalid_value"
        message = f"{_where(path)}: {msg} (got {_shown(err.get('input'))})"
    param = str(path[0])
    member = next((x for x in path[1:] if isinstance(x, str)), None)
    if prefix is not None and member is not None:
        param = f"{prefix}.{member}"
    return APIError(message, param=param, code=code)


def _warn_ignored(req: Strict, prefix: str = "") -> None:
    ignored = req.ignored_fields(prefix)
    if ignored:
        logger.warning(
            "%s: ignored the request's fields %s (this server does not use them)",
            type(req).__name__,
            ", ".join(ignored),
        )


def parse_request(model: type[M], body: bytes | str) -> M:
    """Validate a JSON body; malformed JSON, wrong types and out-of-range values -> 400.
    Fields the model does not know are ignored and named in a WARNING (as vLLM does)."""
    try:
        req = model.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc) from None
    _warn_ignored(req)
    return req


def parse_json(body: bytes | str) -> Any:
    """A JSON body as Python values, as strictly as `parse_request` reads one (for routes that
    translate a body themselves: Anthropic's, the Responses API): not UTF-8, lone surrogates,
    NaN / Infinity / a number beyond float range, nesting past the parser's depth limit -> 400
    naming `body`. Python's json.loads takes all of these, and echoing such a value back fails
    only when the response is written (a 500 after the generation ran)."""
    try:
        value = pydantic_core.from_json(body, allow_inf_nan=False)
    except ValueError as exc:
        raise APIError(
            f"the request body is not valid JSON (UTF-8): {exc}", param="body", code="invalid_json"
        ) from None
    stack = [value]  # jiter reads 1e999 as inf even so
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, float) and not math.isfinite(item):
            raise APIError(
                "the request body is not valid JSON: a number is out of the float range "
                f"(got {item})",
                param="body",
                code="invalid_json",
            )
    return value


def parse_object(model: type[M], data: Any, param: str) -> M:
    """`parse_request` for an object already parsed from JSON: the value of `param`, whose
    fields are named "param.field" in errors and warnings."""
    try:
        req = model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, param) from None
    _warn_ignored(req, f"{param}.")
    return req


def check_batch_size(
    prompts: int, sequences: int, limit: int, prompt_param: str, n_param: str = "n"
) -> None:
    """A 400 naming --max-batch-prompts and the limit when a request asks for more than `limit`
    sequences (its prompts times n); its param is `prompt_param` where the prompts alone are
    too many, else `n_param`. Checked before anything is tokenized or queued."""
    if sequences <= limit:
        return
    per = "" if sequences == prompts else f" ({prompts} prompts x n)"
    raise APIError(
        f"the request asks for {sequences} sequences{per}, more than this server takes in one "
        f"request (--max-batch-prompts {limit}); split it into smaller requests",
        param=prompt_param if prompts > limit else n_param,
        code="invalid_value",
    )
