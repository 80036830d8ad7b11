"""Log-probabilities in the scheduler: which rows of a step want them, and where the values go
once the step is processed (a request's prompt log-probabilities ride on its first token)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from minisgl.core import Batch, Req
from minisgl.engine import ForwardOutput
from minisgl.engine.logprobs import LogprobRows

from .output import InFlight


@dataclass
class LogprobPlan:
    """Which rows of a step get log-probabilities, decided once at launch (before the step
    moves cached_len): indices into the sampled requests, and each request's prompt span
    [start, end) in batch order."""

    indices: list[int]
    spans: list[tuple[Req, int, int]]

    def token_rows(self, sampled: list[Req], device: torch.device) -> LogprobRows | None:
        """The sampled rows whose requests want their tokens' log-probabilities."""
        if not self.indices:
            return None
        top_k = max(sampled[i].sampling_params.logprobs or 0 for i in self.indices)
        return LogprobRows(torch.tensor(self.indices, dtype=torch.int64).to(device), top_k)

    def prompt_rows(self, reqs: list[Req], device: torch.device) -> LogprobRows | None:
        """The prefill's token rows whose next prompt token's log-probability is wanted."""
        spans = {id(req): (start, end) for req, start, end in self.spans if end > start}
        if not spans:
            return None
        rows: list[torch.Tensor] = []
        targets: list[torch.Tensor] = []
        top_k, offset = 0, 0
        for req in reqs:
            if id(req) in spans:
                start, end = spans[id(req)]
                rows.append(torch.arange(offset, offset + end - start))
                targets.append(req.input_ids[start + 1 : end + 1].long())
                top_k = max(top_k, req.sampling_params.prompt_logprobs or 0)
            offset += req.extend_len
        return LogprobRows(torch.cat(rows).to(device), top_k, torch.cat(targets).to(device))


def prompt_logprob_span(req: Req) -> tuple[int, int] | None:
    """The positions [start, end) of this step whose next token is a prompt token the request
    wants the log-probability of; None when it wants none (or no longer: once its first token
    is out, a retracted request's re-prefill does not report them again)."""
    if req.sampling_params.prompt_logprobs is None or req.output_len > 0:
        return None
    return req.cached_len, max(req.cached_len, min(req.device_len, req.prompt_len - 1))


def logprob_plan(batch: Batch, sampled: list[Req]) -> LogprobPlan:
    """The step's LogprobPlan."""
    indices = [i for i, r in enumerate(sampled) if r.sampling_params.logprobs is not None]
    if batch.is_decode:
        return LogprobPlan(indices, [])
    spans = [(r, prompt_logprob_span(r)) for r in batch.reqs]
    return LogprobPlan(indices, [(r, *span) for r, span in spans if span is not None])


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
