"""Quantized projections against the bf16 ones they replace, on a model's decoder-layer shapes
(the Qwen3-0.6B shape by default): per row count, the time of a layer's four projections as the
engine multiplies them in bf16 on this CPU and from each quantized layout through the C
kernel (tiled: with int8 activations where the CPU has VNNI, int16 ones with AVX2; and then
the row layout's kernels too) and through dequantize + oneDNN, and the ratio bf16 / quantized. "w8a8" is the int8
weights with `--quantization int8`'s activations (above 5 rows, where the kernels tile the
weight: int8 per 32 columns with VNNI, per row on AMX-INT8's tiles; the "int8" columns are
`int8-wo`'s). Beside w8a8, oneDNN's int8 matmul through torch (`torch._int_mm`, SGLang's and
vLLM's CPU W8A8 scheme: x rounded to int8 per row, one weight scale per row, int32 sums scaled
once): the whole call in torch ops, and its matmul alone (what a fused rounding and epilogue
could approach).

Weights cycle through --layers layers, so they come from memory as in a decode step. Figures
only: `python benchmark/kernels_quantized.py` (about a minute); --rows 1,8,64.
"""

from __future__ import annotations

import argparse
import sys

import paths  # noqa: F401  (before minisgl: a checkout without `pip install -e .`)
import torch
from timing import median_seconds

from minisgl.kernel.cpu import cpu_kernels
from minisgl.layers.linear import CpuProjection, computes_in_float32
from minisgl.layers.quant_weight import quantize_int8
from minisgl.layers.quantized import QuantizedProjection, int8_group, quantize

BF16 = torch.bfloat16
FORMATS = ("int8", "w8a8", "int4-g32", "int4-g128")


def layer_shapes(args: argparse.Namespace) -> list[tuple[int, int]]:
    """[out, in] of qkv, o, gate_up and down."""
    q_width, kv_width = args.heads * args.head_dim, args.kv_heads * args.head_dim
    return [
        (q_width + 2 * kv_width, args.hidden),
        (args.hidden, q_width),
        (2 * args.intermediate, args.hidden),
        (args.hidden, args.intermediate),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=3072)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4, help="weights cycled through (from memory)")
    p.add_argument("--rows", default="1,4,8,16,32,64,128")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = cpu_kernels()
    if kernels is None:
        sys.exit("needs the C kernels (an x86-64 or aarch64 CPU and gcc)")
    torch.manual_seed(0)
    weights = [
        torch.randn(shape, dtype=BF16) * 0.02
        for _ in range(args.layers)
        for shape in layer_shapes(args)
    ]
    dense = [CpuProjection(w, kernels) for w in weights]
    formats = args.formats.split(",")

    def method(f: str) -> str:
        return "int8" if f == "w8a8" else f

    quantized = {
        f: [
            quantize(w.float(), method(f), int8_group(method(f), kernels, w.shape[1]))
            for w in weights
        ]
        for f in formats
    }
    # oneDNN's int8 route: one scale per weight row, the weight [K, N] as _int_mm takes it.
    per_row = [quantize_int8(w.float()) for w in weights] if "w8a8" in formats else []
    int_mm_weights = [(q.values.t(), q.scales[:, 0]) for q in per_row]
    projections = {
        f: [QuantizedProjection(q, kernels, int8_activations=f == "w8a8") for q in qs]  # type: ignore[arg-type]
        for f, qs in quantized.items()
    }
    # Where the C kernels tile the weights (VNNI, AVX2), the row layout's kernels too, to compare.
    row_layout = {
        f: [QuantizedProjection(q, kernels, tiled=False) for q in qs]  # type: ignore[arg-type]
        for f, qs in quantized.items()
        if kernels.reads_tiles
    }
    print(
        f"# {torch.get_num_threads()} threads, avx512_bf16: {kernels.has_avx512_bf16}, "
        f"vnni: {kernels.has_vnni}, amx: {kernels.has_amx}, {args.layers} layers"
    )
    mb = sum(w.numel() for w in weights[:4]) * 2 / 1e6
    print(f"# one layer's projections: {mb:.1f} MB in bf16; times are per layer, in µs")
    header = "| rows | bf16 |"
    rows_cell = " {f} rows C |" if row_layout else ""
    header += "".join(
        (" {f} C |" + rows_cell + " {f} dequant | bf16/{f} |").format(f=f) for f in formats
    )
    if int_mm_weights:
        header += " oneDNN int8 | its matmul alone | bf16/oneDNN int8 |"
    print(header)
    columns = 2 + (4 if row_layout else 3) * len(formats) + (3 if int_mm_weights else 0)
    print("|" + "---|" * columns)
    for rows in map(int, args.rows.split(",")):
        xs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=BF16) for w in weights}
        base = median_seconds(lambda xs=xs: bf16(weights, dense, xs), args.repeat)
        base = base / args.layers * 1e6
        cells = [f"{rows}", f"{base:.0f}"]
        for f in formats:
            projs = projections[f]
            c_time = median_seconds(lambda p=projs, xs=xs: on_kernel(p, xs), args.repeat)
            deq = median_seconds(
                lambda p=projs, xs=xs: dequantized(p, xs), max(3, args.repeat // 3)
            )
            c_time, deq = c_time / args.layers * 1e6, deq / args.layers * 1e6
            cells.append(f"{c_time:.0f}")
            if row_layout:
                rows_time = median_seconds(
                    lambda p=row_layout[f], xs=xs: on_kernel(p, xs), args.repeat
                )
                cells.append(f"{rows_time / args.layers * 1e6:.0f}")
            cells += [f"{deq:.0f}", f"{base / min(c_time, deq):.2f}x"]
        if int_mm_weights:
            whole = median_seconds(lambda xs=xs: int_mm(int_mm_weights, xs), args.repeat)
            xq = {k: torch.randint(-127, 128, x.shape, dtype=torch.int8) for k, x in xs.items()}
            alone = median_seconds(lambda xq=xq: int_mm_alone(int_mm_weights, xq), args.repeat)
            whole, alone = whole / args.layers * 1e6, alone / args.layers * 1e6
            cells += [f"{whole:.0f}", f"{alone:.0f}", f"{base / whole:.2f}x"]
        print("| " + " | ".join(cells) + " |", flush=True)


def bf16(weights: list[torch.Tensor], dense: list[CpuProjection], xs: dict) -> None:
    """Every bf16 weight as the engine multiplies it on this CPU (the C kernels' packed copy
    with avx512_bf16, else oneDNN's, in float32 where oneDNN packs no bf16)."""
    for w, proj in zip(weights, dense):
        proj(xs[w.shape[1]], w, None)


def on_kernel(projections: list[QuantizedProjection], xs: dict) -> None:
    """Every quantized weight through the C kernel as it is."""
    for proj in projections:
        assert proj.kernels is not None
        proj.kernels.quantized_linear(xs[proj.in_features], proj.params, proj.shape, None)


def dequantized(projections: list[QuantizedProjection], xs: dict) -> None:
    """Every quantized weight dequantized, then oneDNN (in float32 where it has no bf16)."""
    for proj in projections:
        x = xs[proj.in_features]
        dtype = torch.float32 if computes_in_float32(BF16, proj.kernels) else BF16
        torch.nn.functional.linear(x.to(dtype), proj.dequantized(dtype)).to(BF16)


def int_mm(weights: list[tuple[torch.Tensor, torch.Tensor]], xs: dict) -> None:
    """Every weight through oneDNN's int8 matmul: x rounded to int8 per row, the int32 sums
    scaled by the row's and the weight row's scales, bf16 out."""
    for values, scales in weights:
        x = xs[values.shape[0]].float()
        x_scale = (x.abs().amax(dim=1, keepdim=True) / 127).clamp_min(1e-12)
        xq = torch.round(x / x_scale).to(torch.int8)
        (torch._int_mm(xq, values).float() * x_scale * scales).to(BF16)


def int_mm_alone(weights: list[tuple[torch.Tensor, torch.Tensor]], xq: dict) -> None:
    """oneDNN's int8 matmul alone on x already int8 (no rounding, no scaling)."""
    for values, _ in weights:
        torch._int_mm(xq[values.shape[0]], values)


if __name__ == "__main__":
    main()
