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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cli import add_no_bracket_option, add_run_options, base_parser, parse_run_args  # noqa: E402
from contention import add_contention_option, check_contention  # noqa: E402
from machine import REFERENCE_MACHINE, machine_note, measure_machine, set_threads  # noqa: E402
from models import model_label, resolve_bench_model  # noqa: E402
from offline_report import report_decode, report_throughput  # noqa: E402
from offline_runs import run_all, vllm_decode_rates  # noqa: E402
from processes import exit_on_sigterm  # noqa: E402
from workloads import (  # noqa: E402
    DECODE_INPUT_LEN,
    DECODE_OUTPUT_LEN,
    OFFLINE_PRESETS,
    QUICK_OFFLINE,
    Shape,
    TokenSource,
    decode_shapes,
)

from minisgl.layers.quantized import LOAD_QUANTIZATIONS  # noqa: E402
from minisgl.llm.llm import parse_dtype  # noqa: E402


def parse_range(text: str) -> tuple[int, int]:
    """`A:B` (inclusive) or a single number."""
    lo, _, hi = text.partition(":")
    low, high = int(lo), int(hi or lo)
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"bad range {text!r}: want 1 <= A <= B")
    return low, high


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see --help); --contention with --decode-batch-sizes is an error."""
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
    p.add_argument(
        "--quantization",
        default=None,
        choices=list(LOAD_QUANTIZATIONS),
        help="minisgl quantizes its projections at load (the peers run the checkpoint's dtype); "
        "every format side by side, GGUF and llama.cpp too: benchmark/quantized.py",
    )
    p.add_argument("--quick", action="store_true", help="tiny shapes: a smoke test, < 1 minute")
    add_no_bracket_option(p, ": also again after HF / vLLM")
    add_contention_option(p, "run every engine's timed runs")
    add_run_options(p)
    args = parse_run_args(p, argv)
    check_contention(p, args.contention)
    if args.contention and args.decode_batch_sizes:
        p.error("--contention measures the throughput workloads, not --decode-batch-sizes")
    return args


def pick_shapes(args: argparse.Namespace) -> list[Shape]:
    """The custom shape when any shape option is given, else --quick's, else the presets."""
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
        return [QUICK_OFFLINE]
    names = (args.workload or "W1").upper().split(",")
    unknown = [n for n in names if n not in OFFLINE_PRESETS]
    if unknown:
        sys.exit(f"unknown workload(s) {unknown}; choose from {sorted(OFFLINE_PRESETS)}")
    return [OFFLINE_PRESETS[n] for n in names]


def main(argv: list[str] | None = None) -> None:
    """Measure the engines on the chosen shapes and print the tables."""
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
        shapes = decode_shapes([int(b) for b in args.decode_batch_sizes.split(",")], args.quick)
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
