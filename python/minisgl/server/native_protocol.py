"""Request models of the native endpoints: SGLang's /generate (its sampling parameters by their
SGLang names) and vLLM's /tokenize and /detokenize. Checked as strictly as the OpenAI ones
(`protocol.py`): a 400 naming the parameter, unknown fields ignored with a WARNING."""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import Field

from minisgl.core import MAX_LOGPROBS, SamplingParams, StructuredOutput

from .protocol import ChatMessage, ChatTemplateOptions
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
from .structured import check_builds
from .validation import Strict, parse_object

# SGLang's /generate inputs minisgl cannot honour: refused unless off, never dropped.
GENERATE_UNSUPPORTED = (
    "image_data",
    "video_data",
    "audio_data",
    "input_embeds",
    "return_hidden_states",
    "custom_logit_processor",
    "session_params",
    "token_ids_logprob",
    "return_routed_experts",  # SGLang's client sends false on every request
)
SAMPLING_UNSUPPORTED = ("structural_tag",)
# SGLang's constraint fields -> StructuredOutput kinds.
SAMPLING_CONSTRAINTS = {"json_schema": "json", "regex": "regex", "ebnf": "grammar"}


def _refuse_set(extra: dict[str, Any] | None, names: tuple[str, ...], prefix: str = "") -> None:
    for name in names:
        if (extra or {}).get(name) not in (None, False, [], {}, ""):
            raise unsupported(f"{prefix}{name}")


class NativeSamplingParams(Strict):
    """SGLang's `sampling_params` object, with SGLang's names and defaults."""

    handled_extras = SAMPLING_UNSUPPORTED

    json_schema: str | None = None  # a JSON schema, as a string (SGLang's)
    regex: str | None = None
    ebnf: str | None = None
    max_new_tokens: int | None = Field(128, ge=1)  # null: what the context leaves
    min_new_tokens: int = Field(0, ge=0, le=INT32_MAX)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=INT32_MAX)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, ge=0.01, le=100.0)
    stop: Stop | None = None
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False  # keep the matched stop string (include_stop_str_in_output)
    logit_bias: LogitBias | None = None
    sampling_seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    n: int = Field(1, ge=1, le=MAX_N)

    def constraint(self) -> StructuredOutput | None:
        """SGLang's json_schema / regex / ebnf as one constraint (at most one per request)."""
        given = [(name, v) for name in SAMPLING_CONSTRAINTS if (v := getattr(self, name))]
        if len(given) > 1:
            raise APIError(
                f"sampling_params.{given[1][0]}: a request takes one constraint, "
                f"{given[0][0]} is given",
                param=f"sampling_params.{given[1][0]}",
                code="invalid_value",
            )
        if not given:
            return None
        name, value = given[0]
        spec = StructuredOutput(SAMPLING_CONSTRAINTS[name], value)
        check_builds(f"sampling_params.{name}", spec)
        return spec

    def to_sampling_params(
        self,
        max_model_len: int,
        vocab_size: int | None,
        logprobs: tuple[int | None, int | None] = (None, None),
        priority: int | None = None,
    ) -> SamplingParams:
        """logprobs: (alternatives per output token, per prompt token), None where not asked;
        priority: the request's (a top-level field of /generate, as in SGLang)."""
        _refuse_set(self.model_extra, SAMPLING_UNSUPPORTED, "sampling_params.")
        values = {
            name: getattr(self, name)
            for name in (
                "temperature top_p top_k min_p frequency_penalty presence_penalty "
                "repetition_penalty stop stop_token_ids ignore_eos logit_bias"
            ).split()
        }
        values.update(
            max_tokens=self.max_new_tokens,
            min_tokens=self.min_new_tokens,
            seed=self.sampling_seed,
            include_stop_str_in_output=self.no_stop_trim,
            logprobs=logprobs[0],
            prompt_logprobs=logprobs[1],
            structured=self.constraint(),
            priority=priority,
        )
        return make_sampling_params(values, max_model_len, vocab_size, SAMPLING_NAMES)


# SamplingParams' field -> how /generate names it in errors.
SAMPLING_NAMES = {
    name: f"sampling_params.{name}"
    for name in (
        "temperature top_p top_k min_p frequency_penalty presence_penalty repetition_penalty "
        "stop stop_token_ids ignore_eos logit_bias"
    ).split()
} | {
    "max_tokens": "sampling_params.max_new_tokens",
    "min_tokens": "sampling_params.min_new_tokens",
    "seed": "sampling_params.sampling_seed",
    "include_stop_str_in_output": "sampling_params.no_stop_trim",
}


class NativeGenerateRequest(Strict):
    """SGLang's /generate body: one prompt or a batch, as text or token ids."""

    handled_extras = GENERATE_UNSUPPORTED

    text: str | list[str] | None = None
    input_ids: list[TokenId] | list[list[TokenId]] | None = None
    # An object, or one per prompt; validated as NativeSamplingParams by `prompts`.
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    # Log-probabilities (SGLang's): of the output tokens, and of the prompt's from
    # logprob_start_len on (-1: none), each with its top_logprobs_num alternatives.
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    # SGLang's request priority, larger = more important; one for every prompt of a batch.
    priority: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    # SGLang's: the LoRA adapter (its name) every prompt runs under, or one per prompt.
    lora_path: str | list[str | None] | None = None

    def loras(self, count: int) -> list[str | None]:
        """The adapter of each of `count` prompts (None: the base model)."""
        if self.lora_path is None or isinstance(self.lora_path, str):
            return [self.lora_path] * count
        if len(self.lora_path) != count:
            raise APIError(
                f"lora_path has {len(self.lora_path)} entries for {count} prompts",
                param="lora_path",
                code="invalid_value",
            )
        return list(self.lora_path)

    @property
    def is_single(self) -> bool:
        """One prompt (the response is an object), not a batch (a list)."""
        if self.text is not None:
            return isinstance(self.text, str)
        return bool(self.input_ids) and isinstance(self.input_ids[0], int)  # type: ignore[index]

    def check_unsupported(self) -> None:
        _refuse_set(self.model_extra, GENERATE_UNSUPPORTED)

    def logprob_options(self, count: int) -> list[tuple[bool, int, int]]:
        """Per prompt: (return_logprob, logprob_start_len, top_logprobs_num), checked."""
        options = []
        for name, values in (
            ("return_logprob", self.return_logprob),
            ("logprob_start_len", self.logprob_start_len),
            ("top_logprobs_num", self.top_logprobs_num),
        ):
            values = _as_list(values)
            if len(values) not in (1, count):
                raise APIError(
                    f"{name} has {len(values)} entries for {count} prompts",
                    param=name,
                    code="invalid_value",
                )
            options.append(values * count if len(values) == 1 else values)
        for start, top in zip(options[1], options[2]):
            if not (isinstance(start, int) and start >= -1):
                raise APIError(
                    f"logprob_start_len={start!r} is not an integer >= -1",
                    param="logprob_start_len",
                    code="invalid_value",
                )
            if not (isinstance(top, int) and 0 <= top <= MAX_LOGPROBS):
                raise APIError(
                    f"top_logprobs_num={top!r} is outside 0..{MAX_LOGPROBS}",
                    param="top_logprobs_num",
                    code="invalid_value",
                )
        return list(zip(*options))

    def prompts(self) -> tuple[str, list[dict[str, Any]]]:
        """The name of the prompt's parameter and the prompts as TokenizeMsg fields."""
        if (self.text is None) == (self.input_ids is None):
            raise APIError(
                "give exactly one of 'text' and 'input_ids'", param="text", code="invalid_value"
            )
        if self.text is not None:
            texts = [self.text] if isinstance(self.text, str) else self.text
            prompts: list[dict[str, Any]] = [{"text": t} for t in texts]
            param = "text"
        else:
            ids = self.input_ids
            batch = [ids] if self.is_single else ids
            prompts = [{"input_ids": list(x)} for x in batch]  # type: ignore[union-attr]
            param = "input_ids"
        if not prompts or any(p.get("input_ids") == [] for p in prompts):
            raise APIError(f"'{param}' must not be empty", param=param, code="invalid_value")
        return param, prompts

    def sampling(self, count: int) -> list[NativeSamplingParams]:
        """One parameter set per prompt (`count` of them)."""
        given = self.sampling_params
        if isinstance(given, list):
            if len(given) != count:
                raise APIError(
                    f"sampling_params has {len(given)} entries for {count} prompts",
                    param="sampling_params",
                    code="invalid_value",
                )
            return [parse_object(NativeSamplingParams, x, "sampling_params") for x in given]
        one = parse_object(NativeSamplingParams, given or {}, "sampling_params")
        return [one] * count

    def request_ids(self, count: int) -> list[str]:
        """meta_info ids: the request's `rid`(s), else fresh ones."""
        if self.rid is None:
            return [uuid.uuid4().hex for _ in range(count)]
        rids = [self.rid] if isinstance(self.rid, str) else self.rid
        if len(rids) != count:
            raise APIError(
                f"rid has {len(rids)} entries for {count} prompts",
                param="rid",
                code="invalid_value",
            )
        return rids


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


class TokenizeRequest(Strict):
    """vLLM's /tokenize: a `prompt`, or `messages` rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # Default: true for a prompt, false for messages (the template holds the special tokens).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    def encode_fields(self) -> dict[str, Any]:
        """The EncodeMsg fields (less rid); the prompt or the conversation checked."""
        if (self.prompt is None) == (self.messages is None):
            raise APIError(
                "give exactly one of 'prompt' and 'messages'", param="prompt", code="invalid_value"
            )
        fields: dict[str, Any] = {"return_token_strs": self.return_token_strs}
        if self.prompt is not None:
            add = True if self.add_special_tokens is None else self.add_special_tokens
            return fields | {"text": self.prompt, "add_special_tokens": add}
        chat = ChatTemplateOptions.model_construct(
            messages=self.messages,
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            chat_template_kwargs=self.chat_template_kwargs,
        )
        chat.check_template_options()
        return fields | {
            "messages": chat.chat_messages(),
            "add_special_tokens": bool(self.add_special_tokens),
            **chat.template_fields(),
        }


class DetokenizeRequest(Strict):
    """vLLM's /detokenize: token ids to text."""

    model: str | None = None
    tokens: list[TokenId]
