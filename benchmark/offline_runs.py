"""How offline.py runs its engines: warm-up and repeats per shape, quiet and contended runs,
minisgl bracketing HF and vLLM, and vLLM's decode rate from a pair of runs."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

from contention import BusyLoops
from phases import Phases, max_seq_len, total_kv_tokens
from report import log
from results import RunResult, median_run
from runners.base import PhaseRunner
from runners.hf import HFRunner
from runners.minisgl import MinisglRunner
from runners.vllm import PeerRun, run_vllm_peer
from workloads import Shape, TokenSource

# Name prefix of the vLLM peer's contended runs (its results come back by run name).
CONTENDED = "contended:"


def contended_phases(shape: Shape, tokens: TokenSource, repeat: int) -> Phases:
    """A contended run's workload: the shape's, on ids of its own."""
    return shape.phases(tokens, "contended", repeat)


def describe_walls(runs: list[RunResult]) -> str:
    """`3.31, 3.35 s` or, with contended runs, `3.31 s quiet, 7.02 s with 1 busy`."""
    parts = []
    for level in sorted({r.contention for r in runs}):
        walls = ", ".join(f"{r.wall_s:.2f}" for r in runs if r.contention == level)
        parts.append(f"{walls} s" + (f" with {level} busy" if level else ""))
    return parts[0] if len(parts) == 1 else f"{parts[0]} quiet, " + ", ".join(parts[1:])


def timed_runs(
    runner: PhaseRunner,
    shapes: list[Shape],
    tokens: TokenSource,
    args: argparse.Namespace,
) -> list[list[RunResult]]:
    """Warm up, then --repeat timed runs per shape; with --contention N as many again with N
    busy loops spinning (those runs marked with `contention`)."""
    per_shape = []
    for shape in shapes:
        runner.run(shape.warmup(tokens, args.full_warmup), "warmup")
        runs = [runner.run(shape.phases(tokens, r), shape.describe()) for r in range(args.repeat)]
        if args.contention:
            with BusyLoops(args.contention):
                contended = [
                    runner.run(contended_phases(shape, tokens, r), shape.describe())
                    for r in range(args.repeat)
                ]
            for run in contended:
                run.contention = args.contention
            runs += contended
        for run in runs:
            run.extra.pop("outputs", None)
        log(f"  {runner.name} {shape.describe()}: {describe_walls(runs)}")
        per_shape.append(runs)
    return per_shape


def medians(runs: list[RunResult], upper: bool = False) -> list[RunResult]:
    """The median run of each contention level among `runs`, quiet first."""
    levels = sorted({r.contention for r in runs})
    return [median_run([r for r in runs if r.contention == level], upper) for level in levels]


def run_engine(
    runner: PhaseRunner,
    shapes: list[Shape],
    tokens: TokenSource,
    args: argparse.Namespace,
) -> list[RunResult]:
    """Warm up, then the median of --repeat timed runs per shape (and contention level)."""
    return [m for runs in timed_runs(runner, shapes, tokens, args) for m in medians(runs)]


def run_vllm(
    model: Path, shapes: list[Shape], tokens: TokenSource, args: argparse.Namespace
) -> list[RunResult]:
    """The vLLM peer's median run per shape (and contention level); [] when it is absent."""
    runs = []
    for shape in shapes:
        runs += [PeerRun(shape.describe(), shape.phases(tokens, r), r) for r in range(args.repeat)]
        if args.contention:
            runs += [
                PeerRun(CONTENDED + shape.describe(), contended_phases(shape, tokens, r), r)
                for r in range(args.repeat)
            ]
    longest = max(max_seq_len(run.phases) for run in runs)
    # Stopped through the peer's start-up and warm-up: its first run is a quiet one.
    busy = BusyLoops(args.contention, paused=True) if args.contention else None

    def spin_for_next(done: int) -> None:
        """Run `done` has ended: spin while the next one runs if it is a contended one."""
        assert busy is not None
        busy.set_spinning(done + 1 < len(runs) and runs[done + 1].name.startswith(CONTENDED))

    with busy or nullcontext():
        results = _vllm_runs(
            model,
            shapes,
            tokens,
            args,
            runs,
            max(1024, longest),
            spin_for_next if busy else None,
        )
    if results is None:
        return []
    for r in results:
        if r.workload.startswith(CONTENDED):
            r.workload = r.workload.removeprefix(CONTENDED)
            r.contention = args.contention
    return [m for s in shapes for m in medians([r for r in results if r.workload == s.describe()])]


def _vllm_runs(
    model: Path,
    shapes: list[Shape],
    tokens: TokenSource,
    args: argparse.Namespace,
    runs: list[PeerRun],
    max_model_len: int,
    after_run: Callable[[int], None] | None = None,
) -> list[RunResult] | None:
    """The runs on the vLLM peer, without prefix caching, after every shape's warm-up (one
    after the other: a phase list runs in order)."""
    return run_vllm_peer(
        model,
        args.dtype,
        runs,
        [phase for s in shapes for phase in s.warmup(tokens, args.full_warmup)],
        max_model_len=max_model_len,
        enable_prefix_caching=False,
        kv_gb=args.vllm_kv_gb,
        threads=args.threads,
        log=log,
        after_run=after_run,
        out_dir=args.out,
    )


def run_all(
    model: Path, shapes: list[Shape], tokens: TokenSource, args: argparse.Namespace
) -> list[RunResult]:
    """minisgl, HF (unless --skip-hf), vLLM (with --peer vllm), then minisgl again unless
    --no-bracket; the median run of each engine per shape and contention level."""
    samples = [shape.phases(tokens, 0) for shape in shapes]
    seq_len = max(max_seq_len(p) for p in samples)
    results: list[RunResult] = []

    def minisgl_session() -> list[list[RunResult]]:
        log(f"minisgl: loading {model}")
        minisgl = MinisglRunner(
            model,
            args.dtype,
            max_seq_len=seq_len,
            # The largest workload's requests all resident at once, with room to spare.
            kv_tokens=int(1.25 * max(total_kv_tokens(p) for p in samples)) + 64,
            cache_type=args.cache_type,
            page_size=args.page_size,
            max_prefill_length=args.max_prefill_length,
            quantization=args.quantization,
        )
        try:
            return timed_runs(minisgl, shapes, tokens, args)
        finally:
            minisgl.close()

    ours = minisgl_session()
    if not args.skip_hf:
        log("HF transformers: loading")
        hf = HFRunner(model, args.dtype, args.hf_batch_size)
        results += run_engine(hf, shapes, tokens, args)
        hf.close()
    if "vllm" in args.peer:
        results += run_vllm(model, shapes, tokens, args)
    if results and not args.no_bracket:
        log("minisgl: again, after the others (the machine's speed drifts)")
        ours = [first + again for first, again in zip(ours, minisgl_session())]
        # An even count of runs: the slower middle one, never the flattering one.
        return [m for runs in ours for m in medians(runs, upper=True)] + results
    return [m for runs in ours for m in medians(runs)] + results


def vllm_decode_rates(
    model: Path, shapes: list[Shape], tokens: TokenSource, args: argparse.Namespace
) -> list[RunResult]:
    """vLLM reports no per-step times: time N and 1 new tokens, decode = the difference."""
    runs = []
    for shape in shapes:
        for r in range(args.repeat):
            full = shape.phases(tokens, r)
            first = shape.phases(tokens, "prefill-only", r)
            for req in first[0]:
                req.max_tokens = 1
            runs += [
                PeerRun(shape.describe(), full, r),
                PeerRun("prefill:" + shape.describe(), first, r),
            ]
    results = _vllm_runs(model, shapes, tokens, args, runs, max_model_len=1024)
    if results is None:
        return []
    out = []
    for shape in shapes:
        full = median_run([r for r in results if r.workload == shape.describe()])
        prefill = median_run([r for r in results if r.workload == "prefill:" + shape.describe()])
        steps = shape.output_range[0] - 1
        if full.wall_s > prefill.wall_s:
            full.extra["decode_steps_per_s"] = steps / (full.wall_s - prefill.wall_s)
        out.append(full)
    return out
