"""The C CPU kernels against the PyTorch ops they replace, on SmolLM2-135M's shapes (or any).

Each row times both sides in this process on the same inputs and prints the ratio
(PyTorch time / kernel time). Weights cycle through all layers, so they come from memory as
in a real decode step, not from cache.

Run from the repo root: `python benchmark/cpu_kernels.py` (about a minute). The cases are in
kernels_layers.py (projections, MLP, norms), kernels_attention.py and kernels_sampling.py.
"""

from __future__ import annotations

import argparse
import sys

import paths  # noqa: F401  (before minisgl: a checkout without `pip install -e .`)
import torch
from kernels_attention import attention_case, prefill_attention_case, shared_prefix_case
from kernels_layers import (
    elementwise_cases,
    float32_case,
    gated_case,
    gemv_case,
    packed_case,
    streamed_case,
)
from kernels_sampling import argmax_case, penalties_case, sampling_cases
from timing import Comparison

from minisgl.kernel.cpu import cpu_kernels
from minisgl.layers.linear import c_matmuls_take, onednn_pack

BF16 = torch.bfloat16


def main() -> None:
    """Time every case the CPU supports and print the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = cpu_kernels()
    if kernels is None:
        sys.exit("CPU kernels unavailable here (no gcc, not x86-64 Linux, or disabled)")
    print(
        f"# {torch.get_num_threads()} threads, avx512_bf16: {kernels.has_avx512_bf16}, "
        f"amx: {kernels.has_amx}"
    )
    q_width = args.heads * args.head_dim
    kv_width = args.kv_heads * args.head_dim
    shapes = [(q_width + 2 * kv_width, args.hidden), (args.hidden, q_width)]
    shapes += [(2 * args.intermediate, args.hidden), (args.hidden, args.intermediate)]
    rows: list[Comparison] = []
    if kernels.has_avx512_bf16:
        weights = [
            torch.randn(n, k, dtype=BF16) * 0.02 for _ in range(args.layers) for n, k in shapes
        ]
        onednn = [onednn_pack(w) for w in weights]
        packed = None if any(p is None for p in onednn) else [p for p in onednn if p is not None]
        rows += [gemv_case(kernels, weights, packed, n) for n in (1, 2, 4)]
        rows += [streamed_case(kernels, weights, n) for n in (1, 2, 4, 8)]
        if packed is not None:
            rows += [packed_case(kernels, weights, packed, n) for n in (16, 32, 64, 256, 2048)]
    elif c_matmuls_take(BF16, kernels):  # AVX2: the tile copy widened in registers
        weights = [
            torch.randn(n, k, dtype=BF16) * 0.02 for _ in range(args.layers) for n, k in shapes
        ]
        copies = [c for c in (onednn_pack(w.float()) for w in weights) if c is not None]
        if len(copies) == len(weights):
            row_counts = (1, 2, 4, 8, 16, 64, 256, 2048)
            rows += [packed_case(kernels, weights, copies, n, True) for n in row_counts]
        del weights, copies
    weights32 = [torch.randn(n, k) * 0.02 for _ in range(args.layers) for n, k in shapes]
    packed32 = [p for p in map(onednn_pack, weights32) if p is not None]
    if len(packed32) == len(weights32):
        rows += [float32_case(weights32, packed32, n) for n in (1, 16, 64, 2048)]
    del weights32, packed32
    rows += [attention_case(kernels, args, b, c) for b, c in ((1, 1024), (16, 512), (64, 192))]
    if kernels.blocked_attention_fits(BF16, args.head_dim):
        rows += [shared_prefix_case(kernels, args, t, 1024) for t in (63, 2016)]
        rows += [prefill_attention_case(kernels, args, r, t) for r, t in ((16, 128), (1, 2048))]
    if c_matmuls_take(BF16, kernels) and args.intermediate % 16 == 0:
        rows += [gated_case(kernels, args, t) for t in (64, 2048)]
    rows.append(argmax_case(kernels, 64, 49152))
    rows += sampling_cases(64, 151936)
    rows.append(penalties_case(64, 151936, 256))
    for tokens in (1, 64, 2048):
        rows += elementwise_cases(kernels, tokens, args.hidden, args.intermediate)
    print("| operation | baseline | baseline ms | kernel ms | speedup |")
    print("|-----------|----------|-------------|-----------|---------|")
    for label, name, base, kernel in rows:
        print(
            f"| {label} | {name} | {base * 1e3:.3f} | {kernel * 1e3:.3f} | {base / kernel:.2f}x |"
        )


if __name__ == "__main__":
    main()
