"""The matrix products' wrappers (csrc/gemv.c, matmul.c, packing.c): the row-major bf16 GEMV, the
packed (tile-layout) weight copies, their matmuls on the AMX tiles or with vdpbf16ps, and rows
read back from a packed copy."""

from __future__ import annotations

import torch

from minisgl.kernel.abi import check_status, output_rows, raise_not_contiguous, require
from minisgl.kernel.library import KernelLibrary
from minisgl.kernel.threads import kernel_threads


class GemmKernels(KernelLibrary):
    """x @ W^T for bf16 weights, row-major (the GEMV) or from their packed copy."""

    def gemv_bf16(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [M, K] @ weight [N, K]^T (+ bias) for small M, all bfloat16."""
        rows, in_features = x.shape
        if not (
            x.is_contiguous()
            and weight.is_contiguous()
            and weight.shape[1] == in_features
            and (bias is None or (bias.is_contiguous() and bias.shape == weight.shape[:1]))
        ):
            raise_not_contiguous("gemv_bf16", x=x, weight=weight, bias=bias)
            raise ValueError(
                f"gemv_bf16: weight {tuple(weight.shape)} / bias does not fit x {tuple(x.shape)}"
            )
        out = x.new_empty(rows, weight.shape[0])
        self.lib.minisgl_gemv_bf16(
            x.data_ptr(),
            weight.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            rows,
            weight.shape[0],
            in_features,
            kernel_threads(),
        )
        return out

    def packed_elems(self, out_features: int, in_features: int) -> int:
        """Elements of a [out_features, in_features] weight's packed copy (`pack_weight`)."""
        return int(self.lib.minisgl_packed_elems(out_features, in_features))

    def pack_weight(self, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """A bf16 weight [N, K] in the tile layout `packed_linear` takes (zero-padded), into
        `out` (contiguous, `packed_elems(N, K)` bf16 elements) when given."""
        out_features, in_features = weight.shape
        elems = self.packed_elems(out_features, in_features)
        require(
            weight.dtype == torch.bfloat16 and weight.is_contiguous(),
            f"pack_weight: weight must be contiguous bfloat16, got {weight.dtype}",
        )
        packed = weight.new_empty(elems) if out is None else out
        require(
            packed.numel() == elems and packed.dtype == torch.bfloat16 and packed.is_contiguous(),
            f"pack_weight: out of {packed.numel()} {packed.dtype} elements for {elems} bfloat16",
        )
        self.lib.minisgl_pack_weight(
            weight.data_ptr(), packed.data_ptr(), out_features, in_features, kernel_threads()
        )
        return packed

    def _check_packed(self, kernel: str, packed: torch.Tensor, n: int, k: int) -> None:
        if not (packed.numel() == self.lib.minisgl_packed_elems(n, k)):
            raise ValueError(
                f"{kernel}: packed weight of {packed.numel()} elements is not [{n}, {k}] packed"
            )

    def packed_linear(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        out_features: int,
        bias: torch.Tensor | None,
        float_out: bool = False,
        out: torch.Tensor | None = None,
        tiles: bool = True,
    ) -> torch.Tensor:
        """x [M, K] @ W^T (+ bias), W packed by `pack_weight`; bfloat16 in, bfloat16 out (float32
        with float_out: the sums unrounded), into `out` when given. On the AMX tiles where the
        CPU has them and `tiles` asks, else with vdpbf16ps, or without avx512_bf16 with AVX2's
        FMA (RuntimeError in a build with neither)."""
        rows, in_features = x.shape
        if not (x.is_contiguous() and (bias is None or bias.is_contiguous())):
            raise_not_contiguous("packed_linear", x=x, bias=bias)
        self._check_packed("packed_linear", packed, out_features, in_features)
        out = output_rows(x, out_features, torch.float32 if float_out else x.dtype, out)
        status = self.lib.minisgl_packed_linear(
            x.data_ptr(),
            packed.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            rows,
            out_features,
            in_features,
            int(float_out),
            int(self.has_amx and tiles),
            kernel_threads(),
        )
        check_status("packed_linear", status)
        return out

    def packed_gated_silu(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        inter: int,
        bias: torch.Tensor | None,
        tiles: bool = True,
    ) -> torch.Tensor:
        """silu(x @ gate^T) * (x @ up^T) [M, inter] from a gate_up weight packed by
        `pack_weight` with its gate and up rows interleaved in 16s (`interleave_gate_up`); on
        the tiles as `packed_linear`."""
        rows, in_features = x.shape
        require(inter % 16 == 0, f"packed_gated_silu: inter {inter} is not a multiple of 16")
        if not (x.is_contiguous() and (bias is None or bias.is_contiguous())):
            raise_not_contiguous("packed_gated_silu", x=x, bias=bias)
        self._check_packed("packed_gated_silu", packed, 2 * inter, in_features)
        out = x.new_empty(rows, inter)
        status = self.lib.minisgl_packed_gated_silu(
            x.data_ptr(),
            packed.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            rows,
            inter,
            in_features,
            int(self.has_amx and tiles),
            kernel_threads(),
        )
        check_status("packed_gated_silu", status)
        return out

    def packed_rows(
        self, packed: torch.Tensor, ids: torch.Tensor, out_features: int, in_features: int
    ) -> torch.Tensor:
        """Rows `ids` [count] of a bf16 weight [out_features, in_features] read from its packed
        copy: [count, in_features], equal to indexing the weight."""
        self._check_packed("packed_rows", packed, out_features, in_features)
        ids = ids.to(torch.int64).contiguous()
        out = packed.new_empty(ids.numel(), in_features)
        status = self.lib.minisgl_packed_rows(
            packed.data_ptr(),
            ids.data_ptr(),
            out.data_ptr(),
            ids.numel(),
            out_features,
            in_features,
            kernel_threads(),
        )
        if status != 0:
            bad = ids[(ids < 0) | (ids >= out_features)]
            raise IndexError(f"packed_rows: row {int(bad[0])} outside [0, {out_features})")
        return out
