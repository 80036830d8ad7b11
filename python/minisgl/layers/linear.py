"""Dense projection; fused projections (qkv, gate_up) are one Linear with stacked rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.kernel.cpu import CpuKernels

from .activation import silu_and_mul

# Rows per call decide the CPU matmul (benchmark/kernels.py, offline.py --decode-batch-sizes):
# the C GEMV for a few rows (bandwidth-bound at 1-4 rows, ~1.2-3x oneDNN's bf16 there; at 5-8
# level with the packed matmul without tiles, so it keeps up to GEMV_MAX_ROWS there), then the C
# packed matmul: on the AMX tiles 1.3-1.6x oneDNN at 5-64 rows, 1.5x the GEMV at 5-8, 1.3x at
# 1,024; with vdpbf16ps (Zen 5) level with oneDNN on Qwen3's shapes and 1.1-1.3x on SmolLM2's at
# 16-128 rows, within 5% at 2,048. It also fuses SiLU into gate_up and lets the C decode layer
# take any batch. Other dtypes and CPUs: oneDNN's packed layout (float32 included: PyTorch's
# F.linear runs MKL's sgemm, which on AMD CPUs takes a generic path 2-3x slower than oneDNN).
GEMV_MAX_ROWS = 8
AMX_GEMV_MAX_ROWS = 4
CPU_PROJECTION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def onednn_packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


def onednn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed copy of a weight [N, K], or None where this CPU's oneDNN cannot pack its
    dtype (float16 needs avx_ne_convert or avx512_fp16)."""
    if not onednn_packing_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, 64)
    except RuntimeError:
        return None


def interleave_gate_up(rows: torch.Tensor) -> torch.Tensor:
    """A gate_up weight (or bias) [2 * inter, ...] with its gate and up rows interleaved in 16s
    (gate 0-15, up 0-15, gate 16-31, ...): the layout the AMX gated kernel packs from."""
    inter = rows.shape[0] // 2
    blocks = torch.arange(inter).view(-1, 16)
    return rows[torch.stack((blocks, blocks + inter), dim=1).flatten()]


class CpuProjection:
    """How a weight is multiplied on the CPU, by rows per call: with avx512_bf16 and a bf16
    weight, the C GEMV for a few rows and above them the C packed matmul over a copy in the
    tile layout (on the AMX tiles where the CPU has them, else vdpbf16ps); otherwise (float32,
    float16, CPUs without avx512_bf16) oneDNN's packed copy, or F.linear where oneDNN cannot
    pack the dtype. Without the GEMV only the packed copy is kept.

    gated (a gate_up projection): the tile copy holds gate and up interleaved, for
    `silu_and_mul`, which then runs every call above the GEMV's rows with SiLU in the matmul's
    epilogue; plain calls take the GEMV or F.linear. float_out (an output head): every call
    takes the packed matmul and returns its float32 sums unrounded, so logits a bf16 rounding
    would tie keep their order."""

    def __init__(
        self,
        weight: torch.Tensor,
        kernels: CpuKernels | None,
        gated: bool = False,
        bias: torch.Tensor | None = None,
        float_out: bool = False,
    ) -> None:
        bf16 = weight.dtype == torch.bfloat16
        # Only with the bf16 dot-product instructions do the C matmuls beat oneDNN.
        usable = kernels is not None and kernels.has_avx512_bf16 and bf16
        self.kernels = kernels if usable else None
        self.out_features = weight.shape[0]
        on_tiles = self.kernels is not None and self.kernels.has_amx
        self.float_out = float_out and self.kernels is not None
        self.gemv_max_rows = AMX_GEMV_MAX_ROWS if on_tiles else GEMV_MAX_ROWS
        if self.float_out:
            self.gemv_max_rows = 0
        self.packed: torch.Tensor | None = None
        self.gated = gated and self.kernels is not None and weight.shape[0] % 32 == 0
        self.gated_bias: torch.Tensor | None = None
        if self.kernels is None:
            self.packed = onednn_pack(weight)
        elif self.gated:
            self.packed = self.kernels.pack_weight(interleave_gate_up(weight))
            self.gated_bias = None if bias is None else interleave_gate_up(bias).contiguous()
        else:
            self.packed = self.kernels.pack_weight(weight)

    @property
    def tiles(self) -> torch.Tensor | None:
        """The copy in the tile layout the C matmuls read (None: oneDNN's or no copy)."""
        return self.packed if self.kernels is not None else None

    @property
    def needs_weight(self) -> bool:
        return self.kernels is not None or self.packed is None

    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x @ weight^T (+ bias); `out` [rows, out_features] takes the result where the C packed
        matmul computes it (else a new tensor is returned)."""
        rows = x.shape[0] if x.dim() == 2 else -1
        if self.kernels is not None and 0 <= rows <= self.gemv_max_rows:
            return self.kernels.gemv_bf16(x.contiguous(), weight, bias)
        if self.gated:  # the tile copy is interleaved: only silu_and_mul reads it
            return F.linear(x, weight, bias)
        if self.kernels is not None and self.packed is not None and rows >= 0:
            return self.kernels.packed_linear(
                x.contiguous(), self.packed, self.out_features, bias, self.float_out, out
            )
        if self.kernels is None and self.packed is not None:  # oneDNN's copy takes any shape
            return torch.ops.mkldnn._linear_pointwise(
                x.contiguous(), self.packed, bias, "none", [], ""
            )
        return F.linear(x, weight, bias)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """The gated activation straight from the packed matmul, where this projection has it
        for this many rows; else None."""
        if not self.gated or x.dim() != 2 or x.shape[0] <= self.gemv_max_rows:
            return None
        assert self.kernels is not None and self.packed is not None
        return self.kernels.packed_gated_silu(
            x.contiguous(), self.packed, self.out_features // 2, self.gated_bias
        )


class Linear(nn.Module):
    """y = x W^T + b, weights filled by the loader. gated: a gate_up projection ([gate; up]
    rows), which also offers `silu_and_mul`."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, gated: bool = False
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.gated = in_features, out_features, gated
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.cpu_projection: CpuProjection | None = None

    def prepare_for_cpu(self, kernels: CpuKernels | None) -> None:
        """Pick the CPU matmul path for the weight (after loading)."""
        if self.weight.device.type == "cpu" and self.weight.dtype in CPU_PROJECTION_DTYPES:
            bias = None if self.bias is None else self.bias.data
            self.cpu_projection = CpuProjection(self.weight.data, kernels, self.gated, bias)
            if not self.cpu_projection.needs_weight:  # the packed copy replaces the weight
                self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_projection is not None:
            return self.cpu_projection(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a gated projection: fused on the CPU where it can be."""
        assert self.gated
        if self.cpu_projection is not None:
            fused = self.cpu_projection.silu_and_mul(x)
            if fused is not None:
                return fused
        return silu_and_mul(self(x))
