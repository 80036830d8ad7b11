"""The quantized-weight kernels' wrappers (csrc/quantized.c): x @ W^T for a weight held as small
integers and per-group scales (layers/quant_weight.py's layout), and rows of such a weight
dequantized (an embedding lookup)."""

from __future__ import annotations

import ctypes

import torch

from minisgl.kernel.abi import (
    DTYPE_CODES,
    QuantizedWeightParams,
    check_status,
    output_rows,
    raise_not_contiguous,
)
from minisgl.kernel.library import KernelLibrary
from minisgl.kernel.threads import kernel_threads


def quantized_weight_params(
    values: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    bits: int,
    group: int,
    tiled: bool = False,
) -> QuantizedWeightParams:
    """The C view of a quantized weight's tensors (which the caller keeps alive); tiled: in
    the tile layout (layers/quant_tiles.py)."""
    for name, tensor in (("values", values), ("scales", scales), ("mins", mins)):
        if tensor is not None and not tensor.is_contiguous():
            raise_not_contiguous("quantized weight", **{name: tensor})
    return QuantizedWeightParams(
        values=values.data_ptr(),
        scales=scales.data_ptr(),
        mins=None if mins is None else mins.data_ptr(),
        bits=bits,
        group=group,
        scales_f32=int(scales.dtype == torch.float32),
        tiled=int(tiled),
    )


class QuantizedKernels(KernelLibrary):
    """x @ W^T and row lookups for quantized weights (float32 or bfloat16 activations)."""

    def quantized_linear(
        self,
        x: torch.Tensor,
        weight: QuantizedWeightParams,
        shape: tuple[int, int],
        bias: torch.Tensor | None,
        float_out: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [M, K] @ W^T (+ bias in x's dtype) for W [N, K] = `shape`; out in x's dtype
        (float32 with float_out), into `out` when given."""
        rows, in_features = x.shape
        out_features = shape[0]
        if not (x.is_contiguous() and (bias is None or bias.is_contiguous())):
            raise_not_contiguous("quantized_linear", x=x, bias=bias)
        if x.dtype not in DTYPE_CODES or in_features != shape[1]:
            raise ValueError(f"quantized_linear: x {x.dtype} {tuple(x.shape)} for a weight {shape}")
        out = output_rows(x, out_features, torch.float32 if float_out else x.dtype, out)
        status = self.lib.minisgl_quantized_linear(
            x.data_ptr(),
            ctypes.byref(weight),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            rows,
            out_features,
            in_features,
            DTYPE_CODES[x.dtype],
            int(float_out),
            kernel_threads(),
        )
        check_status("quantized_linear", status)
        return out

    def quantized_rows(
        self,
        weight: QuantizedWeightParams,
        shape: tuple[int, int],
        ids: torch.Tensor,
        dtype: torch.dtype,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rows `ids` of W [N, K] = `shape` dequantized: [count, K] in `dtype` (into `out`, a
        contiguous tensor of that shape and dtype, when given)."""
        ids = ids.to(torch.int64).contiguous()
        if out is None:
            out = torch.empty(ids.numel(), shape[1], dtype=dtype)
        elif out.shape != (ids.numel(), shape[1]) or out.dtype != dtype or not out.is_contiguous():
            raise ValueError(f"quantized_rows: out {out.dtype} {tuple(out.shape)} for {shape}")
        status = self.lib.minisgl_quantized_rows(
            ctypes.byref(weight),
            ids.data_ptr(),
            out.data_ptr(),
            ids.numel(),
            shape[0],
            shape[1],
            DTYPE_CODES[dtype],
            kernel_threads(),
        )
        if status != 0:
            bad = ids[(ids < 0) | (ids >= shape[0])]
            if len(bad):
                raise IndexError(f"quantized_rows: row {int(bad[0])} outside [0, {shape[0]})")
            check_status("quantized_rows", status)
        return out
