"""Self-attention around the pluggable backend: split qkv, q/k norm, rotary, attend."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from minisgl.core import Context, get_global_ctx
from minisgl.kernel.cpu import MAX_GROUP

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
        assert ctx.attn_backend is not None
        if rope.kernels is not None:
            fused = self._attention_block(ctx, qkv, rope)
            if fused is not None:
                return fused
        q, k, v = self.qkv_inputs(qkv, rope)
        out = ctx.attn_backend.forward(q, k, v, self.layer_id, batch)
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

    def _attention_block(self, ctx: Context, qkv: Tensor, rope: RotaryInputs) -> Tensor | None:
        """Norms, rotary, KV store and attention in one C call, where the backend reads the pool
        in place for this batch (decode: paged attention; a bf16 prefill: the blocked kernel):
        the module path's kernels, the same results. None: take the module path."""
        backend, batch = ctx.attn_backend, ctx.batch
        assert backend is not None and ctx.kv_cache is not None and rope.kernels is not None
        if batch.out_loc is None or ctx.page_table is None or not qkv.is_contiguous():
            return None
        if batch.is_decode:
            attn_args = backend.paged_decode_args(batch)
            if attn_args is None or self.num_qo_heads // self.num_kv_heads > MAX_GROUP:
                return None
            run = rope.kernels.decode_attention_block
        else:
            attn_args = backend.prefill_args(batch)
            if attn_args is None or qkv.dtype != torch.bfloat16:
                return None
            run = rope.kernels.prefill_attention_block
        qk_norms = None
        if self.q_norm is not None and self.k_norm is not None:
            qk_norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        return run(
            qkv,
            qk_norms,
            ctx.kv_cache.k_cache(self.layer_id),
            ctx.kv_cache.v_cache(self.layer_id),
            batch.out_loc,
            rope.positions,
            (self.rotary.cos, self.rotary.sin),
            ctx.page_table,
            attn_args,  # type: ignore[arg-type]
            self.num_qo_heads,
            self.sliding_window,
        )
