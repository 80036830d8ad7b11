"""cpu_kernels.py's cases for the projections and the MLP: GEMV, packed and streamed matmuls, the
float32 projection, gate_up with SiLU, residual + RMSNorm and SiLU-and-mul."""

from __future__ import annotations

import argparse

import paths  # noqa: F401  (before minisgl: a checkout without `pip install -e .`)
import torch
import torch.nn.functional as F
from timing import Comparison, median_seconds

from minisgl.kernel.cpu import CpuKernels
from minisgl.layers.linear import interleave_gate_up

BF16 = torch.bfloat16


def gemv_case(
    kernels: CpuKernels, weights: list[torch.Tensor], packed: list[torch.Tensor] | None, rows: int
) -> Comparison:
    """`rows` input rows through every weight: the C GEMV vs oneDNN (packed) or F.linear."""
    xs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=BF16) for w in weights}

    def gemv() -> None:
        for w in weights:
            kernels.gemv_bf16(xs[w.shape[1]], w, None)

    def baseline() -> None:
        for i, w in enumerate(weights):
            x = xs[w.shape[1]]
            if packed is None:
                F.linear(x, w)
            else:
                torch.ops.mkldnn._linear_pointwise(x, packed[i], None, "none", [], "")

    mbytes = sum(w.numel() * 2 for w in weights) / 1e6
    name = "F.linear" if packed is None else "oneDNN packed"
    return (
        f"GEMV {rows} row(s), {mbytes:.0f} MB of weights",
        name,
        median_seconds(baseline, 5),
        median_seconds(gemv, 5),
    )


def packed_case(
    kernels: CpuKernels,
    weights: list[torch.Tensor],
    packed: list[torch.Tensor],
    rows: int,
    float32_copies: bool = False,
) -> Comparison:
    """`rows` input rows through every weight: the C packed matmul (AMX tiles, vdpbf16ps, or
    on AVX2 FMA widening the copy in registers) vs oneDNN's packed copies, bf16 or
    (`float32_copies`, what layers/linear.py ran on AVX2 before: twice the bytes) float32."""
    xs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=BF16) for w in weights}
    tiles = [kernels.pack_weight(w) for w in weights]

    def kernel() -> None:
        for w, t in zip(weights, tiles):
            kernels.packed_linear(xs[w.shape[1]], t, w.shape[0], None)

    def baseline() -> None:
        for w, p in zip(weights, packed):
            x = xs[w.shape[1]].float() if float32_copies else xs[w.shape[1]]
            y = torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
            if float32_copies:
                y.to(BF16)

    mbytes = sum(w.numel() * 2 for w in weights) / 1e6
    products = "AMX" if kernels.has_amx else "vdpbf16ps" if kernels.has_avx512_bf16 else "AVX2 FMA"
    label = f"packed matmul ({products}) {rows} rows, {mbytes:.0f} MB of weights"
    name = "oneDNN float32 copy" if float32_copies else "oneDNN packed"
    return label, name, median_seconds(baseline, 5), median_seconds(kernel, 5)


def streamed_case(kernels: CpuKernels, weights: list[torch.Tensor], rows: int) -> Comparison:
    """`rows` input rows through every weight as the engine multiplies a few rows: vdpbf16ps
    streaming the tile copy (the weight's only copy) vs the C GEMV over the row-major weight
    (what it ran while it kept both)."""
    xs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=BF16) for w in weights}
    tiles = [kernels.pack_weight(w) for w in weights]

    def kernel() -> None:
        for w, t in zip(weights, tiles):
            kernels.packed_linear(xs[w.shape[1]], t, w.shape[0], None, tiles=False)

    def baseline() -> None:
        for w in weights:
            kernels.gemv_bf16(xs[w.shape[1]], w, None)

    mbytes = sum(w.numel() * 2 for w in weights) / 1e6
    label = f"tile copy streamed (vdpbf16ps) {rows} row(s), {mbytes:.0f} MB of weights"
    return label, "C GEMV, row-major", median_seconds(baseline, 5), median_seconds(kernel, 5)


def float32_case(weights: list[torch.Tensor], packed: list[torch.Tensor], rows: int) -> Comparison:
    """float32 projections, `rows` input rows through every weight: oneDNN's packed copy (what
    layers/linear.py runs for float32) vs F.linear (MKL's sgemm, a generic path on AMD)."""
    xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}

    def onednn() -> None:
        for w, p in zip(weights, packed):
            torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")

    def baseline() -> None:
        for w in weights:
            F.linear(xs[w.shape[1]], w)

    mbytes = sum(w.numel() * 4 for w in weights) / 1e6
    label = f"float32 projection (oneDNN packed) {rows} rows, {mbytes:.0f} MB of weights"
    return label, "F.linear", median_seconds(baseline, 5), median_seconds(onednn, 5)


def gated_case(kernels: CpuKernels, args: argparse.Namespace, tokens: int) -> Comparison:
    """gate_up projection + SiLU-and-mul over every layer: one packed matmul with SiLU in its
    store vs the packed matmul and the separate kernel."""
    weights = [
        torch.randn(2 * args.intermediate, args.hidden, dtype=BF16) * 0.02
        for _ in range(args.layers)
    ]
    plain = [kernels.pack_weight(w) for w in weights]
    gated = [kernels.pack_weight(interleave_gate_up(w)) for w in weights]
    x = torch.randn(tokens, args.hidden, dtype=BF16)

    def kernel() -> None:
        for packed in gated:
            kernels.packed_gated_silu(x, packed, args.intermediate, None)

    def baseline() -> None:
        for packed in plain:
            kernels.silu_and_mul(kernels.packed_linear(x, packed, 2 * args.intermediate, None))

    label = f"gate_up + SiLU, {tokens} rows, {args.layers} layers"
    return label, "packed matmul + SiLU", median_seconds(baseline, 5), median_seconds(kernel, 5)


def elementwise_cases(
    kernels: CpuKernels, tokens: int, hidden: int, inter: int
) -> list[Comparison]:
    """Residual + RMSNorm and SiLU-and-mul on `tokens` rows: kernel vs the PyTorch ops."""
    x = torch.randn(tokens, hidden, dtype=BF16)
    residual = torch.randn(tokens, hidden, dtype=BF16)
    weight = torch.rand(hidden, dtype=BF16)
    gate_up = torch.randn(tokens, 2 * inter, dtype=BF16)

    def torch_norm() -> None:
        h32 = (residual + x).float()
        weight * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(BF16)

    def torch_silu() -> None:
        F.silu(gate_up[:, :inter]) * gate_up[:, inter:]

    return [
        (
            f"residual + RMSNorm, {tokens} x {hidden}",
            "PyTorch ops",
            median_seconds(torch_norm, 20),
            median_seconds(lambda: kernels.add_rms_norm(x, residual, weight, 1e-5), 20),
        ),
        (
            f"SiLU-and-mul, {tokens} x {inter}",
            "PyTorch ops",
            median_seconds(torch_silu, 20),
            median_seconds(lambda: kernels.silu_and_mul(gate_up), 20),
        ),
    ]
