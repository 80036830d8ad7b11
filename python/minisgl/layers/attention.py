"""Self-attention around the pluggable backend: split qkv, q/k norm, rotary, attend."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from minisgl.core import get_global_ctx

from .norm import RMSNorm
from .rotary import RotaryEmbedding, RotaryInputs


class AttentionLayer(nn.Module):
    """Takes the fused qkv projection of the batch's tokens, returns attention output."""

    def __init__(
        self,
        layer_id: int,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        qk_norm_eps: float | None = None,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        kv_size = num_kv_heads * head_dim
        self.split_sizes = [num_qo_heads * head_dim, kv_size, kv_size]
        self.rotary = rotary
        self.sliding_window = sliding_window
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None

    def forward(self, qkv: torch.Tensor, rope: RotaryInputs) -> torch.Tensor:
        ctx = get_global_ctx()
        batch, backend = ctx.batch, ctx.attn_backend
        assert backend is not None
        # The backend may run norms, rotary, KV store and attention as one block.
        fused = backend.attention_block(self, qkv, rope.positions, batch)
        if fused is not None:
            return fused
        q, k, v = self.qkv_inputs(qkv, rope)
        out = backend.forward(q, k, v, self.layer_id, batch)
        return out.reshape(-1, self.num_qo_heads * self.head_dim)

    def qkv_inputs(self, qkv: Tensor, rope: RotaryInputs) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v [tokens, heads, head_dim] from the fused projection, q and k normed (where
        the model has q/k norms) and rotated: what the backend attends with."""
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        q = q.reshape(-1, self.num_qo_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm.norm(q), self.k_norm.norm(k)
        q, k = self.rotary(rope, q, k)
        return q, k, v

    def qk_norms(self) -> tuple[Tensor, Tensor, float] | None:
        """(q norm weight, k norm weight, eps) where the model norms q and k per head."""
        if self.q_norm is None or self.k_norm is None:
            return None
        return self.q_norm.weight, self.k_norm.weight, self.q_norm.eps

    def rope_tables(self) -> tuple[Tensor, Tensor]:
        """The rotary cos/sin tables [max_positions, head_dim] (float32)."""
        return self.rotary.cos, self.rotary.sin
