"""Decode tok/s with overlap scheduling on and off, per batch size, on one model.

Prints one row per batch size and the on/off ratio; the default in
minisgl.scheduler.config.OVERLAP_DEFAULT should be the faster mode for the device.
"""

from __future__ import annotations

import argparse
import statistics
import time

import paths  # noqa: F401  (before minisgl: a checkout without `pip install -e .`)
import torch

from minisgl.core import SamplingParams
from minisgl.llm import LLM


def decode_tok_per_s(llm: LLM, batch_size: int, output_len: int, prompt_len: int) -> float:
    """Output tok/s of the decode phase alone (prefill steps are excluded from the timing)."""
    generator = torch.Generator().manual_seed(batch_size)
    prompts = [
        torch.randint(1000, 20000, (prompt_len,), generator=generator).tolist()
        for _ in range(batch_size)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for ids in prompts:
        llm.add_request(ids, params)
    decode_start = None
    produced = 0
    while llm.has_work:
        outputs = llm.step()
        if decode_start is None and not llm.waiting and llm.chunked is None:
            decode_start, produced = time.perf_counter(), 0
            continue
        produced += sum(o.token is not None for o in outputs)
    assert decode_start is not None
    return produced / (time.perf_counter() - decode_start)


def main() -> None:
    """Measure every batch size with overlap off, then on, and print the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF folder (default: the default model)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3, help="median of this many runs")
    args = parser.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    results: dict[tuple[bool, int], float] = {}
    for overlap in (False, True):
        llm = LLM(
            args.model,
            dtype=args.dtype,
            overlap_schedule=overlap,
            max_seq_len_override=1024,
            cache_type="naive",
        )
        decode_tok_per_s(llm, 4, 8, args.prompt_len)  # warm-up
        for bs in batch_sizes:
            runs = [
                decode_tok_per_s(llm, bs, args.output_len, args.prompt_len)
                for _ in range(args.repeat)
            ]
            results[(overlap, bs)] = statistics.median(runs)
        llm.shutdown()
    print(f"{'batch':>5} {'overlap off tok/s':>18} {'overlap on tok/s':>17} {'on/off':>7}")
    for bs in batch_sizes:
        off, on = results[(False, bs)], results[(True, bs)]
        print(f"{bs:>5} {off:>18.1f} {on:>17.1f} {on / off:>7.2f}")


if __name__ == "__main__":
    main()
