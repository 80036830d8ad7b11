"""The quantized-weight kernels' wrappers (csrc/quantized.c): x @ W^T for a weight held as small
integers and per-group scales (layers/quant_weight.py's layout), and rows of such a weight
dequantized (an embedding lookup)."""

from __future__ import annotations

import ctypes

import torch

from minisgl.kernel.abi import (
    DTYPE_CODES,
    QUANTIZED_PATHS,
    QuantizedWeightParams,
    check_status,
    output_rows,
    raise_not_contiguous,
)
from minisgl.kernel.library import KernelLibrary
from minisgl.kernel.threads import kernel_threads

# Where the CPU has AMX, rows from which bf16 activations meet a tiled weight on the tiles as
# they are, each 32 weight rows dequantized to bf16 in L2 (csrc/quantized_amx.c), instead of in
# int8 products: from 10 rows the dequantization, shared by every row, costs less than a
# product per row (csrc/internal.h's QUANTIZED_AMX_MIN_ROWS; benchmark/kernels_quantized.py).
QUANTIZED_AMX_MIN_ROWS = 10
# W8A8 (csrc/quantized_w8a8.c): rows above which bf16 activations meet an int8 weight with one
# scale per row as int8 (on the AMX int8 tiles, else in vpdpbusd), and the widest in_features
# it takes.
W8A8_MIN_ROWS, W8A8_MAX_K = 5, 65536


def quantized_fits(bits: int, group: int, in_features: int, tiled: bool) -> bool:
    """Whether the kernels take a quantized weight of this layout: csrc/quantized.c's
    minisgl_quantized_fits, which every quantized kernel checks (tests/test_kernel_fuzz.py holds
    the two equal). Row layout: 8 bits in groups of 16s, 4 bits in 64-column blocks with groups
    of 32 or of 64s; the tile layout also whole 32-column blocks, and 6 bits in groups of 16s."""
    if in_features <= 0 or group <= 0 or in_features % group:
        return False
    if tiled and bits == 6:
        return group % 16 == 0 and in_features % 32 == 0
    rows_fit = (bits == 8 and group % 16 == 0) or (
        bits == 4 and in_features % 64 == 0 and (group == 32 or group % 64 == 0)
    )
    return rows_fit and (not tiled or in_features % 32 == 0)


def w8a8_fits(bits: int, group: int, in_features: int, has_mins: bool) -> bool:
    """Whether a tiled weight takes the W8A8 path (csrc/internal.h's w8a8_fits): 8 bits, one
    scale per row (group = in_features), no mins, in_features up to W8A8_MAX_K (every int32
    sum exact)."""
    return bits == 8 and group == in_features and not has_mins and in_features <= W8A8_MAX_K


def gated_on_tiles(weight: QuantizedWeightParams, rows: int) -> bool:
    """Whether `rows` bf16 rows meet this gated weight with SiLU in the matmul's epilogue: an
    AMX weight's QUANTIZED_AMX_MIN_ROWS or more (on the tiles), a W8A8 weight's more than
    W8A8_MIN_ROWS (the C dispatcher's choice, csrc/quantized.c)."""
    if weight.int8_x and rows > W8A8_MIN_ROWS:
        return True
    return bool(weight.amx) and rows >= QUANTIZED_AMX_MIN_ROWS


def quantized_weight_params(
    values: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    bits: int,
    group: int,
    tiled: bool = False,
    amx: bool = False,
    int8_x: bool = False,
    precise: bool = False,
) -> QuantizedWeightParams:
    """The C view of a quantized weight's tensors (which the caller keeps alive); tiled: in
    the tile layout (layers/quant_tiles.py); amx: tiled, and multiplied on the AMX tiles from
    QUANTIZED_AMX_MIN_ROWS bf16 rows (where the kernels have them); int8_x: tiled, and more
    than W8A8_MIN_ROWS bf16 rows rounded to int8 per row where the weight fits W8A8
    (`w8a8_fits`); precise: tiled, and bf16 rows kept to 16 bits (VNNI: vpdpbusd in two passes;
    AVX2: vpmaddwd), not rounded to int8 per 32 columns."""
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
        amx=int(tiled and amx),
        int8_x=int(tiled and int8_x),
        precise=int(tiled and precise),
    )


class QuantizedKernels(KernelLibrary):
    """x @ W^T and row lookups for quantized weights (float32 or bfloat16 activations)."""

    def quantized_fits(self, bits: int, group: int, in_features: int, tiled: bool) -> bool:
        """The C kernels' own fit rule (module-level quantized_fits is its mirror)."""
        return bool(self.lib.minisgl_quantized_fits(bits, group, in_features, int(tiled)))

    def quantized_path(
        self, weight: QuantizedWeightParams, rows: int, in_features: int, dtype: torch.dtype
    ) -> str | None:
        """The path (abi.QUANTIZED_PATHS) quantized_linear takes for `rows` rows of x in `dtype`
        against `weight`; None where it takes none (a shape it refuses)."""
        path = self.lib.minisgl_quantized_path(
            ctypes.byref(weight), rows, in_features, DTYPE_CODES[dtype]
        )
        return None if path < 0 else QUANTIZED_PATHS[path]

    def quantized_path_runs(self) -> dict[str, int]:
        """How many quantized_linear calls took each path since this library loaded."""
        runs = (ctypes.c_int64 * len(QUANTIZED_PATHS))()
        self.lib.minisgl_quantized_path_runs(runs)
        return dict(zip(QUANTIZED_PATHS, runs))

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

    def quantized_gated_silu(
        self, x: torch.Tensor, weight: QuantizedWeightParams, inter: int
    ) -> torch.Tensor:
        """silu(x @ gate^T) * (x @ up^T) [M, inter] for a tiled gate_up weight ([gate; up],
        2 * inter rows) with amx or int8_x set, SiLU in the matmul (`gated_on_tiles`)."""
        rows, in_features = x.shape
        if not x.is_contiguous() or x.dtype != torch.bfloat16:
            raise ValueError(f"quantized_gated_silu: x must be contiguous bfloat16, got {x.dtype}")
        if not gated_on_tiles(weight, rows):
            raise ValueError(
                f"quantized_gated_silu: {rows} rows (amx {weight.amx}, int8_x {weight.int8_x}) run "
                f"unfused: the tiles take an AMX weight's {QUANTIZED_AMX_MIN_ROWS} rows or more, "
                f"a W8A8 weight's more than {W8A8_MIN_ROWS}"
            )
        out = x.new_empty(rows, inter)
        status = self.lib.minisgl_quantized_gated_silu(
            x.data_ptr(),
            ctypes.byref(weight),
            out.data_ptr(),
            rows,
            inter,
            in_features,
            kernel_threads(),
        )
        check_status("quantized_gated_silu", status)
        return out

    def quantized_packed(
        self,
        weight: QuantizedWeightParams,
        shape: tuple[int, int],
        out: torch.Tensor,
        gated: bool = False,
    ) -> torch.Tensor:
        """A tiled weight [N, K] = `shape` dequantized into `out`, a packed copy for
        `packed_linear` (gated: its gate and up halves paired for `packed_gated_silu`)."""
        elems = int(self.lib.minisgl_packed_elems(*shape))
        if out.numel() != elems or out.dtype != torch.bfloat16 or not out.is_contiguous():
            raise ValueError(f"quantized_packed: out {out.dtype} {out.numel()} for {elems} bf16")
        status = self.lib.minisgl_quantized_packed(
            ctypes.byref(weight), out.data_ptr(), shape[0], shape[1], int(gated), kernel_threads()
        )
        check_status("quantized_packed", status)
        return out
