"""Dense projection; fused projections (qkv, gate_up) are one Linear with stacked rows."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.core import TensorParallel, get_global_ctx
from minisgl.kernel.abi import ProjectionParams
from minisgl.kernel.cpu import CpuKernels

from .activation import silu_and_mul
from .lora import LoraSlots
from .quant_weight import QuantizedWeight
from .quantized import QuantizedProjection, int8_group, quantize

# Rows per call decide the CPU matmul, always on the weight's tile-layout copy, its only one
# (benchmark/cpu_kernels.py, offline.py --decode-batch-sizes): up to GEMV_MAX_ROWS (with AMX tiles
# AMX_GEMV_MAX_ROWS) the C GEMV on that copy, which streams it once with vdpbf16ps (level with
# the row-major GEMV the model kept beside it before at 1 row, up to 1.4x faster at 2-8; that one
# was ~1.2-3x oneDNN's bf16 at 1-4 rows), then the C packed matmul: on the AMX tiles 1.3-1.6x
# oneDNN at 5-64 rows, 1.3x at 1,024; with vdpbf16ps (Zen 5) level with oneDNN on Qwen3's shapes
# and 1.1-1.3x on SmolLM2's at 16-128 rows, within 5% at 2,048. It also fuses SiLU into gate_up
# and lets the C decode layer take any batch. AVX2 CPUs (no bf16 dots, and oneDNN packs no bf16
# there) read the same copy with FMA at every row count, widening it in registers
# (csrc/matmul_avx2.c). Other dtypes and CPUs: oneDNN's packed layout (float32 included:
# PyTorch's F.linear runs MKL's sgemm, which on AMD CPUs takes a generic path 2-3x slower than
# oneDNN).
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


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs weights of this dtype on this CPU (decided before any is loaded)."""
    return onednn_pack(torch.zeros(32, 32, dtype=dtype)) is not None


def c_matmuls_take(dtype: torch.dtype, kernels: CpuKernels | None) -> bool:
    """Whether the C matmuls multiply weights of this dtype (through a tile-layout copy): bf16
    on CPUs with avx512_bf16, where they beat oneDNN, and on AVX2 CPUs where oneDNN cannot
    pack bf16 (widened in registers: half the bytes of its float32 copy a decode step streams,
    1.9-2.3x at 1-4 rows, 1.1x at 256, SmolLM2's layers on Zen 3, benchmark/cpu_kernels.py)."""
    if kernels is None or dtype != torch.bfloat16:
        return False
    return kernels.has_avx512_bf16 or (kernels.has_avx2 and not onednn_packs(dtype))


def tile_copy_elems(
    out_features: int, in_features: int, dtype: torch.dtype, kernels: CpuKernels | None
) -> int | None:
    """Elements of the tile-layout copy a CpuProjection of this weight would make (the only
    copy it keeps), or None where it takes another path."""
    if not c_matmuls_take(dtype, kernels):
        return None
    assert kernels is not None
    return kernels.packed_elems(out_features, in_features)


def computes_in_float32(dtype: torch.dtype, kernels: CpuKernels | None) -> bool:
    """Whether bf16/fp16 weights are multiplied in float32, through oneDNN's packed float32
    copy: on CPUs where neither the C matmuls nor oneDNN take the dtype (oneDNN packs bf16 only
    with AVX-512 or avx_ne_convert, fp16 with avx512_fp16 or avx_ne_convert; the C matmuls take
    bf16 on AVX2 too, so this is fp16 on AVX2, and bf16 where the kernels are not built).
    F.linear on such weights runs PyTorch's reference loop: 0.02 TFLOP/s at 64-1,024 rows,
    oneDNN's float32 0.11-0.14 (this AMX machine forced to AVX2 with ONEDNN_MAX_CPU_ISA=AVX2)."""
    return (
        dtype in (torch.bfloat16, torch.float16)
        and not c_matmuls_take(dtype, kernels)
        and not onednn_packs(dtype)
        and onednn_packs(torch.float32)
    )


def keeps_weight(dtype: torch.dtype, kernels: CpuKernels | None) -> bool:
    """Whether a CpuProjection of a weight of this dtype multiplies the weight itself (F.linear:
    neither the C kernels nor oneDNN pack it), so that it must stay."""
    return (
        not c_matmuls_take(dtype, kernels)
        and not onednn_packs(dtype)
        and not computes_in_float32(dtype, kernels)
    )


def _data_ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None or tensor.numel() == 0 else tensor.data_ptr()


class CpuProjection:
    """How a weight is multiplied on the CPU, holding its only copy: a bf16 weight where the C
    matmuls take it (`c_matmuls_take`), a copy in the tile layout that the C packed matmul reads
    at every row count (a few rows with vdpbf16ps, which streams it once at memory speed, as a
    GEMV; more on the AMX tiles where the CPU has them; on AVX2 with FMA, widened in registers);
    otherwise (float32, float16, AVX-512 CPUs without avx512_bf16) oneDNN's packed copy (a
    float32 one for bf16/fp16 where oneDNN packs only float32, see `computes_in_float32`), or,
    where oneDNN cannot pack at all, F.linear on the weight, which then stays with its module
    (`needs_weight`).

    gated (a gate_up projection): the tile copy holds gate and up interleaved, for
    `silu_and_mul`, which runs with SiLU in the matmul's epilogue; plain calls get their columns
    back in order. float_out (an output head): the C matmul returns its float32 sums unrounded,
    so logits a bf16 rounding would tie keep their order. tiles_out: where the tile copy goes
    (`tile_copy_elems` bf16 elements), e.g. a slot of the model's buffer on huge pages. In
    float32 the output is cast back to the input's dtype, except an output head's."""

    def __init__(
        self,
        weight: torch.Tensor,
        kernels: CpuKernels | None,
        gated: bool = False,
        bias: torch.Tensor | None = None,
        float_out: bool = False,
        tiles_out: torch.Tensor | None = None,
    ) -> None:
        self.out_features, self.in_features = weight.shape
        self.kernels = kernels if c_matmuls_take(weight.dtype, kernels) else None
        on_tiles = self.kernels is not None and self.kernels.has_amx
        self.float_out = float_out and self.kernels is not None
        # Rows up to which the GEMV streams the copy (above: the tiles, where there are any).
        self.gemv_max_rows = AMX_GEMV_MAX_ROWS if on_tiles else GEMV_MAX_ROWS
        if self.float_out:
            self.gemv_max_rows = 0
        self.gated = gated and self.kernels is not None and self.out_features % 32 == 0
        self.gated_bias: torch.Tensor | None = None
        self.packed: torch.Tensor | None
        self.in_float32 = computes_in_float32(weight.dtype, kernels)
        self.float32_logits = float_out and self.in_float32
        self.float32_bias = None if bias is None or not self.in_float32 else bias.float()
        if self.in_float32:
            self.packed = onednn_pack(weight.float())
        elif self.kernels is None:
            self.packed = onednn_pack(weight)
        elif self.gated:
            self.packed = self.kernels.pack_weight(interleave_gate_up(weight), tiles_out)
            self.gated_bias = None if bias is None else interleave_gate_up(bias).contiguous()
        else:
            self.packed = self.kernels.pack_weight(weight.contiguous(), tiles_out)

    @property
    def tiles(self) -> torch.Tensor | None:
        """The copy in the tile layout the C matmuls read (None: oneDNN's or no copy)."""
        return self.packed if self.kernels is not None else None

    @property
    def needs_weight(self) -> bool:
        """Whether calls multiply the module's weight itself (no packed copy replaces it)."""
        return self.packed is None

    @property
    def nbytes(self) -> int:
        """Bytes of the copy it holds (0 where it multiplies its module's weight)."""
        return 0 if self.packed is None else self.packed.numel() * self.packed.element_size()

    def _on_tiles(self, rows: int) -> bool:
        return rows > self.gemv_max_rows

    def path_changes(self, limit: int) -> list[int]:
        """The row counts r < limit after which bf16 rows are summed another way: the GEMV's
        last on the AMX tiles (elsewhere the GEMV and the vdpbf16ps or FMA matmul sum a row's
        products in one order, so a row's result is the same bits at every row count)."""
        on_amx = self.kernels is not None and self.kernels.has_amx and self.packed is not None
        return [self.gemv_max_rows] if on_amx and 0 < self.gemv_max_rows < limit else []

    @functools.cached_property
    def _column_order(self) -> torch.Tensor:
        """Where each [gate | up] column sits in a gated copy's interleaved output."""
        return interleave_gate_up(torch.arange(self.out_features)).argsort()

    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x @ weight^T (+ bias); `weight` is read only where `needs_weight`. `out` [rows,
        out_features] takes the result where the C packed matmul computes it (else a new tensor
        is returned)."""
        if self.kernels is not None and self.packed is not None:
            rows = x.reshape(-1, self.in_features).contiguous()
            tiles = self._on_tiles(rows.shape[0])
            if self.gated:  # interleaved columns, put back in order
                y = self.kernels.packed_linear(
                    rows, self.packed, self.out_features, self.gated_bias, tiles=tiles
                )[:, self._column_order]
            else:
                y = self.kernels.packed_linear(
                    rows, self.packed, self.out_features, bias, self.float_out, out, tiles
                )
            return y.view(*x.shape[:-1], self.out_features)
        if self.packed is not None and self.in_float32:
            y = torch.ops.mkldnn._linear_pointwise(
                x.to(torch.float32, memory_format=torch.contiguous_format),
                self.packed,
                self.float32_bias,
                "none",
                [],
                "",
            )
            return y if self.float32_logits else y.to(x.dtype)
        if self.packed is not None:  # oneDNN's copy takes any leading dims
            return torch.ops.mkldnn._linear_pointwise(
                x.contiguous(), self.packed, bias, "none", [], ""
            )
        return F.linear(x, weight, bias)

    def fused_params(self, weight: torch.Tensor, bias: torch.Tensor | None) -> ProjectionParams:
        """This projection as the C decode layer reads it (kernels.h's `projection`): the
        packed copy where the C matmuls have one, with the bias in its column order."""
        return ProjectionParams(
            weight=_data_ptr(weight) if self.needs_weight else None,
            tiles=_data_ptr(self.tiles),
            bias=_data_ptr(self.gated_bias if self.gated else bias),
            gated=int(self.gated),
        )

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """The gated activation straight from the packed matmul, where this projection has it;
        else None."""
        if not self.gated:
            return None
        assert self.kernels is not None and self.packed is not None
        rows = x.reshape(-1, self.in_features).contiguous()
        inter = self.out_features // 2
        act = self.kernels.packed_gated_silu(
            rows, self.packed, inter, self.gated_bias, self._on_tiles(rows.shape[0])
        )
        return act.view(*x.shape[:-1], inter)


def decode_row_bounds(model: nn.Module, limit: int = 256) -> list[int]:
    """The row counts r < limit after which some projection of `model` multiplies r + 1 bf16
    rows another way than r (a quantized weight's route or C kernel path changes, as AVX2's 4-
    and 6-bit tiles past AVX2_TILED_MAX_ROWS; a dense one leaves the GEMV for the AMX tiles):
    between two of them a row's result does not depend on the row count, so a speculative
    verify step that stays there gives what decoding one by one gives. (The default model's 121
    projections: 50 ms on Zen 3, once per engine.)"""
    bounds: set[int] = set()
    for module in model.modules():
        projection = getattr(module, "cpu_projection", None)
        if isinstance(projection, (CpuProjection, QuantizedProjection)):
            bounds.update(projection.path_changes(limit))
    return sorted(bounds)


class Linear(nn.Module):
    """y = x W^T + b, weights filled by the loader. gated: a gate_up projection ([gate; up]
    rows), which also offers `silu_and_mul`. reduce: row-parallel (the weight holds this rank's
    input columns), the partial products summed over the group, the bias added after."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        gated: bool = False,
        reduce: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.gated = in_features, out_features, gated
        self.reduce = reduce if reduce is not None and reduce.sharded else None
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.cpu_projection: CpuProjection | QuantizedProjection | None = None
        # Set before loading: quantize the weight by this method (quantized.LOAD_QUANTIZATIONS).
        self.quantization: str | None = None
        # Multi-LoRA: the adapters' deltas, added where the batch runs rows under adapters.
        self.lora: LoraSlots | None = None

    def prepare_for_cpu(
        self,
        kernels: CpuKernels | None,
        tiles_out: torch.Tensor | None = None,
        weight: torch.Tensor | QuantizedWeight | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        """Pick the CPU matmul path for the weight (after loading); a packed copy (into
        `tiles_out` where given, see CpuProjection) or a quantized one replaces the weight.
        weight: the loaded weight where the module's own parameter does not hold it (e.g. is
        on the meta device), already quantized where the checkpoint held it so; dtype: the
        model's, which a weight handed over for quantizing in another takes where no group fits
        it and it stays dense."""
        handed_over = weight is not None
        weight = self.weight.data if weight is None else weight
        if isinstance(weight, torch.Tensor) and self.quantization is not None:
            group_int8 = int8_group(self.quantization, kernels, weight.shape[1])
            quantized = quantize(weight, self.quantization, group_int8)
            if quantized is not None:
                weight = quantized
            elif dtype is not None:  # no group fits it: dense, in the model's dtype
                weight = weight.to(dtype)
        if isinstance(weight, QuantizedWeight):
            gated = self.gated and self.bias is None  # the fused SiLU takes no bias
            self.cpu_projection = QuantizedProjection(
                weight,
                kernels,
                gated=gated,
                int8_activations=self.quantization == "int8",
                weight_only=self.quantization == "int8-wo",
            )
            self.weight = nn.Parameter(torch.empty(0), requires_grad=False)
            return
        if weight.device.type == "cpu" and weight.dtype in CPU_PROJECTION_DTYPES:
            # A row-parallel bias is added once, after the sum (see forward).
            bias = None if self.bias is None or self.reduce is not None else self.bias.data
            self.cpu_projection = CpuProjection(
                weight, kernels, self.gated, bias, tiles_out=tiles_out
            )
            if not self.cpu_projection.needs_weight:
                self.weight = nn.Parameter(weight.new_empty(0), requires_grad=False)
            elif handed_over:  # F.linear multiplies it: the module keeps it
                self.weight = nn.Parameter(weight.clone(), requires_grad=False)

    def _lora_mask(self) -> torch.Tensor | None:
        return None if self.lora is None else get_global_ctx().lora_mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reduce is not None:
            partial = self._matmul(x, None)
            y = self.reduce.all_reduce(partial)
            y = y if self.bias is None else y + self.bias.to(y.dtype)
        else:
            y = self._matmul(x, self.bias)
        mask = self._lora_mask()
        if mask is not None:
            assert self.lora is not None
            y = self.lora.add_to(x, y, mask, get_global_ctx().batch.lora_slots)
        return y

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.cpu_projection is not None:
            return self.cpu_projection(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

    def fused_params(self) -> ProjectionParams | None:
        """This projection for the C decode layer, where it has a CPU path (see CpuProjection)."""
        if self.cpu_projection is None:
            return None
        params = self.cpu_projection.fused_params(self.weight, self.bias)
        if self.lora is not None:
            self.lora.fill_params(params)
        return params

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a gated projection: fused on the CPU where it can be."""
        assert self.gated
        if self.cpu_projection is not None and self._lora_mask() is None:
            fused = self.cpu_projection.silu_and_mul(x)
            if fused is not None:
                return fused
        return silu_and_mul(self(x))
