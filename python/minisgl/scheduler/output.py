"""What a step leaves behind: the launched step awaiting its tokens, the tokens handed back per
request and why a request ends, and cache statistics."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from minisgl.core import Batch, FinishReason, Req
from minisgl.engine import ForwardOutput


@dataclass
class InFlight:
    """A launched step whose tokens have not been processed yet."""

    batch: Batch
    sampled: list[Req]
    result: ForwardOutput | Future[ForwardOutput]
    # Indices into `sampled` of the requests whose token log-probabilities the step computes,
    # and each request's prompt positions [start, end) it computes them for, in row order.
    logprob_indices: list[int] = field(default_factory=list)
    prompt_spans: list[tuple[Req, int, int]] = field(default_factory=list)
    # The embedding requests of the step, in ForwardInput.pool_spans' order.
    pooling: list[Req] = field(default_factory=list)

    def output(self) -> ForwardOutput:
        result = self.result
        return (result.result() if isinstance(result, Future) else result).wait()


@dataclass(frozen=True)
class TokenOutput:
    """One generated token of one request; `finish_reason` is set on its last output."""

    uid: int
    token: int | None  # None only for an aborted request's closing output
    finish_reason: FinishReason | None
    # Prompt tokens that came from the prefix cache (reported with the last output).
    cached_tokens: int = 0
    error: str | None = None  # why the request failed (finish_reason "error")
    error_param: str | None = None  # the parameter at fault (a 400), None: its own failure
    error_code: str | None = None  # None: "invalid_value" with a param, else "request_failed"
    # [logprob, [[alternative id, logprob], ...]] of this token, where the request asked.
    logprobs: list[Any] | None = None
    # The prompt's (first output only): see Req.prompt_logprobs.
    prompt_logprobs: list[list[Any]] | None = None
    # Speculative decoding: the request's verify steps and accepted drafts so far (None: off).
    spec_verify_ct: int | None = None
    spec_accepted_tokens: int = 0
    embedding: list[float] | None = None  # an embedding request's pooled vector (its output)


@dataclass
class SchedulerStats:
    """Running totals: prompt tokens seen, served from cache, and retractions."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    retractions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def finish_reason(req: Req, token: int, eos_ids: frozenset[int]) -> FinishReason | None:
    """Why the request ends with this token appended to its input_ids, if it does."""
    params = req.sampling_params
    stops = (token in eos_ids and not params.ignore_eos) or token in params.stop_token_ids
    if stops and req.output_len >= params.min_tokens:  # output_len counts this token
        return "stop"
    if req.grammar is not None and req.grammar.is_terminated():  # the constraint is complete
        return "stop"
    if len(req.input_ids) >= req.max_device_len:
        return "length"
    return None
