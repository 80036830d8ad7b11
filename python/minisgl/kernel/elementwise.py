"""The elementwise kernels' wrappers (csrc/elementwise.c): residual add + RMSNorm, SiLU-and-mul
and rotary, rounded to the storage dtype where PyTorch's op-by-op versions round."""

from __future__ import annotations

import torch

from minisgl.kernel.abi import DTYPE_CODES, check_rope_tables, check_status, raise_not_contiguous
from minisgl.kernel.library import KernelLibrary
from minisgl.kernel.threads import kernel_threads


class ElementwiseKernels(KernelLibrary):
    """Row-wise norms, activations and rotary embeddings, float32 or bfloat16."""

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); with no residual, x itself is the residual."""
        rows, hidden = x.shape
        if not (
            x.is_contiguous()
            and weight.is_contiguous()
            and weight.shape == (hidden,)
            and (residual is None or (residual.is_contiguous() and residual.shape == x.shape))
        ):
            raise_not_contiguous("add_rms_norm", x=x, residual=residual, weight=weight)
            raise ValueError(
                f"add_rms_norm: weight {tuple(weight.shape)} / residual does not fit x "
                f"{tuple(x.shape)}"
            )
        out = torch.empty_like(x)
        new_residual = x if residual is None else torch.empty_like(x)
        self.lib.minisgl_add_rms_norm(
            x.data_ptr(),
            None if residual is None else residual.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            None if residual is None else new_residual.data_ptr(),
            rows,
            hidden,
            eps,
            DTYPE_CODES[x.dtype],
            kernel_threads(),
        )
        return out, new_residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up [rows, width / 2] of gate_up [rows, gate | up], rounded as PyTorch's
        op-by-op version rounds."""
        rows, width = gate_up.shape
        if not gate_up.is_contiguous():
            raise_not_contiguous("silu_and_mul", gate_up=gate_up)
        if width % 2:
            raise ValueError(f"silu_and_mul: gate_up width {width} is odd")
        out = gate_up.new_empty(rows, width // 2)
        self.lib.minisgl_silu_and_mul(
            gate_up.data_ptr(),
            out.data_ptr(),
            rows,
            width // 2,
            DTYPE_CODES[gate_up.dtype],
            kernel_threads(),
        )
        return out

    def rotary_(
        self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        """RoPE in place on x [tokens, heads, dim] (dim contiguous; tokens may be strided);
        positions int64 [tokens], each within cos/sin float32 [max_positions, dim] (else
        ValueError, x untouched)."""
        tokens, heads, head_dim = x.shape
        if not (
            x.stride(2) == 1
            and x.stride(1) == head_dim
            and positions.dtype == torch.int64
            and positions.shape == (tokens,)
            and positions.is_contiguous()
        ):
            raise ValueError(
                f"rotary: x {tuple(x.shape)} (strides {x.stride()}) needs contiguous heads, "
                f"positions {positions.dtype} {tuple(positions.shape)} one contiguous int64 each"
            )
        check_rope_tables("rotary", head_dim, (cos, sin))
        status = self.lib.minisgl_rotary(
            x.data_ptr(),
            tokens,
            x.stride(0),
            heads,
            head_dim,
            positions.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            cos.shape[0],
            DTYPE_CODES[x.dtype],
            kernel_threads(),
        )
        check_status("rotary", status, positions, cos.shape[0])
