"""Rotary position embedding with a precomputed cos/sin table."""

from __future__ import annotations

import torch
from torch import nn

from minisgl.kernel.ops import RotaryInputs, ops_on

__all__ = ["RotaryEmbedding", "RotaryInputs"]


class RotaryEmbedding(nn.Module):
    """Applies RoPE (neox layout: rotate halves) to q and k at the given positions."""

    def __init__(
        self, inv_freq: torch.Tensor, attention_scaling: float, max_positions: int
    ) -> None:
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_scaling, persistent=False)

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryInputs:
        """Look the batch's positions up once for all layers."""
        return ops_on(self.cos.device, dtype).rotary_inputs(positions, self.cos, self.sin, dtype)

    def forward(
        self, inputs: RotaryInputs, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]; may rotate in place."""
        rotate = inputs.ops.rotate
        return rotate(inputs, q, self.cos, self.sin), rotate(inputs, k, self.cos, self.sin)
