"""Gated activations over a fused gate_up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minisgl.kernel.cpu import MAX_INTERMEDIATE, kernels_for


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    kernels = kernels_for(gate_up)
    if kernels is not None and gate_up.dim() == 2 and gate_up.shape[1] // 2 <= MAX_INTERMEDIATE:
        return kernels.silu_and_mul(gate_up.contiguous())
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
