"""Host memory of loading a model: the RSS an engine adds, after load and at its peak.

Each model loads in a fresh process (so the peak is this load's): RSS is read before the
engine is built, after it (weights, KV pool, page table, rotary tables) and at its high-water
mark in between, and compared with the model's weights in the run's dtype and the KV pool.

Run from the repo root: `python benchmark/memory.py` (the default model and Qwen3-0.6B's shape,
about a minute); `--model` for one model, `--kv-tokens` for the pool.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from cli import base_parser
from models import QWEN3_RANDOM, model_label, resolve_bench_model
from report import format_table

MB = 2**20
# Issue 19's acceptance for Qwen3-0.6B's shape in bf16: what loading may add.
AFTER_LOAD_MARGIN_MB = 300
PEAK_OVER_WEIGHTS = 1.5


def measure_load(model_path: Path, dtype: str, kv_tokens: int, max_seq_len: int) -> dict[str, Any]:
    """Build one engine in this process; its RSS figures in bytes."""
    from minisgl.engine import Engine, EngineConfig
    from minisgl.kvcache import MHAKVCache
    from minisgl.llm.llm import parse_dtype
    from minisgl.models import load_model_config
    from minisgl.models.weight import checkpoint_bytes
    from minisgl.utils.memory import peak_rss_bytes, reset_peak_rss, rss_bytes

    torch_dtype = parse_dtype(dtype)
    config = load_model_config(model_path)
    kv_bytes = kv_tokens * MHAKVCache.bytes_per_slot(
        config.num_layers, config.num_kv_heads, config.head_dim, torch_dtype
    )
    before = rss_bytes()
    reset_peak_rss()
    engine = Engine(
        EngineConfig(
            str(model_path),
            dtype=torch_dtype,
            num_page_override=kv_tokens,
            max_seq_len_override=max_seq_len,
        )
    )
    after, peak = rss_bytes(), peak_rss_bytes()
    del engine
    return {
        "weights": checkpoint_bytes(model_path, torch_dtype, config.tie_word_embeddings),
        "kv": kv_bytes,
        "after": after - before,
        "peak": peak - before,
    }


def main(argv: list[str] | None = None) -> None:
    """Load each model in a child process (`--child`) and print the RSS table."""
    p = base_parser(__doc__ or "")
    p.add_argument("--kv-tokens", type=int, default=1024, help="KV pool slots (page size 1)")
    p.add_argument("--max-seq-len", type=int, default=2048, help="engine max_seq_len")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        figures = measure_load(Path(args.model), args.dtype, args.kv_tokens, args.max_seq_len)
        print(json.dumps(figures))
        return
    names = [args.model] if args.model else ["default", QWEN3_RANDOM]
    rows = []
    for name in names:
        path = resolve_bench_model(name)
        command = [sys.executable, __file__, "--child", "--model", str(path)]
        command += ["--dtype", args.dtype, "--kv-tokens", str(args.kv_tokens)]
        command += ["--max-seq-len", str(args.max_seq_len)]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        f = json.loads(done.stdout.strip().splitlines()[-1])
        bound = f["weights"] + f["kv"] + AFTER_LOAD_MARGIN_MB * MB
        rows.append(
            [
                model_label(path),
                f"{f['weights'] / MB:,.0f}",
                f"{f['kv'] / MB:,.0f}",
                f"{f['after'] / MB:,.0f}",
                f"{bound / MB:,.0f}",
                f"{f['peak'] / MB:,.0f}",
                f"{f['peak'] / f['weights']:.2f}x",
            ]
        )
    print(f"RSS added by building an engine ({args.dtype}, {args.kv_tokens} KV slots), MiB:")
    headers = ["model", "weights", "KV pool", "after load", "bound", "peak", "peak/weights"]
    print(format_table(headers, rows))
    print(
        f"bound: weights + KV pool + {AFTER_LOAD_MARGIN_MB} MB; "
        f"the peak's bound is {PEAK_OVER_WEIGHTS}x the weights"
    )


if __name__ == "__main__":
    main()
