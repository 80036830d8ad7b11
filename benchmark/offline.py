"""Offline throughput: minisgl vs Hugging Face transformers `generate` (vs vLLM CPU), one run.

Workloads (random token ids, never special tokens, the same for every engine; greedy, EOS
ignored, every request generates exactly its output length; all requests submitted at once):
- W1: 64 prompts x 128 tokens, 64 new tokens each.
- W2: 16 prompts x 512 tokens, 32 new tokens each.
- custom: --num-prompts/--input-len/--output-len, or uniform random lengths with
  --random-input-range A:B / --random-output-range A:B.
With --decode-batch-sizes 1,8,32 it measures decode instead: batches of 16-token prompts
generating 128 tokens, decode steps/s and tok/s next to the memory-bandwidth bound.

Each engine gets a warm-up (fresh ids) that is not timed; every timed repeat draws fresh ids
too, so minisgl's radix cache never serves a repeat from an earlier one. When other engines
run, minisgl runs first and again after them (a fresh engine, the same ids) and its figure is
the median over both sessions (the slower middle run for an even count), so a machine whose
speed drifts during the invocation favours neither side (--no-bracket: once, first). Prints a Markdown
table and writes a PNG and a JSON under benchmark/out/. Figures only: nothing is asserted.

With --contention N every engine (minisgl, HF, vLLM) runs its timed runs quiet and then again
with N busy-loop processes spinning on the last N CPUs (benchmark/contention.py), on ids of
their own (the same for every engine, so that minisgl's radix cache cannot serve them from the
quiet runs). The loops spin during the contended timed runs only, never during loading or
warm-ups; for vLLM, which runs everything in one subprocess, they wait stopped (SIGSTOP) and
are let go when its last quiet run of a shape reports its end. minisgl's contended runs are
bracketed like its quiet ones. A second table gives each engine's quiet and contended wall
time, its slowdown (contended / quiet) and minisgl's speed against it, quiet and contended;
the JSON marks contended runs with `contention: N`.

    python benchmark/offline.py                      # W1 on the default model (SmolLM2-135M)
    python benchmark/offline.py --workload W1,W2 --peer vllm --repeat 3
    python benchmark/offline.py --model qwen3-0.6b-random --decode-batch-sizes 1,8,32
    python benchmark/offline.py --quick              # a smoke test, < 1 minute
    python benchmark/offline.py --peer vllm --contention 1   # W1, quiet and one CPU busy
"""

from __future__ import annotations

import argparse
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    REFERENCE_MACHINE,
    HFRunner,
    Machine,
    MinisglRunner,
    Panel,
    PeerRun,
    Phases,
    RunResult,
    TokenSource,
    add_run_options,
    bar_chart,
    base_parser,
    exit_on_sigterm,
    format_table,
    machine_note,
    max_seq_len,
    measure_machine,
    median_run,
    model_cost,
    model_label,
    parse_run_args,
    resolve_bench_model,
    run_vllm_peer,
    save_json,
    set_threads,
    single_phase,
    stamp,
    total_kv_tokens,
)
from contention import BusyLoops, add_contention_option, check_contention, slowdown  # noqa: E402

from minisgl.llm.llm import parse_dtype  # noqa: E402

DECODE_INPUT_LEN = 16
DECODE_OUTPUT_LEN = 128
# Name prefix of the vLLM peer's contended runs (its results come back by run name).
CONTENDED = "contended:"


@dataclass(frozen=True)
class Shape:
    """A workload's shape: request count and (min, max) input/output lengths, uniform."""

    name: str
    num_prompts: int
    input_range: tuple[int, int]
    output_range: tuple[int, int]

    def describe(self) -> str:
        def span(r: tuple[int, int]) -> str:
            return str(r[0]) if r[0] == r[1] else f"{r[0]}-{r[1]}"

        return (
            f"{self.name} ({self.num_prompts}x{span(self.input_range)}->{span(self.output_range)})"
        )

    def phases(self, tokens: TokenSource, *stream: int | str) -> Phases:
        """One phase of random prompts; the stream (e.g. repeat index) picks fresh ids."""
        rng = tokens.rng(self.name, *stream)
        in_lens = rng.integers(self.input_range[0], self.input_range[1] + 1, self.num_prompts)
        out_lens = rng.integers(self.output_range[0], self.output_range[1] + 1, self.num_prompts)
        prompts = [tokens.draw(rng, int(n)) for n in in_lens]
        return single_phase(prompts, [int(n) for n in out_lens])

    def warmup(self, tokens: TokenSource, full: bool) -> Phases:
        """Same prompt shapes (fresh ids); unless `full`, at most 4 new tokens each."""
        phases = self.phases(tokens, "warmup")
        if not full:
            for r in phases[0]:
                r.max_tokens = min(r.max_tokens, 4)
        return phases


PRESETS = {
    "W1": Shape("W1", 64, (128, 128), (64, 64)),
    "W2": Shape("W2", 16, (512, 512), (32, 32)),
}
QUICK = Shape("quick", 8, (32, 32), (8, 8))


def parse_range(text: str) -> tuple[int, int]:
    """`A:B` (inclusive) or a single number."""
    lo, _, hi = text.partition(":")
    low, high = int(lo), int(hi or lo)
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"bad range {text!r}: want 1 <= A <= B")
    return low, high


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = base_parser(__doc__)
    p.add_argument(
        "--workload",
        default=None,
        help="comma-separated presets: W1 (default), W2; ignored with the shape options",
    )
    p.add_argument("--num-prompts", type=int, default=None, help="custom shape (default 64)")
    p.add_argument("--input-len", type=int, default=None, help="custom shape (default 128)")
    p.add_argument("--output-len", type=int, default=None, help="custom shape (default 64)")
    p.add_argument(
        "--random-input-range",
        type=parse_range,
        default=None,
        metavar="A:B",
        help="custom shape: input lengths uniform in [A, B]",
    )
    p.add_argument(
        "--random-output-range",
        type=parse_range,
        default=None,
        metavar="A:B",
        help="custom shape: output lengths uniform in [A, B]",
    )
    p.add_argument(
        "--decode-batch-sizes",
        default=None,
        metavar="1,8,32",
        help=f"decode mode: {DECODE_INPUT_LEN}-token prompts, {DECODE_OUTPUT_LEN} new tokens",
    )
    p.add_argument("--skip-hf", action="store_true", help="do not run the HF baseline")
    p.add_argument(
        "--reference-machine",
        action="store_true",
        help="roofline bounds from shared/PEERS.md's machine (35 GB/s, 0.97 TFLOP/s) instead of "
        "measuring this one",
    )
    p.add_argument(
        "--hf-batch-size", type=int, default=None, help="HF batch (default: all prompts at once)"
    )
    p.add_argument(
        "--full-warmup",
        action="store_true",
        help="warm up with whole workload (default: its prompts, 4 new tokens each)",
    )
    p.add_argument("--cache-type", default="radix", help="minisgl prefix cache: radix or naive")
    p.add_argument("--max-prefill-length", type=int, default=None, help="minisgl prefill budget")
    p.add_argument("--quick", action="store_true", help="tiny shapes: a smoke test, < 1 minute")
    p.add_argument(
        "--no-bracket",
        action="store_true",
        help="run minisgl once, first (default: also again after HF / vLLM, median of both)",
    )
    add_contention_option(p, "run every engine's timed runs")
    add_run_options(p)
    args = parse_run_args(p, argv)
    check_contention(p, args.contention)
    if args.contention and args.decode_batch_sizes:
        p.error("--contention measures the throughput workloads, not --decode-batch-sizes")
    return args


def pick_shapes(args: argparse.Namespace) -> list[Shape]:
    custom = [
        args.num_prompts,
        args.input_len,
        args.output_len,
        args.random_input_range,
        args.random_output_range,
    ]
    if any(v is not None for v in custom):
        in_range = args.random_input_range or (args.input_len or 128,) * 2
        out_range = args.random_output_range or (args.output_len or 64,) * 2
        return [Shape("custom", args.num_prompts or 64, in_range, out_range)]
    if args.quick:
        return [QUICK]
    names = (args.workload or "W1").upper().split(",")
    unknown = [n for n in names if n not in PRESETS]
    if unknown:
        sys.exit(f"unknown workload(s) {unknown}; choose from {sorted(PRESETS)}")
    return [PRESETS[n] for n in names]


def decode_shapes(args: argparse.Namespace) -> list[Shape]:
    sizes = [int(b) for b in args.decode_batch_sizes.split(",")]
    out_len = 16 if args.quick else DECODE_OUTPUT_LEN
    return [
        Shape(f"batch {b}", b, (DECODE_INPUT_LEN, DECODE_INPUT_LEN), (out_len, out_len))
        for b in sizes
    ]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


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
    runner: MinisglRunner | HFRunner,
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
    runner: MinisglRunner | HFRunner,
    shapes: list[Shape],
    tokens: TokenSource,
    args: argparse.Namespace,
) -> list[RunResult]:
    """Warm up, then the median of --repeat timed runs per shape (and contention level)."""
    return [m for runs in timed_runs(runner, shapes, tokens, args) for m in medians(runs)]


def run_vllm(
    model: Path, shapes: list[Shape], tokens: TokenSource, args: argparse.Namespace
) -> list[RunResult]:
    runs = []
    for shape in shapes:
        runs += [PeerRun(shape.describe(), shape.phases(tokens, r), r) for r in range(args.repeat)]
        if args.contention:
            runs += [
                PeerRun(CONTENDED + shape.describe(), contended_phases(shape, tokens, r), r)
                for r in range(args.repeat)
            ]
    # Every shape's warm-up, one after the other (a phase list runs in order).
    warmup = [phase for s in shapes for phase in s.warmup(tokens, args.full_warmup)]
    longest = max(max_seq_len(run.phases) for run in runs)
    # Stopped through the peer's start-up and warm-up: its first run is a quiet one.
    busy = BusyLoops(args.contention, paused=True) if args.contention else None

    def spin_for_next(done: int) -> None:
        """Run `done` has ended: spin while the next one runs if it is a contended one."""
        assert busy is not None
        busy.set_spinning(done + 1 < len(runs) and runs[done + 1].name.startswith(CONTENDED))

    with busy or nullcontext():
        results = run_vllm_peer(
            model,
            args.dtype,
            runs,
            warmup,
            max_model_len=max(1024, longest),
            enable_prefix_caching=False,
            kv_gb=args.vllm_kv_gb,
            threads=args.threads,
            log=log,
            after_run=spin_for_next if busy else None,
        )
    if results is None:
        return []
    for r in results:
        if r.workload.startswith(CONTENDED):
            r.workload = r.workload.removeprefix(CONTENDED)
            r.contention = args.contention
    return [m for s in shapes for m in medians([r for r in results if r.workload == s.describe()])]


def run_all(
    model: Path, shapes: list[Shape], tokens: TokenSource, args: argparse.Namespace
) -> list[RunResult]:
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


def report_throughput(
    results: list[RunResult],
    shapes: list[Shape],
    args: argparse.Namespace,
    model: Path,
    machine: Machine,
) -> None:
    rows = []
    quiet = [r for r in results if not r.contention]
    for shape in shapes:
        name = shape.describe()
        ours = next(r for r in quiet if r.workload == name and r.engine == "minisgl")
        for r in (r for r in quiet if r.workload == name):
            ratio = ours.output_tps / r.output_tps
            rows.append(
                [
                    name,
                    r.engine,
                    r.output_tps,
                    r.total_tps,
                    r.wall_s,
                    "1.00x" if r is ours else f"{ratio:.2f}x",
                    r.bad_lengths or "",
                ]
            )
    headers = [
        "workload",
        "engine",
        "out tok/s",
        "total tok/s",
        "wall s",
        "minisgl/this",
        "bad len",
    ]
    print(format_table(headers, rows))
    cost = model_cost(model, parse_dtype(args.dtype))
    for shape in shapes:
        ours = next(r for r in quiet if r.workload == shape.describe() and r.engine == "minisgl")
        # Prompt tokens served from the prefix cache pass no matmul.
        computed = ours.prompt_tokens - ours.cached_tokens
        floor = cost.matmul_seconds(computed, shape.num_prompts, ours.output_tokens, machine)
        print(
            f"floor: {shape.describe()}'s matmuls take >= {floor:.2f} s at "
            f"{machine.matmul_tflops:.2f} TFLOP/s ({machine.source}); minisgl's wall time is "
            f"{ours.wall_s / floor:.2f}x that"
        )
    if len(quiet) < len(results):
        report_contention(results, shapes)
    for r in results:
        if r.cached_tokens:
            print(
                f"note: {r.engine} served {r.cached_tokens} prompt tokens of {r.workload} from cache"
                + (f" ({r.contention} busy)" if r.contention else "")
            )

    def series_name(r: RunResult) -> str:
        return r.engine + (f", {r.contention} busy" if r.contention else "")

    groups = [s.describe() for s in shapes]
    series = {
        e: [
            next((r.output_tps for r in results if series_name(r) == e and r.workload == g), None)
            for g in groups
        ]
        for e in dict.fromkeys(series_name(r) for r in results)
    }
    png = args.out / f"offline-{model_label(model)}-{stamp()}.png"
    title = f"{model_label(model)} {args.dtype}: output tok/s (higher is better)"
    if bar_chart(png, title, [Panel(groups, series, "output tokens / s")]):
        print(f"plot: {png}")
    save_json(png.with_suffix(".json"), [r.to_json() for r in results])


def report_contention(results: list[RunResult], shapes: list[Shape]) -> None:
    """Per workload and engine: quiet and contended wall time, slowdown, minisgl against it."""
    rows = []
    for shape in shapes:
        # engine -> (quiet run, contended run)
        pairs: dict[str, list[RunResult | None]] = {}
        for r in (r for r in results if r.workload == shape.describe()):
            pairs.setdefault(r.engine, [None, None])[bool(r.contention)] = r
        ours = pairs["minisgl"]
        for engine, runs in pairs.items():
            walls = [None if r is None else r.wall_s for r in runs]
            # minisgl's output tok/s over this engine's, quiet and contended.
            speedups = [
                None
                if mine is None or theirs is None
                else f"{mine.output_tps / theirs.output_tps:.2f}x"
                for mine, theirs in zip(ours, runs)
            ]
            rows.append([shape.describe(), engine, *walls, slowdown(*walls), *speedups])
    level = max(r.contention for r in results)
    headers = [
        "workload",
        "engine",
        "quiet s",
        f"{level} busy s",
        "slowdown",
        "minisgl/this quiet",
        f"minisgl/this {level} busy",
    ]
    print(f"contention: {BusyLoops(level).describe()} during each engine's contended runs")
    print(format_table(headers, rows))


def report_decode(
    results: list[RunResult],
    shapes: list[Shape],
    args: argparse.Namespace,
    model: Path,
    machine: Machine,
) -> None:
    cost = model_cost(model, parse_dtype(args.dtype))
    print(
        f"bounds: {cost.params / 1e6:.1f}M params, {cost.weight_bytes / 1e6:.0f} MB of weights per "
        "decode step"
    )
    for m in dict.fromkeys((machine, REFERENCE_MACHINE)):  # once with --reference-machine
        print(
            f"  at {m.describe()}: <= {cost.bandwidth_steps_per_s(m):.1f} steps/s by bandwidth, "
            f"matmuls <= {cost.compute_tok_per_s(m):,.0f} tok/s"
        )
    bw = cost.bandwidth_steps_per_s(machine)
    rows = []
    for shape in shapes:
        bound = cost.roofline_tok_per_s(shape.num_prompts, machine)
        for r in (r for r in results if r.workload == shape.describe()):
            steps = r.decode_steps_per_s
            if steps is None and r.engine.startswith("vLLM"):
                steps = r.extra.get("decode_steps_per_s")
            tok = None if steps is None else steps * shape.num_prompts
            rows.append(
                [
                    shape.num_prompts,
                    r.engine,
                    steps,
                    tok,
                    None if tok is None else f"{100 * tok / bound:.0f}%",
                    min(bw, cost.compute_tok_per_s(machine) / shape.num_prompts),
                    r.output_tps,
                ]
            )
    headers = [
        "batch",
        "engine",
        "decode steps/s",
        "decode tok/s",
        "of bound",
        "bound steps/s",
        "e2e out tok/s",
    ]
    print(format_table(headers, rows))
    engines = list(dict.fromkeys(r.engine for r in results))
    groups = [s.describe() for s in shapes]
    series: dict[str, list[float | None]] = {}
    for e in engines:
        series[e] = []
        for s in shapes:
            row = next((r for r in rows if r[0] == s.num_prompts and r[1] == e), None)
            series[e].append(None if row is None else row[3])
    png = args.out / f"decode-{model_label(model)}-{stamp()}.png"
    title = f"{model_label(model)} {args.dtype}: decode tok/s by batch size"
    bounds = [cost.roofline_tok_per_s(s.num_prompts, machine) for s in shapes]
    panel = Panel(groups, series, "decode tokens / s", bounds=bounds, bound_label="roofline bound")
    if bar_chart(png, title, [panel]):
        print(f"plot: {png}")
    save_json(png.with_suffix(".json"), [r.to_json() for r in results])


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
    results = run_vllm_peer(
        model,
        args.dtype,
        runs,
        [phase for s in shapes for phase in s.warmup(tokens, args.full_warmup)],
        max_model_len=1024,
        enable_prefix_caching=False,
        kv_gb=args.vllm_kv_gb,
        threads=args.threads,
        log=log,
    )
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


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    exit_on_sigterm()
    model = resolve_bench_model(args.model)
    tokens = TokenSource(model, args.seed)
    set_threads(args.threads)
    print(f"# offline benchmark: {model_label(model)} ({model}), {args.dtype}")
    print(f"# machine: {machine_note()}")
    machine = (
        REFERENCE_MACHINE if args.reference_machine else measure_machine(parse_dtype(args.dtype))
    )
    print(f"# roofline figures: {machine.describe()}")
    peers = list(args.peer)
    if args.decode_batch_sizes:
        shapes = decode_shapes(args)
        args.peer = []  # vLLM's decode rate needs its own pair of runs, below
        results = run_all(model, shapes, tokens, args)
        if "vllm" in peers:
            results += vllm_decode_rates(model, shapes, tokens, args)
        report_decode(results, shapes, args, model, machine)
    else:
        shapes = pick_shapes(args)
        results = run_all(model, shapes, tokens, args)
        report_throughput(results, shapes, args, model, machine)
    if "vllm" in peers and not any(r.engine.startswith("vLLM") for r in results):
        print("vLLM peer: ABSENT or failed (see above); its rows are missing.")


if __name__ == "__main__":
    main()
