"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn

from minisgl.kernel.ops import TORCH_OPS, ops_for


class RMSNorm(nn.Module):
    """Normalises in float32 and scales in the input dtype, exactly as transformers does."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        """The PyTorch reference, whatever the device."""
        return TORCH_OPS.add_rms_norm(x, None, self.weight, self.eps)[0]

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (norm(x + residual), x + residual); with no residual, x itself is the residual."""
        return ops_for(x).add_rms_norm(x, residual, self.weight, self.eps)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)[0]
