"""serving.py's offline reference: the decode step time of `minisgl.llm.LLM` at the server's
batch size on the same shapes, which the server's TPOT is divided by."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

from phases import Phases, single_phase
from results import median_run
from runners.minisgl import MinisglRunner
from serving_client import WARMUP_TOKENS
from serving_server import engine_sizes
from workloads import TokenSource


def offline_batch(args: argparse.Namespace) -> int | None:
    """The batch size the server runs at steadily: the concurrency cap, or every request when
    all arrive at once; None for an uncapped Poisson rate (the batch size then wanders)."""
    if args.max_concurrency is not None:
        return min(args.max_concurrency, args.num_prompts)
    return args.num_prompts if math.isinf(args.request_rate) else None


@dataclass
class OfflineStep:
    """The offline engine's decode step at one batch size (median of the runs)."""

    batch: int
    step_s: float
    runs_s: list[float]

    @property
    def tok_per_s(self) -> float:
        """Decode tokens per second at the batch size."""
        return self.batch / self.step_s

    @staticmethod
    def merged(*measures: OfflineStep) -> OfflineStep:
        """One measure from several sessions: the median step over all their runs (the faster
        middle one for an even count)."""
        runs = [step for measure in measures for step in measure.runs_s]
        return OfflineStep(measures[0].batch, sorted(runs)[(len(runs) - 1) // 2], runs)


def offline_decode_step(
    model: Path, tokens: TokenSource, args: argparse.Namespace, batch: int
) -> OfflineStep:
    """Decode step time of `minisgl.llm.LLM` with `batch` requests of the served shape.

    All requests are submitted at once, so after their prefill every decode step runs at
    exactly `batch`; the step time is the decode forwards' span (first start to last end, the
    scheduler's work between steps included, as in a server step) over their count. The
    engine is sized like the server this script starts (same context length and KV pool).
    """
    seq, kv_tokens = engine_sizes(args)
    runner = MinisglRunner(model, args.dtype, max_seq_len=seq, kv_tokens=kv_tokens)
    try:

        def phases(*stream: int | str) -> Phases:
            rng = tokens.rng("offline", *stream)
            prompts = [tokens.draw(rng, args.input_len) for _ in range(batch)]
            return single_phase(prompts, [args.output_len] * batch)

        warm = phases("warmup")
        for r in warm[0]:
            r.max_tokens = WARMUP_TOKENS + 4  # a few decode steps at the batch size
        runner.run(warm, "warmup")
        runs = [runner.run(phases(k), f"offline batch {batch}") for k in range(args.repeat)]
    finally:
        runner.close()
    steps = [r.decode_s / r.decode_steps for r in runs if r.decode_s and r.decode_steps]
    if not steps:
        raise RuntimeError("the offline run had no decode steps")
    best = median_run(runs)
    assert best.decode_s and best.decode_steps
    return OfflineStep(batch, best.decode_s / best.decode_steps, steps)
