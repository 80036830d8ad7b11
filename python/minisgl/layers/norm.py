"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn

from minisgl.kernel.cpu import MAX_NORM_HIDDEN, kernels_for


class RMSNorm(nn.Module):
    """Normalises in float32 and scales in the input dtype, exactly as transformers does."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (norm(x + residual), x + residual); with no residual, x itself is the residual."""
        kernels = kernels_for(x)
        if kernels is not None and x.shape[-1] <= MAX_NORM_HIDDEN and self.weight.dtype == x.dtype:
            shape = x.shape
            rows = x.reshape(-1, shape[-1]).contiguous()
            res_rows = None if residual is None else residual.reshape(rows.shape).contiguous()
            out, new_residual = kernels.add_rms_norm(rows, res_rows, self.weight, self.eps)
            return out.view(shape), new_residual.view(shape)
        if residual is not None:
            x = residual + x
        return self._norm(x), x

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)[0]
