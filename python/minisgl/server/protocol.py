"""OpenAI API request models: validation at the edge and conversion to SamplingParams.

Everything is checked here, before a request leaves the API server, and a failure is an HTTP
400 naming the parameter: types strictly (a string where a number belongs is an error, not
coerced), every number against what the field can mean, floats finite. Every parameter the
API defines is either honoured or rejected; fields it does not define are ignored.

Limits beyond OpenAI's own ranges: `seed` within int64 (as vLLM), `n` at most 64, `top_k` and
token ids within int32, at most 16 stop strings of at most 256 characters each (OpenAI allows
4, vLLM any number) and 256 `stop_token_ids`, `repetition_penalty` in [0.01, 100] (float32
logits divided by less overflow), `max_tokens` at most the model's context. A positive
temperature below 1e-5 samples greedily, as in vLLM.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from minisgl.core import MAX_LOGPROBS, SamplingParams

from .responses import APIError
from .structured import structured_output

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 64
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_STOP_TOKEN_IDS = 256
GREEDY_BELOW_TEMPERATURE = 1e-5

TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH)]

# Parameters of the OpenAI API that minisgl does not implement: rejected when given a
# value other than their "off" value, never silently dropped.
UNSUPPORTED_PARAMS = (
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "logit_bias",
    "audio",
    "modalities",
    "prediction",
    "web_search_options",
)


def _unsupported(name: str) -> APIError:
    return APIError(
        f"'{name}' is not supported by this server", param=name, code="unsupported_parameter"
    )


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None


class GenerateRequest(_Strict):
    """Parameters shared by chat and text completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, ge=0.01, le=100.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # end-user id: metadata only

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(alternatives per generated token, per prompt token): None where not asked."""
        return None, None

    def check_unsupported(self) -> None:
        extra = self.model_extra or {}
        for name in UNSUPPORTED_PARAMS:
            value = extra.get(name)
            if value not in (None, [], {}, "none"):
                raise _unsupported(name)

    def sampling_params(
        self, max_tokens: int | None, max_tokens_param: str, max_model_len: int
    ) -> SamplingParams:
        """The request's sampling parameters; `max_tokens` None: what the context leaves."""
        if max_tokens is not None and max_tokens > max_model_len:
            raise APIError(
                f"{max_tokens_param}={max_tokens} is more than this model's maximum context "
                f"length of {max_model_len} tokens",
                param=max_tokens_param,
                code="context_length_exceeded",
            )
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        temperature = 1.0 if self.temperature is None else self.temperature
        if temperature < GREEDY_BELOW_TEMPERATURE:
            temperature = 0.0
        top_k = self.top_k if self.top_k not in (None, 0) else -1  # 0 = off, as in vLLM
        logprobs, prompt_logprobs = self.logprob_counts()
        structured = structured_output(self.model_extra or {})
        try:
            return SamplingParams(
                temperature=temperature,
                top_k=top_k,
                top_p=1.0 if self.top_p is None else self.top_p,
                min_p=self.min_p or 0.0,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=(
                    1.0 if self.repetition_penalty is None else self.repetition_penalty
                ),
                seed=self.seed,
                stop=stop,
                stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=self.ignore_eos,
                max_tokens=max_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                structured=structured,
            )
        except ValueError as exc:
            # SamplingParams.validate names the field: "invalid sampling parameter NAME=..."
            match = re.search(r"parameter (\w+)=", str(exc))
            param = match.group(1) if match else None
            message = str(exc)
            if param == "max_tokens":
                param = max_tokens_param
                message = message.replace("max_tokens=", f"{max_tokens_param}=")
            raise APIError(message, param=param, code="invalid_value") from exc


def sample_seed(seed: int | None, j: int) -> int | None:
    """The seed of the j-th of n samples of a prompt: seed + j, wrapped into int64 (n samples
    must differ even when seeded)."""
    if seed is None:
        return None
    return (seed + j - INT64_MIN) % 2**64 + INT64_MIN


class ChatCompletionRequest(GenerateRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(alternatives per generated token, per prompt token): None where not asked."""
        if self.top_logprobs and not self.logprobs:
            raise APIError(
                "'top_logprobs' needs 'logprobs': true", param="top_logprobs", code="invalid_value"
            )
        return (self.top_logprobs or 0) if self.logprobs else None, None

    def chat_messages(self) -> list[dict[str, str]]:
        """Messages with string content (text parts joined); other part types -> 400."""
        if not self.messages:
            raise APIError("'messages' must not be empty", param="messages", code="invalid_value")
        out = []
        for i, m in enumerate(self.messages):
            if m.content is None or isinstance(m.content, str):
                content = m.content or ""
            else:
                parts = []
                for part in m.content:
                    if part.type != "text" or part.text is None:
                        raise APIError(
                            f"messages[{i}]: content parts of type {part.type!r} are not "
                            "supported (text only)",
                            param="messages",
                            code="invalid_value",
                        )
                    parts.append(part.text)
                content = "".join(parts)
            out.append({"role": m.role, "content": content})
        return out


class CompletionRequest(GenerateRequest):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's
    best_of: int | None = None
    suffix: str | None = None

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(alternatives per generated token, per prompt token): None where not asked; echo
        with logprobs reports the prompt's too, as OpenAI's legacy API does."""
        prompt = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt = max(prompt or 0, self.logprobs)
        return self.logprobs, prompt

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.suffix:
            raise _unsupported("suffix")
        if self.best_of is not None and self.best_of != 1:
            raise _unsupported("best_of")

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError("'prompt' must not be empty", param="prompt", code="invalid_value")
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        if any(isinstance(x, list) and not x for x in p):
            raise APIError(
                "'prompt' must not contain an empty token list",
                param="prompt",
                code="invalid_value",
            )
        return list(p)  # type: ignore[arg-type]


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


def validation_error(exc: ValidationError) -> APIError:
    """The 400 for a body that does not validate, naming the parameter and the value. A union
    reports a type mismatch for each member it tried, so a value error (a number out of range,
    a string too long) is reported first, and a type error lists what each member expected."""
    errors = exc.errors()
    # The deepest type error is where a union member came closest to matching.
    deepest = max(errors, key=lambda e: len(_path(e.get("loc", ()))))
    err = next((e for e in errors if not e["type"].endswith("_type")), deepest)
    if err["type"] == "json_invalid":
        return APIError(
            f"the request body is not valid JSON (UTF-8): {err['msg']}", code="invalid_json"
        )
    path = _path(err.get("loc", ()))
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
            if _path(e.get("loc", ())) == path and e["type"].endswith("_type")
        )
        msg = "Input should be " + " or ".join(expected)
    if err["type"] == "missing":
        code = "missing_required_parameter"
        message = f"{_where(path)}: {msg}"
    else:
        code = "invalid_type" if err["type"].endswith("_type") else "invalid_value"
        message = f"{_where(path)}: {msg} (got {_shown(err.get('input'))})"
    return APIError(message, param=str(path[0]), code=code)


def parse_request(model: type[GenerateRequest], body: bytes) -> Any:
    """Validate a JSON body; malformed JSON, wrong types and out-of-range values -> 400."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc) from None
