"""The command-line options the benchmark scripts share: the model and dtype of every script,
and the engine, peer and output options of offline.py and prefix.py."""

from __future__ import annotations

import argparse
from pathlib import Path

from models import QWEN3_RANDOM
from paths import OUT_DIR


def base_parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark shares (--model, --dtype)."""
    p = argparse.ArgumentParser(
        description=doc.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(doc.split("\n\n")[1:]),
    )
    p.add_argument(
        "--model",
        default=None,
        help=f"default model when omitted; '{QWEN3_RANDOM}' (built once); or an HF folder/GGUF",
    )
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 (default), float32, float16")
    return p


def add_no_bracket_option(p: argparse.ArgumentParser, default: str) -> None:
    """`--no-bracket`; `default` says when minisgl runs again after the other engines."""
    p.add_argument(
        "--no-bracket",
        action="store_true",
        help=f"run minisgl once, first (default{default}, median of both)",
    )


def add_run_options(p: argparse.ArgumentParser) -> None:
    """Options offline.py and prefix.py share: KV page size, peers, repeats, seed, threads, out."""
    p.add_argument("--page-size", type=int, default=1, help="minisgl KV page size")
    p.add_argument("--peer", action="append", default=[], choices=["vllm"], help="also run a peer")
    p.add_argument("--vllm-kv-gb", type=float, default=4.0, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--repeat", type=int, default=1, help="timed runs per engine (median)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for every engine (default: one per available core)",
    )
    p.add_argument("--out", type=Path, default=OUT_DIR, help="where the PNG and JSON go")


def parse_run_args(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse, rejecting a --repeat below 1."""
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    return args
