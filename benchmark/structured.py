"""Structured output's cost on the decode step: a batch whose every request is held to a JSON
schema (its token mask filled by xgrammar and applied to the batch's logits each step) against
the same batch unconstrained, median step time of each and the ratio.

The constrained requests are greedy and must write an array of exactly --digits digits, so
both runs decode about the same number of steps at the same batch size.

    .venv/bin/python benchmark/structured.py                    # batch 8, default model
    .venv/bin/python benchmark/structured.py --batch-size 32 --repeat 5
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import paths  # noqa: F401  (makes minisgl importable from a plain checkout)
import torch
from cli import base_parser
from machine import machine_note, set_threads
from models import model_label, resolve_bench_model
from report import format_table, log

from minisgl.core import SamplingParams, StructuredOutput
from minisgl.llm import LLM


def decode_steps_s(llm: LLM, params: list[SamplingParams], prompt: list[int]) -> list[float]:
    """Seconds of each step after the batch's prefill (scheduling and masks included)."""
    for sp in params:
        llm.add_request(prompt, sp)
    times: list[float] = []
    prefilled = False
    while llm.has_work:
        start = time.perf_counter()
        llm.step()
        if prefilled:
            times.append(time.perf_counter() - start)
        prefilled = prefilled or not (llm.waiting or llm.chunked)
    return times[:-1]  # the last step only hands back what the one before computed


def main(argv: list[str] | None = None) -> None:
    p = base_parser(__doc__ or "")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--digits", type=int, default=48, help="array length the schema requires")
    p.add_argument("--repeat", type=int, default=3, help="alternated runs of each (median)")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    set_threads(args.threads)
    path = resolve_bench_model(args.model)
    dtype = getattr(torch, args.dtype)
    llm = LLM(str(path), dtype=dtype, max_seq_len_override=512)
    digit = {"type": "integer", "minimum": 0, "maximum": 9}
    schema = {"type": "array", "items": digit, "minItems": args.digits, "maxItems": args.digits}
    structured = StructuredOutput("json", json.dumps(schema))
    prompt = llm.tokenizer("Write a JSON array of digits:").input_ids
    free = [SamplingParams(max_tokens=2 * args.digits + 1, ignore_eos=True)] * args.batch_size
    held = [SamplingParams(max_tokens=4 * args.digits, structured=structured)] * args.batch_size
    decode_steps_s(llm, held, prompt)  # warm-up: the grammar compiled and cached
    medians: dict[str, list[float]] = {"unconstrained": [], "json schema": []}
    steps: dict[str, int] = {}
    for _ in range(args.repeat):
        for name, params in (("unconstrained", free), ("json schema", held)):
            times = decode_steps_s(llm, params, prompt)
            medians[name].append(statistics.median(times))
            steps[name] = len(times)
            log(f"{name}: {len(times)} steps, median {1e3 * medians[name][-1]:.2f} ms")
    base = statistics.median(medians["unconstrained"])
    rows = []
    for name, values in medians.items():
        step = statistics.median(values)
        rows.append([name, steps[name], f"{1e3 * step:.2f}", f"{step / base:.2f}x"])
    print(f"# structured output: {model_label(path)}, {args.dtype}, batch {args.batch_size}")
    print(f"# machine: {machine_note()}")
    print(format_table(["run", "decode steps", "median step ms", "vs unconstrained"], rows))
    llm.shutdown()


if __name__ == "__main__":
    sys.exit(main())
