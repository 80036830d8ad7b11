"""CPU attention: decode steps and short extends through the C paged kernel, prefills through the
C blocked kernel or SDPA."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from minisgl.core import AttentionSpec, Batch
from minisgl.kernel.cpu import MAX_GROUP, MAX_HEAD_DIM, CpuKernels
from minisgl.kvcache import BaseKVCache

from .torch_backend import TorchAttnBackend


@dataclass
class CpuPagedMetadata:
    """One entry per query token (decode: per request)."""

    rows: torch.Tensor  # [tokens] int64 page-table row of the token's request
    kv_lens: torch.Tensor  # [tokens] int64 positions the token attends to (its own included)
    # Cascade: the first len(shared_slots) positions are the same slots for every request.
    shared_slots: torch.Tensor | None = None
    kv_starts: torch.Tensor | None = None  # [B] int64, all len(shared_slots)


@dataclass
class CpuPrefillMetadata:
    """A prefill through the C kernel: request b's new tokens follow its cached_lens[b]
    positions."""

    rows: torch.Tensor  # [B] int64 page-table row
    cached_lens: torch.Tensor  # [B] int64
    extend_lens: torch.Tensor  # [B] int64


class CpuAttnBackend(TorchAttnBackend):
    """Decode reads each request's KV slots in place (no gather, no padding); one query per
    request, heads of a GQA group sharing every key/value read. Prefill runs causal attention
    in the C blocked kernel where the pool is bf16 (on the AMX tiles where the CPU has them,
    else vdpbf16ps); without it, prefills of short extends (`paged_max_extend`) in the paged
    kernel as verify steps do, longer ones in the torch backend.

    Cascade: when every request of a batch starts with the same cached slots (a shared system
    prompt) of at least `cascade_min_prefix` positions, those are attended once for the whole
    batch as one matrix product (SDPA, all query tokens against the shared keys), and the kernel
    continues each token's softmax from there over its own request's positions. Prefills take
    this path too when every request extends by at most `cascade_max_extend` tokens.
    """

    cascade_min_prefix = 128
    cascade_max_extend = 256
    # The shared half runs on the AMX tiles below this many query tokens (decode batches, short
    # extends); past it SDPA's flash kernel is as fast (benchmark/cpu_kernels.py: 1.3x at 63
    # queries, level at 128-1,024, 0.9x at 1,024 on Qwen3's heads). Without tiles the
    # vdpbf16ps kernel takes every size (2.6-2.9x SDPA at 63 and 2,016 queries on Zen 5).
    tiles_max_shared_queries = 128
    # Without the blocked kernel, prefills whose every request extends by at most this many
    # tokens (a radix hit's last token, a short turn) run in the paged decode kernel, whose rows
    # are each the same bits in any batch: SDPA over the padded batch gave two identical
    # requests' last tokens other logits in one batch, and which copy the radix tree kept then
    # decided a later batch's greedy tokens (benchmark/speculative.py's chat prompts at batch 16).
    paged_max_extend = 16

    def __init__(
        self,
        kv_cache: BaseKVCache,
        page_table: torch.Tensor,
        sliding_windows: tuple[int | None, ...],
        kernels: CpuKernels,
    ) -> None:
        super().__init__(kv_cache, page_table, sliding_windows)
        self.kernels = kernels
        k_cache = kv_cache.k_cache(0)
        # The pool's dtype and head size decide once whether the kernel can read it.
        self.kernel_fits = kernels.supports(k_cache.dtype) and k_cache.shape[-1] <= MAX_HEAD_DIM
        self.prefill_in_kernel = kernels.blocked_attention_fits(k_cache.dtype, k_cache.shape[-1])

    def prepare_metadata(self, batch: Batch) -> None:
        reqs = batch.reqs
        if not self.kernel_fits:
            return super().prepare_metadata(batch)
        longest = max(r.extend_len for r in reqs)
        short = batch.is_prefill and longest <= self.paged_max_extend
        if batch.is_prefill and len(reqs) < 2 and (self.prefill_in_kernel or not short):
            return self._prepare_prefill(batch)
        rows = torch.tensor([r.table_idx for r in reqs], dtype=torch.int64)
        # Only positions every request had cached before this step can be shared.
        shared_max = min(r.cached_len for r in reqs)
        shared = 0
        no_windows = all(window is None for window in self.sliding_windows)
        if len(reqs) > 1 and no_windows and shared_max >= self.cascade_min_prefix:
            slots = self.page_table[rows, :shared_max]
            same = (slots == slots[:1]).all(dim=0)
            shared = shared_max if bool(same.all()) else int(same.int().argmin())
        if shared < self.cascade_min_prefix:
            shared = 0
        if batch.is_prefill:
            paged = shared or (short and not self.prefill_in_kernel)
            if not paged or longest > self.cascade_max_extend:
                return self._prepare_prefill(batch)
            assert batch.positions is not None
            extend_lens = torch.tensor([r.extend_len for r in reqs], dtype=torch.int64)
            meta = CpuPagedMetadata(
                rows.repeat_interleave(extend_lens), batch.positions.to("cpu", torch.int64) + 1
            )
        elif all(r.extend_len == 1 for r in reqs):
            meta = CpuPagedMetadata(
                rows, torch.tensor([r.device_len for r in reqs], dtype=torch.int64)
            )
        else:  # a verify step: each query position attends causally, its own KV included
            assert batch.positions is not None
            extend_lens = torch.tensor([r.extend_len for r in reqs], dtype=torch.int64)
            meta = CpuPagedMetadata(
                rows.repeat_interleave(extend_lens), batch.positions.to("cpu", torch.int64) + 1
            )
        if shared:
            meta.shared_slots = self.page_table[reqs[0].table_idx, :shared].long()
            meta.kv_starts = torch.full_like(meta.kv_lens, shared)
        batch.attn_metadata = meta

    def _prepare_prefill(self, batch: Batch) -> None:
        if not self.prefill_in_kernel:
            return super().prepare_metadata(batch)
        batch.attn_metadata = CpuPrefillMetadata(
            torch.tensor([r.table_idx for r in batch.reqs], dtype=torch.int64),
            torch.tensor([r.cached_len for r in batch.reqs], dtype=torch.int64),
            torch.tensor([r.extend_len for r in batch.reqs], dtype=torch.int64),
        )

    def attention_block(
        self, layer: AttentionSpec, qkv: torch.Tensor, positions: torch.Tensor, batch: Batch
    ) -> torch.Tensor | None:
        """Norms, rotary, KV store and attention in one C call where the kernels read the pool
        in place for this batch (decode: paged attention; a bf16 prefill: the blocked kernel):
        the module path's kernels, the same results."""
        if (
            batch.out_loc is None
            or not qkv.is_contiguous()
            or not self.kernels.supports(qkv.dtype)
            or positions.device.type != "cpu"
        ):
            return None
        if batch.is_decode:
            attn_args = self.paged_decode_args(batch)
            if attn_args is None or layer.num_qo_heads // layer.num_kv_heads > MAX_GROUP:
                return None
            run = self.kernels.decode_attention_block
        else:
            attn_args = self.prefill_args(batch)
            if attn_args is None or qkv.dtype != torch.bfloat16:
                return None
            run = self.kernels.prefill_attention_block
        return run(
            qkv,
            layer.qk_norms(),
            self.kv_cache.k_cache(layer.layer_id),
            self.kv_cache.v_cache(layer.layer_id),
            batch.out_loc,
            positions.long().contiguous(),
            layer.rope_tables(),
            self.page_table,
            attn_args,  # type: ignore[arg-type]
            layer.num_qo_heads,
            layer.sliding_window,
        )

    def paged_decode_args(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor] | None:
        meta = batch.attn_metadata
        if batch.is_decode and isinstance(meta, CpuPagedMetadata) and meta.shared_slots is None:
            return meta.rows, meta.kv_lens
        return None

    def prefill_args(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        meta = batch.attn_metadata
        if isinstance(meta, CpuPrefillMetadata):
            return meta.rows, meta.cached_lens, meta.extend_lens
        return None

    def cascade_decode_args(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor] | None:
        meta = batch.attn_metadata
        if batch.is_decode and isinstance(meta, CpuPagedMetadata) and meta.shared_slots is not None:
            return meta.rows, meta.kv_lens
        return None

    def shared_prefix_state(
        self, q: torch.Tensor, layer_id: int, batch: Batch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        meta = batch.attn_metadata
        if not isinstance(meta, CpuPagedMetadata) or meta.shared_slots is None:
            return None
        assert meta.kv_starts is not None
        scale = 1.0 / math.sqrt(q.shape[-1])
        out, lse = self._shared_prefix(q, meta.shared_slots, layer_id, scale)
        return meta.kv_starts, out, lse

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch
    ) -> torch.Tensor:
        meta = batch.attn_metadata
        if isinstance(meta, CpuPrefillMetadata):
            assert batch.out_loc is not None
            self.kv_cache.store_kv(k, v, batch.out_loc, layer_id)
            out = self.kernels.prefill_attention(
                q,
                self.kv_cache.k_cache(layer_id),
                self.kv_cache.v_cache(layer_id),
                self.page_table,
                meta.rows,
                meta.cached_lens,
                meta.extend_lens,
                1.0 / math.sqrt(q.shape[-1]),
                self.sliding_windows[layer_id],
            )
            if out is not None:
                return out
            super().prepare_metadata(batch)  # the kernel could not run (out of memory)
            return super().forward(q, k, v, layer_id, batch)
        if isinstance(meta, CpuPagedMetadata) and q.shape[1] // k.shape[1] > MAX_GROUP:
            super().prepare_metadata(batch)  # a GQA group wider than the kernel's buffers
            meta = batch.attn_metadata
        if not isinstance(meta, CpuPagedMetadata):
            return super().forward(q, k, v, layer_id, batch)
        assert batch.out_loc is not None
        self.kv_cache.store_kv(k, v, batch.out_loc, layer_id)
        q = q.contiguous()
        return self.kernels.decode_attention(
            q,
            self.kv_cache.k_cache(layer_id),
            self.kv_cache.v_cache(layer_id),
            self.page_table,
            meta.rows,
            meta.kv_lens,
            1.0 / math.sqrt(q.shape[-1]),
            self.sliding_windows[layer_id],
            self.shared_prefix_state(q, layer_id, batch),
        )

    def _shared_prefix(
        self, q: torch.Tensor, slots: torch.Tensor, layer_id: int, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every request's query against the shared keys at once: (out [B, heads, dim] float32,
        log-sum-exp [B, heads] float32)."""
        k_cache, v_cache = self.kv_cache.k_cache(layer_id), self.kv_cache.v_cache(layer_id)
        if len(q) < self.tiles_max_shared_queries or not self.kernels.has_amx:
            in_kernel = self.kernels.shared_prefix_attention(q, k_cache, v_cache, slots, scale)
            if in_kernel is not None:
                return in_kernel
        num_reqs, num_heads, head_dim = q.shape
        keys = k_cache.index_select(0, slots)  # [P, kv_heads, dim]
        values = v_cache.index_select(0, slots)
        kv_heads = keys.shape[1]
        group = num_heads // kv_heads
        # The queries of one kv head's group, from every request, form one sequence.
        queries = q.view(num_reqs, kv_heads, group, head_dim).permute(1, 2, 0, 3)
        queries = queries.reshape(1, kv_heads, group * num_reqs, head_dim)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            queries, keys.transpose(0, 1)[None], values.transpose(0, 1)[None], scale=scale
        )
        out = out.view(kv_heads, group, num_reqs, head_dim).permute(2, 0, 1, 3)
        lse = lse.view(kv_heads, group, num_reqs).permute(2, 0, 1)
        return (
            out.reshape(num_reqs, num_heads, head_dim).float().contiguous(),
            lse.reshape(num_reqs, num_heads).contiguous(),
        )
