"""cpu_kernels.py's sampling cases: greedy argmax of bf16 logits, temperature and top-p sampling,
and the repetition, frequency and presence penalties."""

from __future__ import annotations

import paths  # noqa: F401  (before minisgl: a checkout without `pip install -e .`)
import torch
from timing import Comparison, median_seconds

from minisgl.engine.sample import PenaltyArgs, SampleArgs, Sampler
from minisgl.kernel.cpu import CpuKernels

BF16 = torch.bfloat16


def argmax_case(kernels: CpuKernels, rows: int, vocab: int) -> Comparison:
    """Greedy sampling of bf16 logits: the C argmax vs a float32 copy and torch.max."""
    logits = torch.randn(rows, vocab, dtype=BF16)
    return (
        f"argmax, {rows} x {vocab} bf16 logits",
        "float() + max",
        median_seconds(lambda: logits.float().max(dim=-1).indices, 20),
        median_seconds(lambda: kernels.argmax(logits), 20),
    )


def sampling_cases(rows: int, vocab: int) -> list[Comparison]:
    """Sampling with temperature (and top-p) from float32 logits: `Sampler.sample` vs the
    plain PyTorch formulation it replaced (softmax, exponential_, full sort for top-p)."""
    logits = torch.randn(rows, vocab) * 6  # peaked, as a trained model's
    sampler = Sampler(vocab, torch.device("cpu"))
    pool = torch.zeros(rows, 1, dtype=torch.int32)
    temps, top_p = torch.full((rows, 1), 0.7), torch.full((rows, 1), 0.9)
    no_greedy = torch.zeros(rows, dtype=torch.bool)

    def plain(nucleus: bool) -> None:
        probs = torch.softmax(logits / temps, dim=-1)
        if nucleus:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(drop, 0))
        (probs / torch.empty_like(probs).exponential_()).max(dim=-1)

    cases = []
    for nucleus in (False, True):
        args = SampleArgs(False, no_greedy, temps, top_p=top_p if nucleus else None)
        cases.append(
            (
                f"sampling, temperature{' + top-p' if nucleus else ''}, {rows} x {vocab}",
                "PyTorch ops",
                median_seconds(lambda nucleus=nucleus: plain(nucleus), 5),
                median_seconds(lambda args=args: sampler.sample(logits, args, pool), 5),
            )
        )
    return cases


def penalties_case(rows: int, vocab: int, history: int) -> Comparison:
    """Presence, frequency and repetition penalties on every row (`history` tokens each, half
    generated): the sampler's pass over the history's entries vs the vocabulary-wide one."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=gen)
    pool = torch.randint(0, vocab, (rows, history), dtype=torch.int32, generator=gen)

    def column(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full((rows, 1), value, dtype=dtype)

    pen = PenaltyArgs(
        torch.arange(rows),
        torch.arange(rows),
        column(history // 2, torch.int64),
        column(history, torch.int64),
        column(0.5),
        column(0.3),
        column(1.1),
    )

    def dense() -> torch.Tensor:
        tokens = pool.long()
        known = torch.ones(rows, history)
        generated = (torch.arange(history) >= history // 2).float().expand(rows, -1)
        counts = logits.new_zeros(rows, vocab).scatter_add_(1, tokens, generated)
        seen = logits.new_zeros(rows, vocab).scatter_add_(1, tokens, known) > 0
        scaled = torch.where(logits > 0, logits / pen.repetition, logits * pen.repetition)
        out = torch.where(seen, scaled, logits) - pen.frequency * counts
        return out - pen.presence * (counts > 0).float()

    sampler = Sampler(vocab, torch.device("cpu"))
    return (
        f"penalties, {rows} x {vocab}, {history} tokens of history",
        "vocabulary-wide ops",
        median_seconds(dense, 5),
        median_seconds(lambda: sampler._apply_penalties(logits, pen, pool), 5),
    )
