"""Tensor parallelism, one invocation: minisgl offline at TP=1 and TP=2 (gloo) on the same
workloads, wall time and the ratio to TP=1. On one 2-core machine TP=2 gives each rank one
core and adds two all-reduces per layer and the step broadcast: it shows what the communication
costs, not a speed-up (that needs ranks on their own sockets or machines).

    python benchmark/tp.py                     # Qwen3-0.6B shape: decode batch 8 and W2
    python benchmark/tp.py --model qwen3-moe-random

(The default model's 9 heads do not split over 2 ranks.)

Figures only: nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import paths  # noqa: E402, F401  (before minisgl: a checkout without `pip install -e .`)
from machine import set_threads  # noqa: E402
from models import model_label, resolve_bench_model  # noqa: E402
from offline_runs import medians, timed_runs  # noqa: E402
from runners.minisgl import MinisglRunner  # noqa: E402
from workloads import OFFLINE_PRESETS, Shape, TokenSource, decode_shapes  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-0.6b-random", help="or qwen3-moe-random, a folder")
    p.add_argument("--tp-sizes", default="1,2")
    p.add_argument("--workloads", default="W2", help="comma list of W1/W2, or none")
    p.add_argument("--batch-sizes", default="8", help="decode batches (none: skip)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    set_threads(None)
    model = resolve_bench_model(args.model)
    shapes: list[Shape] = []
    if args.batch_sizes != "none":
        shapes += decode_shapes([int(b) for b in args.batch_sizes.split(",")], False)
    if args.workloads != "none":
        shapes += [OFFLINE_PRESETS[w] for w in args.workloads.split(",")]
    tokens = TokenSource(model, args.seed)
    run_args = argparse.Namespace(repeat=args.repeat, contention=0, full_warmup=False)
    rows = []
    for tp in map(int, args.tp_sizes.split(",")):
        runner = MinisglRunner(model, args.dtype, name=f"tp={tp}", max_seq_len=1024, tp_size=tp)
        try:
            per_shape = timed_runs(runner, shapes, tokens, run_args)
        finally:
            runner.close()
        rows.append((tp, [medians(runs)[0].wall_s for runs in per_shape]))
    cores = len(os.sched_getaffinity(0))
    print(f"# {model_label(model)} {args.dtype}, {cores} cores shared by the ranks")
    print("| TP | " + " | ".join(f"{s.describe()} s | vs TP=1" for s in shapes) + " |")
    print("|---|" + "---|---|" * len(shapes))
    base = rows[0][1]
    for tp, walls in rows:
        cells = [f"{wall:.2f} | {ref / wall:.2f}x" for wall, ref in zip(walls, base)]
        print(f"| {tp} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
