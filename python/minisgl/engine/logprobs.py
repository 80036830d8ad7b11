"""Log-probabilities of the model's raw next-token distribution (before temperature, penalties
and filters, as vLLM's default `raw_logprobs`), computed for the whole batch at once: of each
sampled token with its top alternatives, and in prefill of each prompt token."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from minisgl.kernel.ops import ops_for

from .sample import SampleArgs

# Prompt rows whose logits are materialised at once: 128 x 151,936 float32 is 78 MB.
PROMPT_ROWS_PER_SLICE = 128


@dataclass
class LogprobRows:
    """Which rows of a step want log-probabilities: `rows` index the sampled logits (generated
    tokens) or the step's hidden states (prompt tokens, whose `targets` are the next prompt
    tokens); `top_k` is the most alternatives any of them asked for."""

    rows: torch.Tensor  # [R] int64
    top_k: int
    targets: torch.Tensor | None = None  # [R] int64, prompt rows only


@dataclass
class TokenLogprobs:
    """Per row: the token's log-probability and the top_k most likely tokens' (largest first)."""

    logprobs: torch.Tensor  # [R] float32
    top_ids: torch.Tensor  # [R, top_k] int64
    top_logprobs: torch.Tensor  # [R, top_k] float32

    def tolist(self) -> list[list]:
        """[token logprob, [[alternative id, logprob], ...]] per row, as Python values."""
        chosen = self.logprobs.tolist()
        ids, values = self.top_ids.tolist(), self.top_logprobs.tolist()
        return [[lp, [list(pair) for pair in zip(i, v)]] for lp, i, v in zip(chosen, ids, values)]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top_k: int) -> TokenLogprobs:
    """Log-softmax of logits [R, vocab] in float32: each row's value at tokens [R] and its top_k.
    A token outside the vocabulary (a row flagged -1) reads column 0."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    safe = tokens.long().clamp(0, logits.shape[-1] - 1)
    chosen = logprobs.gather(1, safe[:, None])[:, 0]
    if top_k > 0:
        # (the C selection where there is one: topk took 135 of a batch-1 step's 232 µs)
        top_logprobs, top_ids = ops_for(logprobs).top_candidates(logprobs, top_k)
    else:
        top_logprobs = logprobs.new_empty(len(logprobs), 0)
        top_ids = torch.empty(len(logprobs), 0, dtype=torch.int64, device=logprobs.device)
    return TokenLogprobs(chosen, top_ids, top_logprobs)


def processed_logits(adjusted: torch.Tensor, args: SampleArgs) -> torch.Tensor:
    """The logits the sampler draws from (`Sampler.adjusted_logits`, then divided by the
    temperature), with what top-k, top-p and min-p drop at -inf; greedy rows unscaled."""
    x = adjusted if args.temperatures is None else adjusted / args.temperatures
    if args.top_k is not None or args.top_p is not None:
        ordered, order = x.sort(dim=-1, descending=True)
        drop = torch.zeros_like(ordered, dtype=torch.bool)
        if args.top_k is not None:
            ranks = torch.arange(ordered.shape[-1], device=x.device)[None, :]
            drop |= ranks >= args.top_k
        if args.top_p is not None:
            probs = torch.softmax(ordered, dim=-1)
            drop |= probs.cumsum(dim=-1) - probs >= args.top_p  # the first always stays
        x = x.scatter(1, order, ordered.masked_fill(drop, float("-inf")))
    if args.min_p is not None:
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < args.min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return x


def prompt_token_logprobs(
    hidden: torch.Tensor, spec: LogprobRows, head: Callable[[torch.Tensor], torch.Tensor]
) -> TokenLogprobs:
    """The prompt rows' log-probabilities of their next prompt token, from hidden states [T,
    hidden] through the output head, a slice of rows at a time (a whole prompt's logits would
    be [prompt, vocab])."""
    assert spec.targets is not None
    parts = []
    for start in range(0, len(spec.rows), PROMPT_ROWS_PER_SLICE):
        rows = spec.rows[start : start + PROMPT_ROWS_PER_SLICE]
        logits = head(hidden.index_select(0, rows))
        targets = spec.targets[start : start + PROMPT_ROWS_PER_SLICE]
        parts.append(token_logprobs(logits, targets, spec.top_k))
    return TokenLogprobs(
        torch.cat([p.logprobs for p in parts]),
        torch.cat([p.top_ids for p in parts]),
        torch.cat([p.top_logprobs for p in parts]),
    )
