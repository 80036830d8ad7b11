"""Sampling parameters at the edge, whatever the endpoint calls them: their limits, and the
conversion of a request's values to `SamplingParams` with a 400 naming the parameter.

Limits beyond OpenAI's own ranges: `seed` and `priority` within int64 (as vLLM), `n` at most
64, `top_k` and token ids within int32, at most 16 stop strings of at most 256 characters each
(OpenAI allows 4, vLLM any number) and 256 `stop_token_ids`, `repetition_penalty` in [0.01, 100]
(float32 logits divided by less overflow), at most 1,024 `logit_bias` entries, each in [-100,
100] on a token of the vocabulary (`stop_token_ids` too), `max_tokens` at most the model's
context. A positive temperature below 1e-5 samples greedily, as in vLLM.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import Field

from minisgl.core import SamplingParams

from .responses import APIError

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 64
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024
GREEDY_BELOW_TEMPERATURE = 1e-5

TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
StopTokenIds = Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)]
# OpenAI's form: token ids as JSON object keys (strings), biases added to the logits.
LogitBias = Annotated[
    dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]], Field(max_length=MAX_LOGIT_BIAS)
]

_DECIMAL = re.compile(r"[0-9]{1,10}")


def unsupported(name: str) -> APIError:
    """The 400 for a known parameter this server cannot honour."""
    return APIError(
        f"'{name}' is not supported by this server", param=name, code="unsupported_parameter"
    )


def logit_bias_ids(
    logit_bias: dict[str, float] | None, vocab_size: int | None, param: str = "logit_bias"
) -> dict[int, float]:
    """OpenAI's logit_bias (token id strings) as token ids; a key that is not a token id of
    the vocabulary -> 400 naming `param`."""
    out: dict[int, float] = {}
    for key, bias in (logit_bias or {}).items():
        token = int(key) if _DECIMAL.fullmatch(key) else -1
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            limit = f"[0, {vocab_size})" if vocab_size is not None else "0 or more"
            raise APIError(
                f"{param}: {key!r} is not a token id of this model (a decimal integer in {limit})",
                param=param,
                code="invalid_value",
            )
        out[token] = bias
    return out


def stop_token_id_list(ids: list[int], vocab_size: int | None, param: str) -> list[int]:
    """stop_token_ids as given; an id outside the vocabulary (which no step can sample) -> 400
    naming `param`, as logit_bias's."""
    outside = sorted(t for t in ids if vocab_size is not None and t >= vocab_size)
    if outside:
        raise APIError(
            f"{param}: {outside[:8]} are not token ids of this model (in [0, {vocab_size}))",
            param=param,
            code="invalid_value",
        )
    return list(ids)


def make_sampling_params(
    values: dict[str, Any],
    max_model_len: int,
    vocab_size: int | None,
    names: dict[str, str] | None = None,
) -> SamplingParams:
    """SamplingParams from a request's values, keyed by SamplingParams' field names (None or
    absent: the default; `temperature` defaults to 1, as in OpenAI). `names` maps a field to
    the request's name for it, used in errors ("max_tokens" -> "max_completion_tokens").
    `max_tokens` None means what the context leaves after the prompt."""
    names = names or {}
    v = {k: x for k, x in values.items() if x is not None}
    max_tokens = v.get("max_tokens")
    if max_tokens is not None and max_tokens > max_model_len:
        param = names.get("max_tokens", "max_tokens")
        raise APIError(
            f"{param}={max_tokens} is more than this model's maximum context length of "
            f"{max_model_len} tokens",
            param=param,
            code="context_length_exceeded",
        )
    temperature = v.get("temperature", 1.0)
    if temperature < GREEDY_BELOW_TEMPERATURE:
        temperature = 0.0
    stop = v.get("stop", [])
    top_k = v.get("top_k", -1)
    try:
        return SamplingParams(
            temperature=temperature,
            top_k=top_k if top_k != 0 else -1,  # 0 = off, as in vLLM
            top_p=v.get("top_p", 1.0),
            min_p=v.get("min_p", 0.0),
            presence_penalty=v.get("presence_penalty", 0.0),
            frequency_penalty=v.get("frequency_penalty", 0.0),
            repetition_penalty=v.get("repetition_penalty", 1.0),
            seed=v.get("seed"),
            stop=[stop] if isinstance(stop, str) else list(stop),
            stop_token_ids=stop_token_id_list(
                v.get("stop_token_ids", []),
                vocab_size,
                names.get("stop_token_ids", "stop_token_ids"),
            ),
            ignore_eos=v.get("ignore_eos", False),
            max_tokens=max_tokens,
            min_tokens=v.get("min_tokens", 0),
            logit_bias=logit_bias_ids(
                v.get("logit_bias"), vocab_size, names.get("logit_bias", "logit_bias")
            ),
            include_stop_str_in_output=v.get("include_stop_str_in_output", False),
            logprobs=v.get("logprobs"),
            prompt_logprobs=v.get("prompt_logprobs"),
            structured=v.get("structured"),
            priority=v.get("priority", 0),
        )
    except ValueError as exc:
        # SamplingParams.validate names the field: "invalid sampling parameter NAME=..."
        match = re.search(r"parameter (\w+)=", str(exc))
        field = match.group(1) if match else None
        param = names.get(field, field) if field is not None else None
        message = str(exc)
        for name, given in names.items():
            message = re.sub(rf"\b{name}=", f"{given}=", message)
        raise APIError(message, param=param, code="invalid_value") from exc


def sample_seed(seed: int | None, j: int) -> int | None:
    """The seed of the j-th of n samples of a prompt: seed + j, wrapped into int64 (n samples
    must differ even when seeded)."""
    if seed is None:
        return None
    return (seed + j - INT64_MIN) % 2**64 + INT64_MIN
