"""Rotary position embedding with a precomputed cos/sin table."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from minisgl.kernel.cpu import CpuKernels, kernels_for


@dataclass
class RotaryInputs:
    """One forward's positions; the PyTorch path also gets their [tokens, 1, dim] tables."""

    positions: torch.Tensor
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    kernels: CpuKernels | None = None  # set: rotate in place with the C kernel


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
        kernels = kernels_for(self.cos)
        if kernels is not None and kernels.supports(dtype):
            return RotaryInputs(positions.long().contiguous(), kernels=kernels)
        cos = self.cos.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self.sin.index_select(0, positions).to(dtype).unsqueeze(1)
        return RotaryInputs(positions, cos, sin)

    def forward(
        self, inputs: RotaryInputs, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]; may rotate in place."""
        if inputs.kernels is not None:
            inputs.kernels.rotary_(q, inputs.positions, self.cos, self.sin)
            inputs.kernels.rotary_(k, inputs.positions, self.cos, self.sin)
            return q, k
        assert inputs.cos is not None and inputs.sin is not None
        return _rotate(q, inputs.cos, inputs.sin), _rotate(k, inputs.cos, inputs.sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
