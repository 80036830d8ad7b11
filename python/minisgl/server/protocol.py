"""OpenAI API request models: validation at the edge and conversion to SamplingParams.

Everything is checked here, before a request leaves the API server, and a failure is an HTTP
400 naming the parameter: types strictly (a string where a number belongs is an error, not
coerced), every number against what the field can mean (limits: `server/sampling.py`), floats
finite. Every parameter the API defines is either honoured or rejected; fields it does not
define are ignored and named in a WARNING log line. vLLM's extensions are honoured the same
way: `top_k`, `min_p`, `repetition_penalty`, `stop_token_ids`, `ignore_eos`, `min_tokens`,
`skip_special_tokens`, `spaces_between_special_tokens`, `include_stop_str_in_output`, and for
chat `add_generation_prompt`, `continue_final_message`, `chat_template_kwargs`.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from minisgl.core import MAX_LOGPROBS, SamplingParams, StructuredOutput
from minisgl.tokenizer.tokenize import CHAT_TEMPLATE_RESERVED

from .responses import APIError
from .sampling import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_N,
    LogitBias,
    Stop,
    StopTokenIds,
    TokenId,
    make_sampling_params,
    unsupported,
)
from .structured import STRUCTURED_FIELDS, check_builds, structured_output
from .tools import ToolChoice, check_tools
from .validation import Strict

# Parameters of the OpenAI API that minisgl does not implement: rejected when given a
# value other than their "off" value, never silently dropped.
UNSUPPORTED_PARAMS = (
    "functions",
    "function_call",
    "audio",
    "modalities",
    "prediction",
    "web_search_options",
)


class StreamOptions(Strict):
    include_usage: bool = False
    # vLLM's: every chunk carries the usage so far (its choice's tokens, its prompt's).
    continuous_usage_stats: bool = False


class ContentPart(Strict):
    type: str
    text: str | None = None


class ToolCallFunction(Strict):
    name: str
    arguments: str  # JSON, as OpenAI sends it


class ToolCall(Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool result's call

    def template_fields(self) -> dict[str, Any]:
        """What the chat template reads of the message beyond role and content: the calls'
        arguments as objects (templates write them with tojson), the tool result's call id."""
        fields: dict[str, Any] = {}
        if self.tool_calls:
            fields["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _json_or_text(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            fields["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            fields["name"] = self.name
        return fields


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class GenerateRequest(Strict):
    """Parameters shared by chat and text completions."""

    handled_extras = UNSUPPORTED_PARAMS + STRUCTURED_FIELDS

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: Stop | None = None
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, ge=0.01, le=100.0)
    logit_bias: LogitBias | None = None
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # end-user id: metadata only
    # SGLang's extension: larger = more important (scheduling, retraction, eviction).
    priority: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(alternatives per generated token, per prompt token): None where not asked."""
        return None, None

    def check_unsupported(self) -> None:
        extra = self.model_extra or {}
        for name in UNSUPPORTED_PARAMS:
            value = extra.get(name)
            if value not in (None, [], {}, "none"):
                raise unsupported(name)

    def constraint(self) -> StructuredOutput | None:
        """The request's structured-output constraint (see server/structured.py)."""
        return structured_output(self.model_extra or {})

    def sampling_params(
        self,
        max_tokens: int | None,
        max_tokens_param: str,
        max_model_len: int,
        vocab_size: int | None = None,
    ) -> SamplingParams:
        """The request's sampling parameters; `max_tokens` None: what the context leaves.
        `vocab_size` bounds logit_bias's token ids."""
        fields = (
            "temperature top_k top_p min_p presence_penalty frequency_penalty repetition_penalty "
            "seed stop stop_token_ids ignore_eos min_tokens logit_bias include_stop_str_in_output "
            "priority"
        ).split()
        values = {name: getattr(self, name) for name in fields}
        values["max_tokens"] = max_tokens
        values["logprobs"], values["prompt_logprobs"] = self.logprob_counts()
        values["structured"] = self.constraint()
        names = {"max_tokens": max_tokens_param}
        return make_sampling_params(values, max_model_len, vocab_size, names)

    @property
    def usage_options(self) -> tuple[bool, bool]:
        """(a closing usage chunk, usage on every chunk) for a stream."""
        options = self.stream_options or StreamOptions()
        return options.include_usage, options.continuous_usage_stats


class ChatTemplateOptions(Strict):
    """How a conversation is rendered (vLLM's chat extensions; /v1/chat/completions and
    /tokenize)."""

    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    # The last message (the assistant's, usually) is continued, not closed.
    continue_final_message: bool = False
    # The chat template's own variables (e.g. Qwen3's enable_thinking).
    chat_template_kwargs: dict[str, Any] | None = None

    def check_template_options(self) -> None:
        """Refuse combinations the template cannot render, naming the parameter."""
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError(
                "continue_final_message continues the last message, so add_generation_prompt "
                "must be false with it",
                param="continue_final_message",
                code="invalid_value",
            )
        reserved = sorted(CHAT_TEMPLATE_RESERVED.intersection(self.chat_template_kwargs or {}))
        if reserved:
            raise APIError(
                f"chat_template_kwargs may not set {reserved}: they are not template variables",
                param="chat_template_kwargs",
                code="invalid_value",
            )

    def template_fields(self) -> dict[str, Any]:
        """The rendering options, as TokenizeMsg / EncodeMsg fields."""
        return {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "chat_template_kwargs": self.chat_template_kwargs,
        }

    def chat_messages(self) -> list[dict[str, Any]]:
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
            out.append({"role": m.role, "content": content, **m.template_fields()})
        return out


class ChatCompletionRequest(ChatTemplateOptions, GenerateRequest):
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call where it is forced
    # SGLang's: false keeps the thinking in the content where a --reasoning-parser is set
    separate_reasoning: bool = True

    def tool_choice_spec(self) -> ToolChoice:
        """The request's tools and tool_choice, checked."""
        return check_tools(self.tools, self.tool_choice, self.parallel_tool_calls)

    def constraint(self) -> StructuredOutput | None:
        """`required` / a named tool choice holds the output to its calls' JSON schema."""
        given = super().constraint()
        forced = self.tool_choice_spec().constraint()
        if forced is not None:  # built from the tools' parameters: their schemas' errors
            check_builds("tools", forced)
        if given is not None and forced is not None:
            raise APIError(
                "tool_choice required or a named function cannot be combined with another "
                "structured output constraint",
                param="tool_choice",
                code="invalid_value",
            )
        return given or forced

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(alternatives per generated token, per prompt token): None where not asked."""
        if self.top_logprobs and not self.logprobs:
            raise APIError(
                "'top_logprobs' needs 'logprobs': true", param="top_logprobs", code="invalid_value"
            )
        return (self.top_logprobs or 0) if self.logprobs else None, None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        self.check_template_options()


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
            raise unsupported("suffix")
        if self.best_of is not None and self.best_of != 1:
            raise unsupported("best_of")

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


class LoadLoraRequest(Strict):
    """vLLM's /v1/load_lora_adapter body."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraRequest(Strict):
    """vLLM's /v1/unload_lora_adapter body."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's; the name decides here
