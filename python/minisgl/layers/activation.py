"""Gated activations over a fused gate_up projection."""

from __future__ import annotations

import torch

from minisgl.kernel.ops import ops_for


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [..., gate | up]."""
    return ops_for(gate_up).silu_and_mul(gate_up)
