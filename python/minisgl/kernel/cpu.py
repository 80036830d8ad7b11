"""CPU kernels in C (`csrc/cpu_kernels.c`), built once per machine with gcc and called via ctypes.

`cpu_kernels()` returns None when they cannot be used (no compiler, not x86/Linux, or
MINISGL_CPU_KERNELS=0); callers then take their pure-PyTorch path, which computes the same thing.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import platform
import shutil

import torch

from minisgl.env import ENV
from minisgl.kernel.abi import (
    MAX_GROUP,
    MAX_HEAD_DIM,
    MAX_INTERMEDIATE,
    MAX_NORM_HIDDEN,
    OK,
    RESTYPES,
    SIGNATURES,
    DecodeLayerParams,
    DecodeModelParams,
    check_block_inputs,
    check_heads,
    check_prefill_tokens,
    check_prefix_state,
    check_rope_tables,
    check_status,
    decode_attention_error,
    raise_not_contiguous,
    require,
)
from minisgl.kernel.build import NATIVE_FLAGS, TARGETS, build_library, can_run

logger = logging.getLogger(__name__)

__all__ = ["MAX_GROUP", "MAX_HEAD_DIM", "MAX_INTERMEDIATE", "MAX_NORM_HIDDEN"]
__all__ += ["CpuKernels", "DecodeLayerParams", "DecodeModelParams", "cpu_kernels", "kernels_for"]
__all__ += ["NO_CAP", "kernel_threads", "set_thread_cap"]

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
# At most this many threads per C kernel call, whatever torch's count in the calling thread. The
# engine's thread governor sets it from its sampling thread, so a step already running takes
# fewer threads from its next kernel on when a core turns busy (torch's own count, a per-thread
# OpenMP setting, only changes between steps).
NO_CAP = 1 << 30
_thread_cap = NO_CAP


def set_thread_cap(threads: int) -> None:
    """Cap the threads of every later C kernel call (any int >= 1)."""
    global _thread_cap
    _thread_cap = max(1, threads)


def kernel_threads() -> int:
    """Threads a C kernel call runs on: torch's count, capped by `set_thread_cap`."""
    return min(torch.get_num_threads(), _thread_cap)


# The machine's own build (tests/test_kernel_build.py builds it directly).
_build = build_library


class CpuKernels:
    """Typed wrappers over the C kernels; every tensor must be contiguous and on the CPU. Shapes
    a kernel cannot take raise ValueError, a failed C allocation MemoryError."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        for name, argtypes in SIGNATURES.items():
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = RESTYPES[name]
        self.has_avx512_bf16 = bool(lib.minisgl_has_avx512_bf16())
        # Built with the tile instructions and granted the tile state by the kernel.
        self.has_amx = ENV.CPU_AMX.value and bool(lib.minisgl_has_amx())

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in _DTYPE_CODES

    def gemv_bf16(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [M, K] @ weight [N, K]^T (+ bias) for small M, all bfloat16."""
        rows, in_features = x.shape
        if not (
            x.is_contiguous()
            and weight.is_contiguous()
            and weight.shape[1] == in_features
            and (bias is None or (bias.is_contiguous() and bias.shape == weight.shape[:1]))
        ):
            raise_not_contiguous("gemv_bf16", x=x, weight=weight, bias=bias)
            raise ValueError(
                f"gemv_bf16: weight {tuple(weight.shape)} / bias does not fit x {tuple(x.shape)}"
            )
        out = x.new_empty(rows, weight.shape[0])
        self.lib.minisgl_gemv_bf16(
            x.data_ptr(),
            weight.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            rows,
            weight.shape[0],
            in_features,
            kernel_threads(),
        )
        return out

    def packed_elems(self, out_features: int, in_features: int) -> int:
        """Elements of a [out_features, in_features] weight's packed copy (`pack_weight`)."""
        return int(self.lib.minisgl_packed_elems(out_features, in_features))

    def pack_weight(self, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """A bf16 weight [N, K] in the tile layout `packed_linear` takes (zero-padded), into
        `out` (contiguous, `packed_elems(N, K)` bf16 elements) when given."""
        out_features, in_features = weight.shape
        elems = self.packed_elems(out_features, in_features)
        require(
            weight.dtype == torch.bfloat16 and weight.is_contiguous(),
            f"pack_weight: weight must be contiguous bfloat16, got {weight.dtype}",
        )
        packed = weight.new_empty(elems) if out is None else out
        require(
            packed.numel() == elems and packed.dtype == torch.bfloat16 and packed.is_contiguous(),
            f"pack_weight: out of {packed.numel()} {packed.dtype} elements for {elems} bfloat16",
        )
        self.lib.minisgl_pack_weight(
            weight.data_ptr(), packed.data_ptr(), out_features, in_features, kernel_threads()
        )
        return packed

    def _check_packed(self, kernel: str, packed: torch.Tensor, n: int, k: int) -> None:
        if not (packed.numel() == self.lib.minisgl_packed_elems(n, k)):
            raise ValueError(
                f"{kernel}: packed weight of {packed.numel()} elements is not [{n}, {k}] packed"
            )

    def packed_linear(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        out_features: int,
        bias: torch.Tensor | None,
        float_out: bool = False,
        out: torch.Tensor | None = None,
        tiles: bool = True,
    ) -> torch.Tensor:
        """x [M, K] @ W^T (+ bias), W packed by `pack_weight`; bfloat16 in, bfloat16 out (float32
        with float_out: the sums unrounded), into `out` when given. On the AMX tiles where the
        CPU has them and `tiles` asks, else with vdpbf16ps (RuntimeError in a build without
        avx512_bf16)."""
        rows, in_features = x.shape
        if not (x.is_contiguous() and (bias is None or bias.is_contiguous())):
            raise_not_contiguous("packed_linear", x=x, bias=bias)
        self._check_packed("packed_linear", packed, out_features, in_features)
        dtype = torch.float32 if float_out else x.dtype
        if out is None:
            out = x.new_empty(rows, out_features, dtype=dtype)
        elif out.shape != (rows, out_features) or out.dtype != dtype or not out.is_contiguous():
            raise ValueError(
                f"out must be a contiguous {dtype} tensor of shape {(rows, out_features)}, got "
                f"{out.dtype} {tuple(out.shape)}"
            )
        status = self.lib.minisgl_packed_linear(
            x.data_ptr(),
            packed.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            rows,
            out_features,
            in_features,
            int(float_out),
            int(self.has_amx and tiles),
            kernel_threads(),
        )
        check_status("packed_linear", status)
        return out

    def packed_gated_silu(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        inter: int,
        bias: torch.Tensor | None,
        tiles: bool = True,
    ) -> torch.Tensor:
        """silu(x @ gate^T) * (x @ up^T) [M, inter] from a gate_up weight packed by
        `pack_weight` with its gate and up rows interleaved in 16s (`interleave_gate_up`); on
        the tiles as `packed_linear`."""
        rows, in_features = x.shape
        require(inter % 16 == 0, f"packed_gated_silu: inter {inter} is not a multiple of 16")
        if not (x.is_contiguous() and (bias is None or bias.is_contiguous())):
            raise_not_contiguous("packed_gated_silu", x=x, bias=bias)
        self._check_packed("packed_gated_silu", packed, 2 * inter, in_features)
        out = x.new_empty(rows, inter)
        status = self.lib.minisgl_packed_gated_silu(
            x.data_ptr(),
            packed.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            rows,
            inter,
            in_features,
            int(self.has_amx and tiles),
            kernel_threads(),
        )
        check_status("packed_gated_silu", status)
        return out

    def packed_rows(
        self, packed: torch.Tensor, ids: torch.Tensor, out_features: int, in_features: int
    ) -> torch.Tensor:
        """Rows `ids` [count] of a bf16 weight [out_features, in_features] read from its packed
        copy: [count, in_features], equal to indexing the weight."""
        self._check_packed("packed_rows", packed, out_features, in_features)
        ids = ids.to(torch.int64).contiguous()
        out = packed.new_empty(ids.numel(), in_features)
        status = self.lib.minisgl_packed_rows(
            packed.data_ptr(),
            ids.data_ptr(),
            out.data_ptr(),
            ids.numel(),
            out_features,
            in_features,
            kernel_threads(),
        )
        if status != 0:
            bad = ids[(ids < 0) | (ids >= out_features)]
            raise IndexError(f"packed_rows: row {int(bad[0])} outside [0, {out_features})")
        return out

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
            _DTYPE_CODES[q.dtype],
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

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); with no residual, x itself is the residual."""
        rows, hidden = x.shape
        if not (
            x.is_contiguous()
            and weight.is_contiguous()
            and weight.shape == (hidden,)
            and (residual is None or (residual.is_contiguous() and residual.shape == x.shape))
        ):
            raise_not_contiguous("add_rms_norm", x=x, residual=residual, weight=weight)
            raise ValueError(
                f"add_rms_norm: weight {tuple(weight.shape)} / residual does not fit x "
                f"{tuple(x.shape)}"
            )
        out = torch.empty_like(x)
        new_residual = x if residual is None else torch.empty_like(x)
        self.lib.minisgl_add_rms_norm(
            x.data_ptr(),
            None if residual is None else residual.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            None if residual is None else new_residual.data_ptr(),
            rows,
            hidden,
            eps,
            _DTYPE_CODES[x.dtype],
            kernel_threads(),
        )
        return out, new_residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        rows, width = gate_up.shape
        if not gate_up.is_contiguous():
            raise_not_contiguous("silu_and_mul", gate_up=gate_up)
        if width % 2:
            raise ValueError(f"silu_and_mul: gate_up width {width} is odd")
        out = gate_up.new_empty(rows, width // 2)
        self.lib.minisgl_silu_and_mul(
            gate_up.data_ptr(),
            out.data_ptr(),
            rows,
            width // 2,
            _DTYPE_CODES[gate_up.dtype],
            kernel_threads(),
        )
        return out

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Row-wise argmax of x [rows, cols] float32 or bf16 (first index on ties, a NaN wins),
        int64."""
        x = x.contiguous()
        require(x.shape[1] > 0, "argmax: rows of 0 columns have no argmax")
        indices = torch.empty(x.shape[0], dtype=torch.int64)
        self.lib.minisgl_argmax(
            x.data_ptr(),
            indices.data_ptr(),
            x.shape[0],
            x.shape[1],
            _DTYPE_CODES[x.dtype],
            kernel_threads(),
        )
        return indices

    def sample_rows(
        self,
        weights: torch.Tensor,
        uniforms: torch.Tensor,
        temperatures: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A draw from each row of weights [rows, cols] (float32, >= 0, not all zero): the first
        column whose running sum exceeds uniforms [rows] (float64 in [0, 1)) times the row's
        total. Given temperatures [rows] (float32, > 0), the rows are logits and the weights
        softmax(row / temperature), computed on the fly. int64 [rows]."""
        weights, uniforms = weights.contiguous(), uniforms.contiguous()
        assert weights.dtype == torch.float32 and uniforms.dtype == torch.float64
        rows, cols = weights.shape
        require(cols > 0, "sample_rows: rows of 0 columns have nothing to draw")
        if not (
            uniforms.shape == (rows,) and (temperatures is None or temperatures.shape == (rows,))
        ):
            raise ValueError(
                f"sample_rows: uniforms {tuple(uniforms.shape)} / temperatures for {rows} rows"
            )
        if temperatures is not None:
            temperatures = temperatures.to(torch.float32).contiguous()
        tokens = torch.empty(rows, dtype=torch.int64)
        self.lib.minisgl_sample_rows(
            weights.data_ptr(),
            None if temperatures is None else temperatures.data_ptr(),
            uniforms.data_ptr(),
            tokens.data_ptr(),
            rows,
            cols,
            kernel_threads(),
        )
        return tokens

    def top_candidates(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k largest values of each row of x [rows, cols] (float32, k <= cols), largest
        first (the first column first among equals), and their columns (int64)."""
        x = x.contiguous()
        assert x.dtype == torch.float32
        require(0 < k <= x.shape[1], f"top_candidates: k {k} is outside 1..{x.shape[1]}")
        values = torch.empty(x.shape[0], k, dtype=torch.float32)
        indices = torch.empty(x.shape[0], k, dtype=torch.int64)
        status = self.lib.minisgl_top_candidates(
            x.data_ptr(),
            x.shape[0],
            x.shape[1],
            k,
            values.data_ptr(),
            indices.data_ptr(),
            kernel_threads(),
        )
        check_status("top_candidates", status)
        return values, indices

    def rotary_(
        self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        """RoPE in place on x [tokens, heads, dim] (dim contiguous; tokens may be strided);
        positions int64 [tokens], each within cos/sin float32 [max_positions, dim] (else
        ValueError, x untouched)."""
        tokens, heads, head_dim = x.shape
        if not (
            x.stride(2) == 1
            and x.stride(1) == head_dim
            and positions.dtype == torch.int64
            and positions.shape == (tokens,)
            and positions.is_contiguous()
        ):
            raise ValueError(
                f"rotary: x {tuple(x.shape)} (strides {x.stride()}) needs contiguous heads, "
                f"positions {positions.dtype} {tuple(positions.shape)} one contiguous int64 each"
            )
        check_rope_tables("rotary", head_dim, (cos, sin))
        status = self.lib.minisgl_rotary(
            x.data_ptr(),
            tokens,
            x.stride(0),
            heads,
            head_dim,
            positions.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            cos.shape[0],
            _DTYPE_CODES[x.dtype],
            kernel_threads(),
        )
        check_status("rotary", status, positions, cos.shape[0])

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
            _DTYPE_CODES[qkv.dtype],
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

    def decode_layer_scratch(self, model: DecodeModelParams, tokens: int) -> int:
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


@functools.cache
def cpu_kernels() -> CpuKernels | None:
    """The built kernels, or None (with the reason logged once) when they are unavailable."""
    if not ENV.CPU_KERNELS.value:
        return None
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        logger.info("CPU kernels: not built on %s/%s", platform.system(), platform.machine())
        return None
    if shutil.which("gcc") is None:
        logger.warning("CPU kernels: gcc not found; using the PyTorch fallbacks")
        return None
    try:
        return CpuKernels(ctypes.CDLL(str(_build(target_flags(ENV.CPU_TARGET.value)))))
    except (OSError, RuntimeError) as exc:
        logger.warning("CPU kernels unavailable, using the PyTorch fallbacks: %s", exc)
        return None


def target_flags(name: str) -> tuple[str, ...]:
    """gcc's target flags for MINISGL_CPU_TARGET: "native", or a build.TARGETS name this CPU runs."""
    if name == "native":
        return NATIVE_FLAGS
    target = next((t for t in TARGETS if t.name == name), None)
    if target is None:
        names = ["native", *(t.name for t in TARGETS)]
        raise ValueError(f"MINISGL_CPU_TARGET={name!r}: choose one of {names}")
    if not can_run(target):
        raise RuntimeError(f"MINISGL_CPU_TARGET={name!r}: this CPU cannot run that build")
    return target.flags


def kernels_for(x: torch.Tensor) -> CpuKernels | None:
    """The kernels if they can take this tensor (on the CPU, float32 or bfloat16), else None."""
    if x.device.type != "cpu":
        return None
    kernels = cpu_kernels()
    return kernels if kernels is not None and kernels.supports(x.dtype) else None
