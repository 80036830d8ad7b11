"""OpenAI API request models, their conversion to SamplingParams, and error bodies.

Requests are validated strictly (a string where a number belongs is an error, not coerced).
Every parameter the API defines is either honoured or rejected with HTTP 400 naming it;
fields the API does not define are ignored, as OpenAI's own server does.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from minisgl.core import SamplingParams

# Parameters of the OpenAI API that minisgl does not implement: rejected when given a
# value other than their "off" value, never silently dropped.
UNSUPPORTED_PARAMS = (
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "logit_bias",
    "response_format",
    "audio",
    "modalities",
    "prediction",
    "web_search_options",
)


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
        self.message, self.status, self.param, self.code, self.type = (
            message,
            status,
            param,
            code,
            type,
        )

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


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool = False


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: str
    content: str | list[ContentPart] | None = None


class _GenerateRequest(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    n: int = Field(default=1, ge=1, le=64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # end-user id: metadata only

    def check_unsupported(self) -> None:
        extra = self.model_extra or {}
        for name in UNSUPPORTED_PARAMS:
            value = extra.get(name)
            if name == "response_format" and value in ({"type": "text"}, None):
                continue
            if value not in (None, [], {}, "none"):
                raise APIError(f"'{name}' is not supported by this server", param=name)

    def sampling_params(self, max_tokens: int | None, max_tokens_param: str) -> SamplingParams:
        """Build and validate the sampling parameters (ValueError -> 400 naming the field)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stop):
            raise APIError("stop strings must not be empty", param="stop")
        top_k = self.top_k if self.top_k not in (None, 0) else -1  # 0 = off, as in vLLM
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
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
                max_tokens=max_tokens,  # type: ignore[arg-type]
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


class ChatCompletionRequest(_GenerateRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.logprobs:
            raise APIError("'logprobs' is not supported by this server", param="logprobs")
        if self.top_logprobs:
            raise APIError("'top_logprobs' is not supported by this server", param="top_logprobs")

    def chat_messages(self) -> list[dict[str, str]]:
        """Messages with string content (text parts joined); other part types -> 400."""
        if not self.messages:
            raise APIError("'messages' must not be empty", param="messages")
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
                        )
                    parts.append(part.text)
                content = "".join(parts)
            out.append({"role": m.role, "content": content})
        return out


class CompletionRequest(_GenerateRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.logprobs is not None:
            raise APIError("'logprobs' is not supported by this server", param="logprobs")
        if self.echo:
            raise APIError("'echo' is not supported by this server", param="echo")
        if self.suffix:
            raise APIError("'suffix' is not supported by this server", param="suffix")
        if self.best_of is not None and self.best_of != 1:
            raise APIError("'best_of' is not supported by this server", param="best_of")

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError("'prompt' must not be empty", param="prompt")
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        if any(isinstance(x, list) and not x for x in p):
            raise APIError("'prompt' must not contain an empty token list", param="prompt")
        return list(p)  # type: ignore[arg-type]


def parse_request(model: type[_GenerateRequest], body: bytes) -> Any:
    """Validate a JSON body; malformed JSON and wrong types -> APIError 400."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = err.get("loc", ())
        if err["type"] == "json_invalid":
            raise APIError(f"malformed JSON body: {err['msg']}", code="invalid_json") from exc
        param = str(loc[0]) if loc else None
        where = ".".join(str(x) for x in loc)
        message = f"{where}: {err['msg']}" if where else err["msg"]
        code = "missing_required_parameter" if err["type"] == "missing" else "invalid_type"
        raise APIError(message, param=param, code=code) from exc


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
