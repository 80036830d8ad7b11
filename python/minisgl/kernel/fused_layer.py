"""The fused kernels' wrappers (csrc/fused_layer.c): the attention blocks (q/k norms, rotary,
KV store and attention from the fused qkv projection in one call) and the whole bf16 decoder
layer for a decode batch, whole or in its two halves around the attention."""

from __future__ import annotations

import ctypes
import math

import torch

from minisgl.kernel.abi import (
    DTYPE_CODES,
    DecodeLayerParams,
    DecodeModelParams,
    ProjectionParams,
    check_block_inputs,
    check_prefill_tokens,
    check_status,
    require,
)
from minisgl.kernel.attention import AttentionKernels
from minisgl.kernel.threads import kernel_threads


class FusedLayerKernels(AttentionKernels):
    """Several kernels in one C call, in the order the PyTorch modules run them."""

    @staticmethod
    def _block_args(
        qkv: torch.Tensor,
        qk_norms: tuple[torch.Tensor, torch.Tensor, float] | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out_loc: torch.Tensor,
        positions: torch.Tensor,
        rope_tables: tuple[torch.Tensor, torch.Tensor],
        page_table: torch.Tensor,
        num_heads: int,
    ) -> tuple[torch.Tensor, torch.Tensor, list]:
        """The output [tokens, num_heads * head_dim] of an attention block call, its query
        scratch (keep it alive until the call returns) and the C functions' common leading
        arguments."""
        assert page_table.dtype == torch.int32 and page_table.is_contiguous()
        assert out_loc.dtype == positions.dtype == torch.int64
        assert qkv.is_contiguous() and out_loc.is_contiguous() and positions.is_contiguous()
        check_block_inputs(qkv, k_cache, out_loc, positions, rope_tables, num_heads)
        q_buf = qkv.new_empty(qkv.shape[0], num_heads * k_cache.shape[2])
        out = torch.empty_like(q_buf)
        q_norm, k_norm, eps = qk_norms if qk_norms is not None else (None, None, 0.0)
        tensors = [qkv, q_buf, out, q_norm, k_norm, k_cache, v_cache, out_loc, positions]
        tensors += [rope_tables[0], rope_tables[1]]
        ptr = [None if t is None else t.data_ptr() for t in tensors]
        table = [rope_tables[0].shape[0], page_table.data_ptr(), page_table.stride(0)]
        return out, q_buf, [*ptr[:5], eps, *ptr[5:], *table]

    def decode_attention_block(
        self,
        qkv: torch.Tensor,
        qk_norms: tuple[torch.Tensor, torch.Tensor, float] | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out_loc: torch.Tensor,
        positions: torch.Tensor,
        rope_tables: tuple[torch.Tensor, torch.Tensor],
        page_table: torch.Tensor,
        paged: tuple[torch.Tensor, torch.Tensor],
        num_heads: int,
        window: int | None,
    ) -> torch.Tensor:
        """Decode attention from the fused qkv projection [tokens, q | k | v] (left as it is):
        q/k norms (weights, eps), rotary, KV store at out_loc (int64), paged attention over
        paged = (page-table rows, KV lengths). Returns [tokens, num_heads * head_dim]."""
        out, _q_buf, args = self._block_args(
            qkv, qk_norms, k_cache, v_cache, out_loc, positions, rope_tables, page_table, num_heads
        )
        rows, kv_lens = paged
        status = self.lib.minisgl_decode_attention_block(
            *args,
            rows.data_ptr(),
            kv_lens.data_ptr(),
            qkv.shape[0],
            num_heads,
            k_cache.shape[1],
            k_cache.shape[2],
            1.0 / math.sqrt(k_cache.shape[2]),
            window or 0,
            DTYPE_CODES[qkv.dtype],
            kernel_threads(),
        )
        check_status("decode_attention_block", status, positions, rope_tables[0].shape[0])
        return out

    def prefill_attention_block(
        self,
        qkv: torch.Tensor,
        qk_norms: tuple[torch.Tensor, torch.Tensor, float] | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out_loc: torch.Tensor,
        positions: torch.Tensor,
        rope_tables: tuple[torch.Tensor, torch.Tensor],
        page_table: torch.Tensor,
        prefill: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        num_heads: int,
        window: int | None,
    ) -> torch.Tensor | None:
        """Prefill attention from the fused bf16 qkv projection, as decode_attention_block;
        prefill: (page-table rows, cached lens, extend lens) per request as `prefill_attention`
        takes them. Returns [tokens, num_heads * head_dim], or None where the blocked kernel
        does not apply (`blocked_attention_fits`)."""
        assert qkv.dtype == k_cache.dtype == torch.bfloat16 and qkv.is_contiguous()
        if not self.blocked_attention_fits(qkv.dtype, k_cache.shape[2]):
            return None
        out, _q_buf, args = self._block_args(
            qkv, qk_norms, k_cache, v_cache, out_loc, positions, rope_tables, page_table, num_heads
        )
        rows, cached_lens, extend_lens = (t.to(torch.int64).contiguous() for t in prefill)
        check_prefill_tokens("prefill_attention_block", qkv.shape[0], extend_lens)
        status = self.lib.minisgl_prefill_attention_block(
            *args,
            rows.data_ptr(),
            cached_lens.data_ptr(),
            extend_lens.data_ptr(),
            len(rows),
            qkv.shape[0],
            num_heads,
            k_cache.shape[1],
            k_cache.shape[2],
            1.0 / math.sqrt(k_cache.shape[2]),
            window or 0,
            int(self.has_amx),
            kernel_threads(),
        )
        check_status("prefill_attention_block", status, positions, rope_tables[0].shape[0])
        return out

    def lora_add(
        self, x: torch.Tensor, y: torch.Tensor, params: ProjectionParams, slots: torch.Tensor
    ) -> None:
        """y [tokens, N] += each row's adapter delta in place (bf16 x [tokens, K], slots int64
        [tokens], -1: none), as the C decode layer adds it (params: the LoRA fields)."""
        require(
            x.dtype == y.dtype == torch.bfloat16 and slots.dtype == torch.int64,
            f"lora_add: x {x.dtype}, y {y.dtype}, slots {slots.dtype}",
        )
        require(
            x.is_contiguous() and y.is_contiguous() and slots.is_contiguous(),
            "lora_add: x, y and slots must be contiguous",
        )
        tokens, width = y.shape
        require(x.shape[0] == tokens == slots.shape[0], "lora_add: rows of x, y, slots differ")
        status = self.lib.minisgl_lora_add(
            x.data_ptr(),
            y.data_ptr(),
            tokens,
            width,
            x.shape[1],
            ctypes.byref(params),
            slots.data_ptr(),
            kernel_threads(),
        )
        check_status("lora_add", status)

    def decode_layer_scratch(self, model: DecodeModelParams, tokens: int) -> int:
        """Elements of the bf16 scratch the decode layer kernels need for `tokens` tokens."""
        return self.lib.minisgl_decode_layer_scratch(ctypes.byref(model), tokens)

    def decode_layers(
        self,
        layers: ctypes.Array[DecodeLayerParams],
        model: DecodeModelParams,
        x: torch.Tensor,
        positions: torch.Tensor,
        rows: torch.Tensor,
        kv_lens: torch.Tensor,
        out_loc: torch.Tensor,
        scratch: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every bf16 decoder layer of `layers` in turn for x [tokens, hidden] (one decode token
        per request), as DecoderLayer.forward computes each: returns the last one's (MLP output,
        residual). scratch: bf16 of decode_layer_scratch(model, tokens) elements."""
        tokens, needed = x.shape[0], self.decode_layer_scratch(model, x.shape[0])
        require(scratch.numel() >= needed, f"decode_layers: scratch {scratch.numel()} < {needed}")
        out, residual = torch.empty_like(x), torch.empty_like(x)
        status = self.lib.minisgl_decode_layers(
            layers,
            len(layers),
            ctypes.byref(model),
            x.data_ptr(),
            residual.data_ptr(),
            out.data_ptr(),
            scratch.data_ptr(),
            tokens,
            positions.data_ptr(),
            rows.data_ptr(),
            kv_lens.data_ptr(),
            out_loc.data_ptr(),
            kernel_threads(),
        )
        check_status("decode_layers", status, positions, model.max_positions)
        return out, residual

    def decode_layer_begin(
        self,
        layer: DecodeLayerParams,
        model: DecodeModelParams,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        out_loc: torch.Tensor,
        scratch: torch.Tensor,
    ) -> torch.Tensor:
        """decode_layer up to the attention: input norm, qkv projection, q/k norms, rotary and
        the KV store; the queries land in scratch (`decode_layer_queries`). Returns the
        residual."""
        new_residual = torch.empty_like(x) if residual is None else residual
        status = self.lib.minisgl_decode_layer_begin(
            ctypes.byref(layer),
            ctypes.byref(model),
            x.data_ptr(),
            new_residual.data_ptr(),
            residual is not None,
            scratch.data_ptr(),
            x.shape[0],
            positions.data_ptr(),
            out_loc.data_ptr(),
            kernel_threads(),
        )
        check_status("decode_layer_begin", status, positions, model.max_positions)
        return new_residual

    def decode_layer_queries(
        self, model: DecodeModelParams, scratch: torch.Tensor, tokens: int
    ) -> torch.Tensor:
        """Where decode_layer_begin leaves the rotated queries: [tokens, heads, head_dim], a
        view of scratch (the same for every layer of a step)."""
        offset = self.lib.minisgl_decode_layer_q_offset(ctypes.byref(model), tokens)
        q_width = model.num_heads * model.head_dim
        return scratch[offset : offset + tokens * q_width].view(tokens, model.num_heads, -1)

    def decode_layer_end(
        self,
        layer: DecodeLayerParams,
        model: DecodeModelParams,
        residual: torch.Tensor,
        rows: torch.Tensor,
        kv_lens: torch.Tensor,
        scratch: torch.Tensor,
        prefix: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rest of decode_layer after decode_layer_begin: paged attention (merged with a
        prefix state as in decode_attention), o projection, post-attention norm and MLP.
        Returns (MLP output, residual)."""
        out = torch.empty_like(residual)
        starts, prefix_out, prefix_lse = prefix if prefix is not None else (None, None, None)
        status = self.lib.minisgl_decode_layer_end(
            ctypes.byref(layer),
            ctypes.byref(model),
            residual.data_ptr(),
            out.data_ptr(),
            scratch.data_ptr(),
            residual.shape[0],
            rows.data_ptr(),
            kv_lens.data_ptr(),
            None if starts is None else starts.data_ptr(),
            None if prefix_out is None else prefix_out.data_ptr(),
            None if prefix_lse is None else prefix_lse.data_ptr(),
            kernel_threads(),
        )
        check_status("decode_layer_end", status)
        return out, residual
