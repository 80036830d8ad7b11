"""serving.py's metrics: per request TTFT, TPOT, ITL (a chunk of k tokens counts as k gaps) and
E2E from the recorded stream, and their summary over a run: percentiles, throughput, counts."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import numpy as np
from serving_client import RequestResult

PERCENTILES = (50, 90, 99)


def tokens_per_chunk(texts: list[str], total: int, tokenizer: Any) -> list[int]:
    """How many of the `total` output tokens each text chunk carried.

    The server streams text only. A chunk holds several tokens when the detokenizer held text
    back (half a UTF-8 character) or took several decode steps at once; the exact total comes
    from the usage chunk. Every chunk has at least one token; the surplus is spread by largest
    remainder in proportion to what re-tokenizing each chunk's text suggests beyond one token
    (evenly when it suggests nothing). With one token per chunk, the common case, it is exact.
    """
    n = len(texts)
    if n == 0:
        return []
    surplus = total - n
    if surplus <= 0:
        return [1] * n
    extra = [max(0, len(tokenizer.encode(t, add_special_tokens=False)) - 1) for t in texts]
    if sum(extra) == 0:
        extra = [1] * n
    shares = [surplus * e / sum(extra) for e in extra]
    counts = [1 + int(s) for s in shares]
    left = total - sum(counts)
    by_remainder = sorted(range(n), key=lambda i: shares[i] - int(shares[i]), reverse=True)
    for i in by_remainder[:left]:
        counts[i] += 1
    return counts


def inter_token_latencies(result: RequestResult, counts: list[int]) -> list[float]:
    """Every gap between text chunks; a chunk of k tokens gives k gaps of (its gap / k), so
    the mean ITL and the TPOT measure the same per-token time."""
    itl: list[float] = []
    times = result.chunk_times
    for i in range(1, len(times)):
        gap = times[i] - times[i - 1]
        itl += [gap / counts[i]] * counts[i]
    return itl


@dataclass
class Summary:
    """What one run measured: latencies in ms per metric, throughput, counts."""

    completed: int
    failed: int
    wall_s: float
    prompt_tokens: int
    output_tokens: int
    chunks: int
    samples_ms: dict[str, list[float]]
    mean_in_flight: float
    first_error: str | None = None

    @property
    def request_throughput(self) -> float:
        """Completed requests per second."""
        return self.completed / self.wall_s

    @property
    def output_throughput(self) -> float:
        """Output tokens per second."""
        return self.output_tokens / self.wall_s

    @property
    def total_throughput(self) -> float:
        """Prompt and output tokens per second."""
        return (self.prompt_tokens + self.output_tokens) / self.wall_s

    def stat(self, metric: str, q: float | None = None) -> float | None:
        """The q-th percentile of a metric in ms (None: the mean); None without samples."""
        values = self.samples_ms[metric]
        if not values:
            return None
        return statistics.fmean(values) if q is None else float(np.percentile(values, q))


def summarize(results: list[RequestResult], wall: float, tokenizer: Any) -> Summary:
    """The run's latency samples in ms, throughput and counts over its completed requests."""
    ok = [r for r in results if r.ok]
    samples: dict[str, list[float]] = {"TTFT": [], "TPOT": [], "ITL": [], "E2E": []}
    chunks = 0
    for r in ok:
        assert r.ttft is not None and r.e2e is not None
        counts = tokens_per_chunk(r.chunk_texts, r.output_tokens, tokenizer)
        chunks += len(counts)
        samples["TTFT"].append(1e3 * r.ttft)
        samples["E2E"].append(1e3 * r.e2e)
        if r.tpot is not None:
            samples["TPOT"].append(1e3 * r.tpot)
        samples["ITL"] += [1e3 * x for x in inter_token_latencies(r, counts)]
    failed = [r for r in results if not r.ok]
    return Summary(
        completed=len(ok),
        failed=len(failed),
        wall_s=wall,
        prompt_tokens=sum(r.prompt_len for r in ok),
        output_tokens=sum(r.output_tokens for r in ok),
        chunks=chunks,
        samples_ms=samples,
        # Little's law: the average number of requests the server held during the run.
        mean_in_flight=sum(r.e2e or 0.0 for r in ok) / wall,
        first_error=next((r.error for r in failed), None),
    )
