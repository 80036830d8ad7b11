"""Dense projection; fused projections (qkv, gate_up) are one Linear with stacked rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# oneDNN wants half-precision weights in its own blocked layout; packed once, its bf16 GEMMs
# run 1.2-1.5x faster than F.linear on small batches (benchmark/offline.py --decode-batch-sizes).
_PACKABLE = (torch.bfloat16, torch.float16)


def onednn_packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


class Linear(nn.Module):
    """y = x W^T + b, weights filled by the loader."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed_weight: torch.Tensor | None = None

    def pack_for_cpu(self) -> None:
        """Switch to a oneDNN-packed copy of the weight (CPU, half precision only)."""
        if self.weight.device.type == "cpu" and self.weight.dtype in _PACKABLE:
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.data, 1)
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            return linear_packed(x, self.packed_weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def linear_packed(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
