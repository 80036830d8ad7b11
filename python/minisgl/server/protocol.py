"""OpenAI API request models and their conversion to SamplingParams.

Requests are validated strictly (a string where a number belongs is an error, not coerced).
Every parameter the API defines is either honoured or rejected with HTTP 400 naming it;
fields the API does not define are ignored.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from minisgl.core import SamplingParams

from .responses import APIError

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


def _unsupported(name: str) -> APIError:
    return APIError(
        f"'{name}' is not supported by this server", param=name, code="unsupported_parameter"
    )


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


class GenerateRequest(_Strict):
    """Parameters shared by chat and text completions."""

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
                raise _unsupported(name)

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


class ChatCompletionRequest(GenerateRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.logprobs:
            raise _unsupported("logprobs")
        if self.top_logprobs:
            raise _unsupported("top_logprobs")

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


class CompletionRequest(GenerateRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.logprobs is not None:
            raise _unsupported("logprobs")
        if self.echo:
            raise _unsupported("echo")
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
            raise APIError("'prompt' must not be empty", param="prompt")
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        if any(isinstance(x, list) and not x for x in p):
            raise APIError("'prompt' must not contain an empty token list", param="prompt")
        return list(p)  # type: ignore[arg-type]


def parse_request(model: type[GenerateRequest], body: bytes) -> Any:
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
