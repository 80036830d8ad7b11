"""The attention kernels' wrappers (csrc/attention_decode.c, attention_blocked.c): paged decode
attention with an optional cascade prefix, and the blocked bf16 kernels for prefill and for a
prefix shared by the whole batch."""

from __future__ import annotations

import torch

from minisgl.kernel.abi import (
    DTYPE_CODES,
    MAX_HEAD_DIM,
    OK,
    check_heads,
    check_prefill_tokens,
    check_prefix_state,
    check_status,
    decode_attention_error,
)
from minisgl.kernel.library import KernelLibrary
from minisgl.kernel.threads import kernel_threads


class AttentionKernels(KernelLibrary):
    """Attention over the paged KV pool: decode (one query per request), prefill, shared prefix."""

    def decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        page_table: torch.Tensor,
        rows: torch.Tensor,
        kv_lens: torch.Tensor,
        scale: float,
        window: int | None,
        prefix: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One query per request over its first kv_lens[b] positions of page_table[rows[b]].

        q: [B, heads, dim]; caches: [slots, kv_heads, dim]; page_table: int32 [rows, max_len];
        rows, kv_lens: int64 [B]. prefix = (kv_starts int64 [B], out float32 [B, heads, dim],
        lse float32 [B, heads]): attention over positions before kv_starts[b], merged in.
        Any GQA group, head_dim up to MAX_HEAD_DIM, page size and batch. Returns [B, heads, dim].
        """
        num_reqs, num_heads, head_dim = q.shape
        # One test per call (the C checks heads and head_dim itself); the error says what failed.
        if not (
            q.is_contiguous()
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
            and rows.is_contiguous()
            and kv_lens.is_contiguous()
            and k_cache.shape[2] == head_dim
            and q.dtype == k_cache.dtype == v_cache.dtype
            and rows.shape == kv_lens.shape == (num_reqs,)
            and page_table.dtype == torch.int32
            and page_table.stride(1) == 1
        ):
            decode_attention_error(q, k_cache, v_cache, page_table, rows, kv_lens)
        out = torch.empty_like(q)
        starts, prefix_out, prefix_lse = prefix if prefix is not None else (None, None, None)
        if prefix is not None:
            check_prefix_state("decode_attention", q, prefix)
        status = self.lib.minisgl_decode_attention(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            out.data_ptr(),
            page_table.data_ptr(),
            page_table.stride(0),
            rows.data_ptr(),
            kv_lens.data_ptr(),
            None if starts is None else starts.data_ptr(),
            None if prefix_out is None else prefix_out.data_ptr(),
            None if prefix_lse is None else prefix_lse.data_ptr(),
            num_reqs,
            num_heads,
            k_cache.shape[1],
            head_dim,
            scale,
            window or 0,
            DTYPE_CODES[q.dtype],
            kernel_threads(),
        )
        if status != OK:
            check_heads("decode_attention", num_heads, k_cache.shape[1], head_dim)
            check_status("decode_attention", status)
        return out

    def blocked_attention_fits(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether the blocked attention kernels (prefill, shared prefix) take this KV: bf16,
        head_dim a multiple of 32 up to MAX_HEAD_DIM, on a CPU with avx512_bf16 (they run on
        the AMX tiles where it has them)."""
        return (
            self.has_avx512_bf16
            and dtype == torch.bfloat16
            and head_dim % 32 == 0
            and head_dim <= MAX_HEAD_DIM
        )

    def shared_prefix_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every query token of q [tokens, heads, dim] (bf16) against the KV at `slots`: (out
        [tokens, heads, dim] float32, lse [tokens, heads] float32), the state decode_attention's
        prefix continues from; None where it does not apply (`blocked_attention_fits`)."""
        tokens, num_heads, head_dim = q.shape
        if not self.blocked_attention_fits(q.dtype, head_dim) or k_cache.dtype != q.dtype:
            return None
        if len(slots) == 0:
            return None
        check_heads("shared_prefix_attention", num_heads, k_cache.shape[1], head_dim)
        q, slots = q.contiguous(), slots.to(torch.int64).contiguous()
        out = torch.empty(tokens, num_heads, head_dim, dtype=torch.float32)
        lse = torch.empty(tokens, num_heads, dtype=torch.float32)
        status = self.lib.minisgl_shared_prefix_attention(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            slots.data_ptr(),
            len(slots),
            out.data_ptr(),
            lse.data_ptr(),
            tokens,
            num_heads,
            k_cache.shape[1],
            head_dim,
            scale,
            int(self.has_amx),
            kernel_threads(),
        )
        check_status("shared_prefix_attention", status)
        return out, lse

    def prefill_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        page_table: torch.Tensor,
        rows: torch.Tensor,
        cached_lens: torch.Tensor,
        extend_lens: torch.Tensor,
        scale: float,
        window: int | None,
    ) -> torch.Tensor | None:
        """Causal attention of a prefill batch: the new tokens of request b
        (consecutive rows of q [tokens, heads, dim], bf16) attend to the KV of page-table row
        rows[b] up to their own positions (cached_lens[b] + j; the new K/V already stored).
        Returns out [tokens, heads, dim] bf16, or None where it does not apply."""
        tokens, num_heads, head_dim = q.shape
        if not self.blocked_attention_fits(q.dtype, head_dim) or k_cache.dtype != q.dtype:
            return None
        check_heads("prefill_attention", num_heads, k_cache.shape[1], head_dim)
        assert page_table.dtype == torch.int32 and page_table.is_contiguous()
        q = q.contiguous()
        rows, cached_lens, extend_lens = (
            t.to(torch.int64).contiguous() for t in (rows, cached_lens, extend_lens)
        )
        check_prefill_tokens("prefill_attention", tokens, extend_lens)
        out = torch.empty_like(q)
        status = self.lib.minisgl_prefill_attention(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            out.data_ptr(),
            page_table.data_ptr(),
            page_table.shape[1],
            rows.data_ptr(),
            cached_lens.data_ptr(),
            extend_lens.data_ptr(),
            len(rows),
            num_heads,
            k_cache.shape[1],
            head_dim,
            scale,
            window or 0,
            int(self.has_amx),
            kernel_threads(),
        )
        check_status("prefill_attention", status)
        return out
