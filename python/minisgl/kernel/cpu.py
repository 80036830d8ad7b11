"""CPU kernels in C (`csrc/cpu_kernels.c`), built once per machine with gcc and called via ctypes.

`cpu_kernels()` returns None when they cannot be used (no compiler, not x86/Linux, or
MINISGL_CPU_KERNELS=0); callers then take their pure-PyTorch path, which computes the same thing.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from minisgl.env import ENV
from minisgl.utils.hf import cache_dir

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.c"
# -ffast-math lets gcc vectorise the float reductions and expf; it is given to the compile step
# only, because linking with it would flush denormals process-wide. Infinities and NaNs stay.
COMPILE_FLAGS = ["-O3", "-march=native", "-fPIC", "-fopenmp", "-ffast-math"]
COMPILE_FLAGS += ["-fno-finite-math-only"]
LINK_FLAGS = ["-shared", "-fopenmp", "-lm"]
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
# Stack buffers in the C kernels (elements per row).
MAX_NORM_HIDDEN, MAX_INTERMEDIATE, MAX_HEAD_DIM, MAX_GROUP = 8192, 16384, 256, 32

_ptr = ctypes.c_void_p
_i64 = ctypes.c_int64
_int = ctypes.c_int
_float = ctypes.c_float
_SIGNATURES: dict[str, list[type]] = {
    "minisgl_has_avx512_bf16": [],
    "minisgl_has_amx": [],
    "minisgl_gemv_bf16": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int],
    "minisgl_packed_elems": [_i64, _i64],
    "minisgl_pack_weight": [_ptr, _ptr, _i64, _i64, _int],
    "minisgl_packed_linear": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int, _int, _int],
    "minisgl_packed_gated_silu": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int, _int],
    "minisgl_decode_attention": [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr]
    + [_i64, _i64, _i64, _i64, _float, _i64, _int, _int],
    "minisgl_add_rms_norm": [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _float, _int, _int],
    "minisgl_silu_and_mul": [_ptr, _ptr, _i64, _i64, _int, _int],
    "minisgl_argmax": [_ptr, _ptr, _i64, _i64, _int, _int],
    "minisgl_sample_rows": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _int],
    "minisgl_top_candidates": [_ptr, _i64, _i64, _i64, _ptr, _ptr, _int],
    "minisgl_rotary": [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _int, _int],
    "minisgl_decode_attention_block": [_ptr, _ptr, _ptr, _ptr, _ptr, _float, _ptr, _ptr, _ptr]
    + [_ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _float, _i64, _int, _int],
    "minisgl_prefill_attention_block": [_ptr, _ptr, _ptr, _ptr, _ptr, _float, _ptr, _ptr, _ptr]
    + [_ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _float]
    + [_i64, _int, _int],
    "minisgl_decode_layer_scratch": [_ptr, _i64],
    "minisgl_decode_layers": [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr]
    + [_ptr, _int],
    "minisgl_decode_layer_q_offset": [_ptr, _i64],
    "minisgl_shared_prefix_attention": [_ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64]
    + [_i64, _i64, _float, _int, _int],
    "minisgl_prefill_attention": [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64]
    + [_i64, _i64, _i64, _float, _i64, _int, _int],
    "minisgl_decode_layer_begin": [_ptr, _ptr, _ptr, _ptr, _int, _ptr, _i64, _ptr, _ptr, _int],
    "minisgl_decode_layer_end": [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr]
    + [_int],
}
_RESTYPES = {
    "minisgl_shared_prefix_attention": _int,
    "minisgl_prefill_attention": _int,
    "minisgl_prefill_attention_block": _int,
    "minisgl_decode_layer_scratch": _i64,
    "minisgl_decode_layer_q_offset": _i64,
    "minisgl_packed_elems": _i64,
}


class DecodeLayerParams(ctypes.Structure):
    """One layer's weights and KV pool for the C decode layer (NULL: absent)."""

    _fields_ = [
        (name, _ptr)
        for name in (
            "input_norm",
            "post_norm",
            "q_norm",
            "k_norm",
            "qkv_w",
            "qkv_b",
            "o_w",
            "o_b",
            "gate_up_w",
            "gate_up_b",
            "down_w",
            "down_b",
            "qkv_t",
            "o_t",
            "gate_up_t",
            "down_t",
            "gate_up_tb",
            "k_cache",
            "v_cache",
        )
    ] + [("window", _i64)]


class DecodeModelParams(ctypes.Structure):
    """Shapes, norm epsilon, attention scale, rotary tables and page table of a model."""

    _fields_ = [
        ("hidden", _i64),
        ("inter", _i64),
        ("num_heads", _i64),
        ("num_kv_heads", _i64),
        ("head_dim", _i64),
        ("eps", _float),
        ("scale", _float),
        ("cos", _ptr),
        ("sin", _ptr),
        ("page_table", _ptr),
        ("table_stride", _i64),
        ("gemv_max_rows", _i64),
        ("use_tiles", _i64),
    ]


def _machine_tag() -> str:
    """What the built library depends on: source, flags, compiler and this CPU's features."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(" ".join(COMPILE_FLAGS + LINK_FLAGS).encode())
    digest.update(subprocess.run(["gcc", "--version"], capture_output=True).stdout)
    try:
        cpu_flags = next(
            line for line in Path("/proc/cpuinfo").read_text().splitlines() if line[:5] == "flags"
        )
    except (OSError, StopIteration):
        cpu_flags = platform.processor()
    digest.update(cpu_flags.encode())
    return digest.hexdigest()[:16]


def _build() -> Path:
    out = cache_dir() / "kernels" / f"cpu_kernels-{_machine_tag()}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        obj, lib = Path(tmp) / "k.o", Path(tmp) / "k.so"
        for cmd in (
            ["gcc", *COMPILE_FLAGS, "-c", str(SOURCE), "-o", str(obj)],
            ["gcc", str(obj), "-o", str(lib), *LINK_FLAGS],
        ):
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr}")
        os.replace(lib, out)  # atomic: concurrent builders each publish a complete file
    logger.info("built CPU kernels into %s", out)
    return out


class CpuKernels:
    """Typed wrappers over the C kernels; every tensor must be contiguous and on the CPU."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        for name, argtypes in _SIGNATURES.items():
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = _RESTYPES.get(name, _int)
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
        out = x.new_empty(rows, weight.shape[0])
        self.lib.minisgl_gemv_bf16(
            x.data_ptr(),
            weight.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            rows,
            weight.shape[0],
            in_features,
            torch.get_num_threads(),
        )
        return out

    def pack_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """A bf16 weight [N, K] in the tile layout `packed_linear` takes (zero-padded)."""
        out_features, in_features = weight.shape
        packed = weight.new_empty(self.lib.minisgl_packed_elems(out_features, in_features))
        self.lib.minisgl_pack_weight(
            weight.data_ptr(), packed.data_ptr(), out_features, in_features, torch.get_num_threads()
        )
        return packed

    def packed_linear(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        out_features: int,
        bias: torch.Tensor | None,
        float_out: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [M, K] @ W^T (+ bias), W packed by `pack_weight`; bfloat16 in, bfloat16 out (float32
        with float_out: the sums unrounded), into `out` when given. On the AMX tiles where the
        CPU has them, else with vdpbf16ps."""
        rows, in_features = x.shape
        dtype = torch.float32 if float_out else x.dtype
        if out is None:
            out = x.new_empty(rows, out_features, dtype=dtype)
        elif out.shape != (rows, out_features) or out.dtype != dtype or not out.is_contiguous():
            raise ValueError(
                f"out must be a contiguous {dtype} tensor of shape {(rows, out_features)}, got "
                f"{out.dtype} {tuple(out.shape)}"
            )
        self.lib.minisgl_packed_linear(
            x.data_ptr(),
            packed.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            rows,
            out_features,
            in_features,
            int(float_out),
            int(self.has_amx),
            torch.get_num_threads(),
        )
        return out

    def packed_gated_silu(
        self, x: torch.Tensor, packed: torch.Tensor, inter: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """silu(x @ gate^T) * (x @ up^T) [M, inter] from a gate_up weight packed by
        `pack_weight` with its gate and up rows interleaved in 16s (`interleave_gate_up`)."""
        rows, in_features = x.shape
        out = x.new_empty(rows, inter)
        self.lib.minisgl_packed_gated_silu(
            x.data_ptr(),
            packed.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            rows,
            inter,
            in_features,
            int(self.has_amx),
            torch.get_num_threads(),
        )
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
        Returns [B, heads, dim].
        """
        num_reqs, num_heads, head_dim = q.shape
        out = torch.empty_like(q)
        starts, prefix_out, prefix_lse = prefix if prefix is not None else (None, None, None)
        self.lib.minisgl_decode_attention(
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
            torch.get_num_threads(),
        )
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
        q, slots = q.contiguous(), slots.to(torch.int64).contiguous()
        out = torch.empty(tokens, num_heads, head_dim, dtype=torch.float32)
        lse = torch.empty(tokens, num_heads, dtype=torch.float32)
        done = self.lib.minisgl_shared_prefix_attention(
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
            torch.get_num_threads(),
        )
        return (out, lse) if done else None

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
        if len(rows) == 0:
            return None
        assert page_table.dtype == torch.int32 and page_table.is_contiguous()
        q = q.contiguous()
        rows, cached_lens, extend_lens = (
            t.to(torch.int64).contiguous() for t in (rows, cached_lens, extend_lens)
        )
        out = torch.empty_like(q)
        done = self.lib.minisgl_prefill_attention(
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
            torch.get_num_threads(),
        )
        return out if done else None

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); with no residual, x itself is the residual."""
        rows, hidden = x.shape
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
            torch.get_num_threads(),
        )
        return out, new_residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        rows, width = gate_up.shape
        out = gate_up.new_empty(rows, width // 2)
        self.lib.minisgl_silu_and_mul(
            gate_up.data_ptr(),
            out.data_ptr(),
            rows,
            width // 2,
            _DTYPE_CODES[gate_up.dtype],
            torch.get_num_threads(),
        )
        return out

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Row-wise argmax of x [rows, cols] float32 or bf16 (first index on ties, a NaN wins),
        int64."""
        x = x.contiguous()
        indices = torch.empty(x.shape[0], dtype=torch.int64)
        self.lib.minisgl_argmax(
            x.data_ptr(),
            indices.data_ptr(),
            x.shape[0],
            x.shape[1],
            _DTYPE_CODES[x.dtype],
            torch.get_num_threads(),
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
        if temperatures is not None:
            temperatures = temperatures.to(torch.float32).contiguous()
        tokens = torch.empty(weights.shape[0], dtype=torch.int64)
        self.lib.minisgl_sample_rows(
            weights.data_ptr(),
            None if temperatures is None else temperatures.data_ptr(),
            uniforms.data_ptr(),
            tokens.data_ptr(),
            weights.shape[0],
            weights.shape[1],
            torch.get_num_threads(),
        )
        return tokens

    def top_candidates(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k largest values of each row of x [rows, cols] (float32, k <= cols), largest
        first (the first column first among equals), and their columns (int64)."""
        x = x.contiguous()
        assert x.dtype == torch.float32 and 0 < k <= x.shape[1]
        values = torch.empty(x.shape[0], k, dtype=torch.float32)
        indices = torch.empty(x.shape[0], k, dtype=torch.int64)
        self.lib.minisgl_top_candidates(
            x.data_ptr(),
            x.shape[0],
            x.shape[1],
            k,
            values.data_ptr(),
            indices.data_ptr(),
            torch.get_num_threads(),
        )
        return values, indices

    def rotary_(
        self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        """RoPE in place on x [tokens, heads, dim] (dim contiguous; tokens may be strided);
        positions int64 [tokens]; cos/sin float32 [max_positions, dim]."""
        tokens, heads, head_dim = x.shape
        assert x.stride(2) == 1 and x.stride(1) == head_dim, "rotary: heads must be contiguous"
        self.lib.minisgl_rotary(
            x.data_ptr(),
            tokens,
            x.stride(0),
            heads,
            head_dim,
            positions.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            _DTYPE_CODES[x.dtype],
            torch.get_num_threads(),
        )

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
        q_buf = qkv.new_empty(qkv.shape[0], num_heads * k_cache.shape[2])
        out = torch.empty_like(q_buf)
        q_norm, k_norm, eps = qk_norms if qk_norms is not None else (None, None, 0.0)
        tensors = [qkv, q_buf, out, q_norm, k_norm, k_cache, v_cache, out_loc, positions]
        tensors += [rope_tables[0], rope_tables[1], page_table]
        ptr = [None if t is None else t.data_ptr() for t in tensors]
        return out, q_buf, [*ptr[:5], eps, *ptr[5:], page_table.stride(0)]

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
        self.lib.minisgl_decode_attention_block(
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
            torch.get_num_threads(),
        )
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
        takes them. Returns [tokens, num_heads * head_dim], or None when the attention could
        not run (out of memory)."""
        assert qkv.dtype == k_cache.dtype == torch.bfloat16 and qkv.is_contiguous()
        out, _q_buf, args = self._block_args(
            qkv, qk_norms, k_cache, v_cache, out_loc, positions, rope_tables, page_table, num_heads
        )
        rows, cached_lens, extend_lens = (t.to(torch.int64).contiguous() for t in prefill)
        done = self.lib.minisgl_prefill_attention_block(
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
            torch.get_num_threads(),
        )
        return out if done else None

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
        tokens = x.shape[0]
        out, residual = torch.empty_like(x), torch.empty_like(x)
        self.lib.minisgl_decode_layers(
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
            torch.get_num_threads(),
        )
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
        self.lib.minisgl_decode_layer_begin(
            ctypes.byref(layer),
            ctypes.byref(model),
            x.data_ptr(),
            new_residual.data_ptr(),
            residual is not None,
            scratch.data_ptr(),
            x.shape[0],
            positions.data_ptr(),
            out_loc.data_ptr(),
            torch.get_num_threads(),
        )
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
        self.lib.minisgl_decode_layer_end(
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
            torch.get_num_threads(),
        )
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
        return CpuKernels(ctypes.CDLL(str(_build())))
    except (OSError, RuntimeError) as exc:
        logger.warning("CPU kernels unavailable, using the PyTorch fallbacks: %s", exc)
        return None


def kernels_for(x: torch.Tensor) -> CpuKernels | None:
    """The kernels if they can take this tensor (on the CPU, float32 or bfloat16), else None."""
    if x.device.type != "cpu":
        return None
    kernels = cpu_kernels()
    return kernels if kernels is not None and kernels.supports(x.dtype) else None
