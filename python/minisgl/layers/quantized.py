"""Quantized projections, chosen per layer at load time behind Linear's interface. int8
weight-only: one int8 per weight and one float scale per output channel (symmetric, the
channel's largest magnitude maps to 127), half the bytes a decode step streams in bf16;
activations stay in the model's dtype. bf16/fp16 multiply through PyTorch's int8-weight kernel
(`torch._weight_int8pack_mm`), float32 through the weight dequantized per call."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minisgl.kernel.abi import ProjectionParams

QUANTIZATIONS = ("int8",)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight [N, K], float32 scales [N]) with weight ~= q * scale per row."""
    w = weight.float()
    scales = w.abs().amax(dim=1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales


class Int8Projection:
    """x @ (q * scales)^T (+ bias) for a weight quantized at load; the Linear's only copy."""

    gemv_max_rows = 0  # never multiplied by the C kernels
    needs_weight = False
    gated = False

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        self.qweight, self.scales = quantize_int8(weight)
        self._scales_as: dict[torch.dtype, torch.Tensor] = {}

    def scales_as(self, dtype: torch.dtype) -> torch.Tensor:
        """The scales in the activations' dtype (what the int8 kernel multiplies with)."""
        scales = self._scales_as.get(dtype)
        if scales is None:
            scales = self._scales_as[dtype] = self.scales.to(dtype)
        return scales

    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`weight` (the module's emptied parameter) and `out` are not read."""
        rows = x.reshape(-1, self.in_features)
        if rows.dtype in (torch.bfloat16, torch.float16):
            y = torch._weight_int8pack_mm(rows.contiguous(), self.qweight, self.scales_as(x.dtype))
        else:  # PyTorch's int8 kernel is ~20x slower in float32 than this
            y = F.linear(rows, self.qweight.to(rows.dtype)) * self.scales_as(rows.dtype)
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], self.out_features)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        return None  # no fused activation: the Linear applies it after the matmul

    def fused_params(self, weight: torch.Tensor, bias: torch.Tensor | None) -> ProjectionParams:
        """No packed copy: the fused C decode layer does not take this model."""
        return ProjectionParams(weight=None, tiles=None, bias=None, gated=0)
