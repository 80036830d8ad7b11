"""Log-probabilities in the scheduler: which rows of a step want them, and where the values go
once the step is processed (a request's prompt log-probabilities ride on its first token)."""

from __future__ import annotations

from typing import Any

import torch

from minisgl.core import Batch, Req
from minisgl.engine import ForwardOutput
from minisgl.engine.logprobs import LogprobRows

from .output import InFlight


def logprob_rows(sampled: list[Req], device: torch.device) -> LogprobRows | None:
    """The sampled rows whose requests want their tokens' log-probabilities."""
    wanted = [i for i, r in enumerate(sampled) if r.sampling_params.logprobs is not None]
    if not wanted:
        return None
    top_k = max(sampled[i].sampling_params.logprobs or 0 for i in wanted)
    return LogprobRows(torch.tensor(wanted, dtype=torch.int64).to(device), top_k)


def prompt_logprob_span(req: Req) -> tuple[int, int] | None:
    """The positions [start, end) of this step whose next token is a prompt token the request
    wants the log-probability of; None when it wants none (or no longer: once its first token
    is out, a retracted request's re-prefill does not report them again)."""
    if req.sampling_params.prompt_logprobs is None or req.output_len > 0:
        return None
    return req.cached_len, max(req.cached_len, min(req.device_len, req.prompt_len - 1))


def prompt_logprob_rows(reqs: list[Req], device: torch.device) -> LogprobRows | None:
    """The prefill's token rows whose next prompt token's log-probability is wanted."""
    rows: list[torch.Tensor] = []
    targets: list[torch.Tensor] = []
    top_k, offset = 0, 0
    for req in reqs:
        span = prompt_logprob_span(req)
        if span is not None and span[1] > span[0]:
            start, end = span
            rows.append(torch.arange(offset, offset + end - start))
            targets.append(req.input_ids[start + 1 : end + 1].long())
            top_k = max(top_k, req.sampling_params.prompt_logprobs or 0)
        offset += req.extend_len
    if not rows:
        return None
    return LogprobRows(torch.cat(rows).to(device), top_k, torch.cat(targets).to(device))


def logprob_plan(batch: Batch, sampled: list[Req]) -> tuple[list[int], list[tuple[Req, int, int]]]:
    """At launch (before the step moves cached_len): the indices into sampled that get token
    log-probabilities, and each request's prompt span, in the order `prompt_logprob_rows`
    lays out their rows."""
    indices = [i for i, r in enumerate(sampled) if r.sampling_params.logprobs is not None]
    if batch.is_decode:
        return indices, []
    spans = [(r, prompt_logprob_span(r)) for r in batch.reqs]
    return indices, [(r, *span) for r, span in spans if span is not None]


def collect_logprobs(step: InFlight, output: ForwardOutput) -> dict[int, list[Any]]:
    """A processed step's log-probabilities as Python values: each prompt span's appended to
    its request's `prompt_logprobs`; the sampled tokens' returned by index into step.sampled."""
    entries = output.prompt_logprobs.tolist() if output.prompt_logprobs is not None else []
    offset = 0
    for req, start, end in step.prompt_spans:
        gathered = req.prompt_logprobs if req.prompt_logprobs is not None else []
        if start == 0:  # the first token: nothing precedes it, so no logprob
            gathered.append([int(req.input_ids[0]), None, []])
        ids = req.input_ids[start + 1 : end + 1].tolist()
        chunk = entries[offset : offset + end - start]
        gathered.extend([token, lp, top] for token, (lp, top) in zip(ids, chunk))
        req.prompt_logprobs = gathered
        offset += end - start
    if output.logprobs is None:
        return {}
    return dict(zip(step.logprob_indices, output.logprobs.tolist()))
