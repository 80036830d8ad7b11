"""CPU attention: decode steps through the C paged kernel, everything else through SDPA."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from minisgl.core import Batch
from minisgl.kernel.cpu import MAX_GROUP, MAX_HEAD_DIM, CpuKernels
from minisgl.kvcache import BaseKVCache

from .torch_backend import TorchAttnBackend


@dataclass
class CpuDecodeMetadata:
    rows: torch.Tensor  # [B] int64 page-table row of each request
    kv_lens: torch.Tensor  # [B] int64 positions each request attends to (its new token's too)


class CpuAttnBackend(TorchAttnBackend):
    """Decode reads each request's KV slots in place (no gather, no padding); one query per
    request, heads of a GQA group sharing every key/value read. Prefill uses the torch backend.
    """

    def __init__(
        self,
        kv_cache: BaseKVCache,
        page_table: torch.Tensor,
        sliding_windows: tuple[int | None, ...],
        kernels: CpuKernels,
    ) -> None:
        super().__init__(kv_cache, page_table, sliding_windows)
        self.kernels = kernels

    def _kernel_fits(self, batch: Batch) -> bool:
        k_cache = self.kv_cache.k_cache(0)
        return (
            batch.is_decode
            and self.kernels.supports(k_cache.dtype)
            and k_cache.shape[-1] <= MAX_HEAD_DIM
        )

    def prepare_metadata(self, batch: Batch) -> None:
        if not self._kernel_fits(batch):
            return super().prepare_metadata(batch)
        reqs = batch.reqs
        rows = torch.tensor([r.table_idx for r in reqs], dtype=torch.int64)
        kv_lens = torch.tensor([r.device_len for r in reqs], dtype=torch.int64)
        batch.attn_metadata = CpuDecodeMetadata(rows, kv_lens)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch
    ) -> torch.Tensor:
        meta = batch.attn_metadata
        if isinstance(meta, CpuDecodeMetadata) and q.shape[1] // k.shape[1] > MAX_GROUP:
            super().prepare_metadata(batch)  # a GQA group wider than the kernel's buffers
            meta = batch.attn_metadata
        if not isinstance(meta, CpuDecodeMetadata):
            return super().forward(q, k, v, layer_id, batch)
        assert batch.out_loc is not None
        self.kv_cache.store_kv(k, v, batch.out_loc, layer_id)
        return self.kernels.decode_attention(
            q.contiguous(),
            self.kv_cache.k_cache(layer_id),
            self.kv_cache.v_cache(layer_id),
            self.page_table,
            meta.rows,
            meta.kv_lens,
            1.0 / math.sqrt(q.shape[-1]),
            self.sliding_windows[layer_id],
        )
