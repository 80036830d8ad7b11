"""What a step leaves behind: the launched step awaiting its tokens, the tokens handed back per
request, and cache statistics."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from minisgl.core import Batch, FinishReason, Req
from minisgl.engine import ForwardOutput


@dataclass
class InFlight:
    """A launched step whose tokens have not been processed yet."""

    batch: Batch
    sampled: list[Req]
    result: ForwardOutput | Future[ForwardOutput]

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
