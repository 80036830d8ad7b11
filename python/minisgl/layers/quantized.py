"""Quantized projections behind Linear's interface, chosen per layer at load time: a weight held
as a QuantizedWeight (quant_weight.py), quantized at load (`--quantization int8|int4`) or
repacked from a quantized checkpoint (GGUF, compressed-tensors). Activations stay in the model's
dtype: a decode step streams the small integers (8 bits: half of bf16's bytes; 4 bits with a
float16 scale and offset per 32 columns: 0.625 of a byte a weight) through the C kernels."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from minisgl.env import ENV
from minisgl.kernel.abi import ProjectionParams
from minisgl.kernel.cpu import CpuKernels
from minisgl.kernel.quantized import (
    W8A8_MIN_ROWS,
    gated_on_tiles,
    quantized_fits,
    quantized_weight_params,
    w8a8_fits,
)

from .quant_tiles import TiledWeight, tile_weight
from .quant_weight import QuantizedWeight, quantize_int4, quantize_int8

# Quantized at load: "int8" (a float16 scale per INT8_GROUP columns; the bf16 rows of a decode
# batch or prefill meet it as int8 per 32 columns where the CPU has VNNI, W8A8; with AMX-INT8
# one scale per row, more than W8A8_MIN_ROWS rows rounded to int8 per row on the int8 tiles),
# "int8-wo" (the same weights, activations kept to 16 bits: weight-only),
# "int4" (a float16 scale and offset per 32 columns, Q4_1's scheme; "-g64"/"-g128": per
# 64/128, fewer bytes, coarser: the default model kept 97% of bf16's top-1 at 32, 74% at
# 64-128, benchmark/quantized_quality.py). "gguf": a GGUF file's own quantized tensors.
# "none": every weight dense, even from a quantized file.
LOAD_QUANTIZATIONS = ("int8", "int8-wo", "int4", "int4-g32", "int4-g64", "int4-g128")
# Bumped whenever quantizing at load gives other integers (KV computed before is then not the
# engine's: the disk KV tier's fingerprint carries it). 2: int8 per 64 columns, rounded from the
# checkpoint's own values.
LOAD_QUANTIZATION_VERSION = 2
QUANTIZATIONS = (*LOAD_QUANTIZATIONS, "gguf", "none")

# Columns per float16 scale of int8 weights quantized at load, 3% more bytes than one float32
# scale per row: per row, W8A8 sat at 1.6-2.2x the KL divergence from bf16 (default model,
# teacher-forced on prose and on code and docs), the rows' largest weights setting every
# column's step. The output head's, 32 (llama.cpp's Q8_0), is what it ranks tokens by: per row
# it cost the default model 2.6 points of top-1 against bf16 on the quality benchmark's text.
INT8_GROUP = 64
INT8_HEAD_GROUP = 32

# Rows up to which the C kernels multiply the quantized weight as it is (measured: above,
# dequantizing it to the activations' dtype once per call and multiplying through oneDNN is
# faster; benchmark/kernels_quantized.py).
QUANTIZED_GEMV_MAX_ROWS = 128
# Rows up to which AVX2's tiled kernels take a 4- or 6-bit weight's bf16 activations as
# integers, a row's output the same bits at every row count: int8 per 32 columns in vpmaddubsw,
# int16 in vpmaddwd where precise (weight-only); above, float32 FMA tiles. 8-bit weights take
# int16 at every row count (csrc/internal.h's AVX2_TILED_MAX_ROWS).
AVX2_TILED_MAX_ROWS = 64


# QuantizedProjection.route's answers: the C kernel, the AMX packed matmul, torch on the
# weight dequantized.
ROUTES = ("kernel", "amx-packed", "dequantized")

# A prefill's dequantized weight (row-major, or the packed layout on AMX), per dtype: one buffer
# for every projection, the largest weight's size.
_DEQUANTIZED: dict[torch.dtype, torch.Tensor] = {}


def _scratch(dtype: torch.dtype, count: int) -> torch.Tensor:
    """`count` elements of the shared dequantization buffer (valid until the next projection's
    call): a fresh tensor each prefill chunk cost more in page faults than the dequantization."""
    scratch = _DEQUANTIZED.get(dtype)
    if scratch is None or scratch.numel() < count:
        scratch = _DEQUANTIZED[dtype] = torch.empty(count, dtype=dtype)
    return scratch[:count]


def int8_group(method: str, kernels: CpuKernels | None, in_features: int) -> int | None:
    """Columns per scale of `method`'s int8 weights of this width on this CPU: INT8_GROUP, or
    None (a scale per output row) for `int8` where AMX-INT8's W8A8 tiles will take it (they sum
    a row's whole in_features in int32, then scale once: w8a8_fits)."""
    w8a8 = (
        method == "int8"
        and kernels is not None
        and kernels.has_amx_int8
        and kernels.reads_tiles
        and quantized_fits(8, in_features, in_features, tiled=True)
        and w8a8_fits(8, in_features, in_features, has_mins=False)
    )
    return None if w8a8 else INT8_GROUP


def quantize(
    weight: torch.Tensor, method: str, group_int8: int | None = INT8_GROUP
) -> QuantizedWeight | None:
    """A dense weight quantized by a LOAD_QUANTIZATIONS method; None where its in_features fit
    no group of the kernels (int8: a multiple of 16; int4: of 32), which then stays dense.
    int8: a float16 scale per `group_int8` columns (None: a float32 one per output row; see
    int8_group). A group asked is halved (to 16 for int8, 32 for int4, 32 unless named) until
    it divides in_features."""
    in_features = weight.shape[1]
    if method in ("int8", "int8-wo"):
        if in_features % 16:
            return None
        if group_int8 is None:
            return quantize_int8(weight)
        return quantize_int8(weight, _fitting(group_int8, 16, in_features), 127, torch.float16)
    if method.startswith("int4"):
        group = _fitting(int(method.partition("-g")[2] or 32), 32, in_features)
        return quantize_int4(weight, group) if in_features % group == 0 else None
    raise ValueError(f"quantization {method!r} is not one of {list(LOAD_QUANTIZATIONS)}")


def _fitting(group: int, smallest: int, in_features: int) -> int:
    """`group` halved until it divides in_features or reaches `smallest`."""
    while group > smallest and in_features % group:
        group //= 2
    return group


def quantize_head(weight: torch.Tensor, method: str) -> QuantizedWeight | None:
    """An output head (or tied embedding) quantized for `method`, at higher precision than its
    layers, as llama.cpp keeps its output layer (4 bits lose logit order: the default model's
    int4 top-1 fell from 97% to 86%): int8 with a float16 scale per INT8_HEAD_GROUP columns,
    or for the 4-bit methods 6 bits per 32 columns with float16 scales (Q6_K's size; tiled in
    6 bits, 0.81 of int8's bytes)."""
    if method.startswith("int4") and weight.shape[1] % 32 == 0:
        return quantize_int8(weight, 32, limit=31, scale_dtype=torch.float16)
    return quantize(weight, "int8", INT8_HEAD_GROUP)


class QuantizedProjection:
    """x @ W^T (+ bias) for a QuantizedWeight, the module's only copy of its weight. float_out
    (an output head): float32 results. Where the C kernels have AVX-512 VNNI the weight is
    re-laid-out into tiles (quant_tiles.py) and bf16 activations meet it in integer products,
    rounded to int8 per 32 columns (llama.cpp's Q8_0) at every decode row count, and for `int8`
    in prefills too (`int8-wo` or MINISGL_CPU_INT8_ACTIVATIONS=0: kept to 16 bits in two
    passes); with AMX, from QUANTIZED_AMX_MIN_ROWS rows as bf16 on the tiles, the weight
    dequantized block by block (a prefill's: whole, into the packed matmul's layout). With AVX2
    and no VNNI the weight is tiled too: up to AVX2_TILED_MAX_ROWS bf16 rows meet 4- and 6-bit
    weights as int8 per 32 columns (vpmaddubsw), or as int16 (vpmaddwd) where 16 bits are kept,
    more rows and float32 x its tiles dequantized to float32; 8-bit weights meet bf16 rows as
    int16 at every row count. gated (a gate_up without bias): with AMX, `silu_and_mul` runs SiLU
    in the matmul. Without the C kernels: dequantized per call."""

    def __init__(
        self,
        weight: QuantizedWeight,
        kernels: CpuKernels | None,
        float_out: bool = False,
        tiled: bool | None = None,
        gated: bool = False,
        int8_activations: bool = False,
        weight_only: bool = False,
    ) -> None:
        """tiled: None takes the tile layout wherever it can, False keeps the row layout.
        int8_activations: more than W8A8_MIN_ROWS bf16 rows rounded to int8 per row (W8A8) where
        the weight is tiled, int8 with one scale per row, and the CPU has AMX-INT8 (with VNNI
        alone the tiled rows' int8 per 32 columns were faster at every row count). weight_only
        (`int8-wo`): bf16 rows kept to 16 bits on the tiles (VNNI, AVX2), as with
        MINISGL_CPU_INT8_ACTIVATIONS=0."""
        self.out_features, self.in_features = weight.out_features, weight.in_features
        layout = (weight.bits, weight.group, weight.in_features)
        if kernels is not None and not quantized_fits(*layout, tiled=False):
            kernels = None  # a layout the C kernels refuse: torch multiplies it, dequantized
        self.kernels = kernels
        self.float_out = float_out
        can_tile = (
            kernels is not None and kernels.reads_tiles and quantized_fits(*layout, tiled=True)
        )
        if tiled and not can_tile:
            raise ValueError(f"tiled=True: the kernels or in_features {self.in_features} refuse it")
        if tiled is None:
            tiled = can_tile
        self.weight: QuantizedWeight | TiledWeight = tile_weight(weight) if tiled else weight
        # The AMX paths: a tiled weight on a CPU with tiles.
        self.on_amx = tiled and kernels is not None and kernels.has_amx
        # x kept to 16 bits where int8 activations are off: the VNNI tiles' two passes, AVX2's
        # vpmaddwd (which 8-bit weights take anyway).
        int8_off = weight_only or not ENV.CPU_INT8_ACTIVATIONS.value
        self.precise = tiled and int8_off
        self.int8_x = (
            int8_activations
            and tiled
            and kernels.has_amx_int8
            and not float_out
            and w8a8_fits(weight.bits, weight.group, weight.in_features, weight.mins is not None)
        )
        self.params = quantized_weight_params(
            self.weight.values,
            self.weight.scales,
            self.weight.mins,
            self.weight.bits,
            weight.group,
            tiled,
            self.on_amx,
            self.int8_x,
            self.precise,
        )
        # SiLU in the matmul's epilogue: on the AMX tiles, and in W8A8 (`gated_on_tiles`).
        self.gated = gated and (self.on_amx or self.int8_x) and self.out_features % 32 == 0
        # Without bf16 dot products (AVX2, AVX-512 without bf16) the C kernels' float32 tiles
        # take bf16 x at every row count: they beat oneDNN's float32 on a bf16 model's copy, and
        # F.linear on a dequantized bf16 weight would run oneDNN's emulation or PyTorch's loop.
        # Not the tile layout's int8 products (VNNI without bf16: Ice Lake, Cascade Lake): above
        # QUANTIZED_GEMV_MAX_ROWS they would round a prefill's x to int8 (Q8_0's precision, 3-4
        # points of top-1 the other classes keep), so that prefill multiplies the weight
        # dequantized in float32 instead, as exact as the bf16 classes'.
        self.no_bf16_dots = kernels is not None and not kernels.has_avx512_bf16
        # `int8` (W8A8) on VNNI without AMX: a prefill's bf16 rows in one int8 pass too, 1.45x
        # bf16 through oneDNN on the default model's layer at 256-2048 rows, where the weight
        # dequantized for oneDNN ran 0.92x (benchmark/kernels_quantized.py, Zen 4). Weight-only
        # formats keep a prefill's activations exact: int8 ones cost the GGUF default 7 points
        # of prefill top-1 against HF (tests/test_quantized.py).
        int8_prefill = (
            int8_activations and tiled and kernels.has_vnni and not self.precise and not float_out
        )
        self.c_takes_every_row = (
            self.no_bf16_dots and kernels.has_avx2 and not (tiled and kernels.has_vnni)
        ) or (int8_prefill and not self.on_amx)
        # bf16 rows meet the weight as int8 per 32 columns at every row count (VNNI without
        # AMX-INT8's per-row W8A8): what SmoothQuant's smoothing is for (models/smoothing.py).
        self.rounds_x_per_32 = bool(int8_prefill and not self.int8_x)

    @functools.cached_property
    def _all_rows(self) -> torch.Tensor:
        """Every row's index: the whole weight's lookup (each prefill chunk's dequantization)."""
        return torch.arange(self.out_features)

    @property
    def nbytes(self) -> int:
        """Bytes of its weight as stored."""
        return self.weight.nbytes

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole weight in `dtype`, in the shared scratch buffer (see `_scratch`)."""
        kernels = self.kernels
        # An output head (prompt logprobs: rarely this many rows) would keep vocab x hidden.
        if kernels is None or not kernels.supports(dtype) or self.float_out:
            return self.rows(self._all_rows, dtype)
        out = _scratch(dtype, self.out_features * self.in_features)
        out = out.view(self.out_features, self.in_features)
        return kernels.quantized_rows(self.params, self.shape, self._all_rows, dtype, out)

    def _packed(self, gated: bool) -> torch.Tensor:
        """The whole weight in the packed matmul's layout (gated: gate and up paired), in the
        shared scratch buffer."""
        assert self.kernels is not None
        elems = self.kernels.packed_elems(self.out_features, self.in_features)
        packed = _scratch(torch.bfloat16, elems)
        return self.kernels.quantized_packed(self.params, self.shape, packed, gated)

    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`weight` (the module's emptied parameter) is not read; `out` [rows, out_features]
        takes the result where the C kernel computes it."""
        rows = x.reshape(-1, self.in_features)
        route = self.route(rows.shape[0], x.dtype)
        kernels = self.kernels
        if route == "kernel":
            assert kernels is not None
            y = kernels.quantized_linear(
                rows.contiguous(), self.params, self.shape, bias, self.float_out, out
            )
        elif route == "amx-packed":
            assert kernels is not None
            packed = self._packed(gated=False)
            y = kernels.packed_linear(rows.contiguous(), packed, self.out_features, bias, out=out)
        elif self.no_bf16_dots and x.dtype == torch.bfloat16:  # float32 products, rounded once
            wide_bias = None if bias is None else bias.float()
            y = F.linear(rows.float(), self.dequantized(torch.float32), wide_bias)
            y = y if self.float_out else y.to(x.dtype)
        else:
            y = F.linear(rows, self.dequantized(rows.dtype), bias)
            if self.float_out:
                y = y.float()
        return y.view(*x.shape[:-1], self.out_features)

    def route(self, rows: int, dtype: torch.dtype) -> str:
        """How `rows` rows of x in `dtype` meet the weight (ROUTES): the C quantized matmul
        (whose own path is kernels.quantized_path), the whole weight dequantized into the AMX
        packed layout, or dequantized and multiplied by torch (oneDNN)."""
        kernels = self.kernels
        on_kernels = kernels is not None and kernels.supports(dtype)
        bf16 = dtype == torch.bfloat16
        every_row = bf16 and self.c_takes_every_row
        w8a8 = self.int8_x and bf16 and rows > W8A8_MIN_ROWS
        if on_kernels and (rows <= QUANTIZED_GEMV_MAX_ROWS or every_row or w8a8):
            return "kernel"
        if self.on_amx and bf16 and not self.float_out:
            return "amx-packed"
        return "dequantized"

    def path_changes(self, limit: int) -> list[int]:
        """The row counts r < limit after which bf16 rows take another route or kernel path."""
        forms = [self._form(rows) for rows in range(1, limit + 1)]
        return [rows for rows in range(1, limit) if forms[rows - 1] != forms[rows]]

    def _form(self, rows: int) -> tuple[str, str | None]:
        """How `rows` bf16 rows are multiplied: the route, and the kernel's path on its route."""
        route = self.route(rows, torch.bfloat16)
        if route != "kernel" or self.kernels is None:
            return route, None
        return route, self.kernels.quantized_path(
            self.params, rows, self.in_features, torch.bfloat16
        )

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the weight dequantized (an embedding lookup): [len(ids), in]."""
        kernels = self.kernels
        if kernels is not None and kernels.supports(dtype):
            return kernels.quantized_rows(self.params, self.shape, ids, dtype)
        if isinstance(self.weight, TiledWeight):  # only the kernels read the tile layout
            assert kernels is not None
            return kernels.quantized_rows(self.params, self.shape, ids, torch.float32).to(dtype)
        return self.weight.dequantize(ids.reshape(-1).long()).to(dtype)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up with SiLU in the matmul where this gated projection has it (bf16 x
        on the tiles: `gated_on_tiles`); else None."""
        rows = x.reshape(-1, self.in_features)
        if (
            not self.gated
            or x.dtype != torch.bfloat16
            or not gated_on_tiles(self.params, len(rows))
        ):
            return None
        assert self.kernels is not None
        inter = self.out_features // 2
        if len(rows) <= QUANTIZED_GEMV_MAX_ROWS or self.int8_x:
            act = self.kernels.quantized_gated_silu(rows.contiguous(), self.params, inter)
        else:
            packed = self._packed(gated=True)
            act = self.kernels.packed_gated_silu(rows.contiguous(), packed, inter, None)
        return act.view(*x.shape[:-1], inter)

    def fused_params(self, weight: torch.Tensor, bias: torch.Tensor | None) -> ProjectionParams:
        """The quantized weight for the C decode layer (which multiplies it as __call__ does)."""
        del weight
        return ProjectionParams(
            weight=None,
            tiles=None,
            bias=None if bias is None else bias.data_ptr(),
            gated=int(self.gated),
            quantized=self.params,
        )
