"""Self-attention around the pluggable backend: split qkv, q/k norm, rotary, attend."""

from __future__ import annotations

import torch
from torch import nn

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
        batch = ctx.batch
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        q = q.reshape(-1, self.num_qo_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm.norm(q), self.k_norm.norm(k)
        q, k = self.rotary(rope, q, k)
        assert ctx.attn_backend is not None
        out = ctx.attn_backend.forward(q, k, v, self.layer_id, batch)
        return out.reshape(-1, self.num_qo_heads * self.head_dim)
