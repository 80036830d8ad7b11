"""Attention backend interface: prepare per-batch metadata once, then attend per layer."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from minisgl.core import AttentionSpec, Batch


class BaseAttnBackend(ABC):
    """Stores the batch's new K/V into the pool and attends over each request's whole KV."""

    @abstractmethod
    def prepare_metadata(self, batch: Batch) -> None:
        """Fill `batch.attn_metadata`; called once per step before the forward."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch
    ) -> torch.Tensor:
        """q: [tokens, heads, dim]; k, v: [tokens, kv_heads, dim]. Returns [tokens, heads, dim]."""

    def attention_block(
        self, layer: AttentionSpec, qkv: torch.Tensor, positions: torch.Tensor, batch: Batch
    ) -> torch.Tensor | None:
        """The layer's q/k norms, rotary, KV store and attention from its fused qkv projection in
        one step, where this backend has one for the batch; None: the layer runs them itself."""
        return None

    def paged_decode_args(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(page-table rows, KV lengths) when this decode batch may run the fused C decode
        layer (its attention reads the pool in place through the page table), else None."""
        return None

    def prefill_args(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(page-table rows, cached lens, extend lens) when this prefill batch's attention may
        run inside the C prefill attention block (bf16 pool read in place), else None."""
        return None

    def cascade_decode_args(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """As paged_decode_args, for a decode batch whose requests share a cached prefix: the
        kernel reads each request's own positions and continues from shared_prefix_state."""
        return None

    def shared_prefix_state(
        self, q: torch.Tensor, layer_id: int, batch: Batch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(kv_starts [B], out [B, heads, dim] float32, lse [B, heads] float32): attention of
        q [B, heads, dim] over the prefix all of the batch's requests share, for the paged
        kernel to continue from; None when they share none."""
        return None
