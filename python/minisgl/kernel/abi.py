"""The C kernels' interface: the ctypes prototype of every function `csrc/kernels.h` declares
(the library's exports), its status codes and the exceptions they become, and the checks the
wrappers (gemm, attention, elementwise, sampling, fused_layer) make on what they send (a shape a
kernel cannot take is a ValueError naming the value, never a read past a buffer)."""

from __future__ import annotations

import ctypes

import torch

# The largest head_dim the attention kernels take (their per-head buffers); the rest are the
# widest rows and GQA groups the callers send to them (the kernels take any).
MAX_HEAD_DIM = 256
MAX_NORM_HIDDEN, MAX_INTERMEDIATE, MAX_GROUP = 8192, 16384, 32
# The kernels' status codes (MINISGL_OK, MINISGL_ERR_* in kernels.h).
OK, ERR_NOMEM, ERR_SHAPE, ERR_UNSUPPORTED, ERR_POSITION = 0, 1, 2, 3, 4
# The dtypes the kernels take, by their C code (kernels.h: 0 float32, 1 bfloat16).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
# The quantized matmul's paths, in kernels.h's QPATH_* order (minisgl_quantized_path).
QUANTIZED_PATHS = (
    "generic",
    "avx512-f32",
    "avx512-nibbles",
    "avx512-wide",
    "avx512-bf16-block",
    "avx512-packed",
    "avx2-rows",
    "avx2-int16",
    "avx2-tile",
    "tiled-f32",
    "tiled-precise",
    "tiled-int8",
    "tiled-amx",
    "tiled-w8a8",
    "tiled-w8a8-vnni",
    "avx2-tiled-int16",
    "avx2-tiled-f32",
    "avx2-tiled-int8",
)

_ptr = ctypes.c_void_p
_i64 = ctypes.c_int64
_int = ctypes.c_int
_float = ctypes.c_float
# Every exported function's argument types and (below) result type, as kernels.h declares them
# (tests/test_kernel_abi.py checks both against its prototypes and the definitions).
SIGNATURES: dict[str, list[type]] = {
    "minisgl_fail_allocations": [_i64],
    "minisgl_has_avx512_bf16": [],
    "minisgl_has_avx2": [],
    "minisgl_has_avx512": [],
    "minisgl_has_amx": [],
    "minisgl_has_amx_int8": [],
    "minisgl_has_vnni": [],
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
    "minisgl_flag_non_finite": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _int],
    "minisgl_mask_disallowed": [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _int, _int],
    "minisgl_tempered_softmax": [_ptr, _ptr, _ptr, _i64, _i64, _int, _int],
    "minisgl_rotary": [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _i64, _int, _int],
    "minisgl_decode_attention_block": [_ptr, _ptr, _ptr, _ptr, _ptr, _float, _ptr, _ptr, _ptr]
    + [_ptr, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _float, _i64]
    + [_int, _int],
    "minisgl_prefill_attention_block": [_ptr, _ptr, _ptr, _ptr, _ptr, _float, _ptr, _ptr, _ptr]
    + [_ptr, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64]
    + [_float, _i64, _int, _int],
    "minisgl_decode_layer_scratch": [_ptr, _i64],
    "minisgl_lora_add": [_ptr, _ptr, _i64, _i64, _i64, _ptr, _ptr, _int],
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
    "minisgl_packed_rows": [_ptr, _ptr, _ptr, _i64, _i64, _i64, _int],
    "minisgl_quantized_fits": [_i64, _i64, _i64, _i64],
    "minisgl_quantized_path": [_ptr, _i64, _i64, _int],
    "minisgl_quantized_path_runs": [_ptr],
    "minisgl_quantized_linear": [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int, _int, _int],
    "minisgl_quantized_rows": [_ptr, _ptr, _ptr, _i64, _i64, _i64, _int, _int],
    "minisgl_quantized_gated_silu": [_ptr, _ptr, _ptr, _i64, _i64, _i64, _int],
    "minisgl_quantized_packed": [_ptr, _ptr, _i64, _i64, _int, _int],
}
# The exports whose int result is an answer (a feature, a fit, a path), not a status.
ANSWERS = frozenset({"minisgl_quantized_fits", "minisgl_quantized_path"})
# None: void. The int results of the kernels that can fail are status codes (`check_status`).
RESTYPES: dict[str, type | None] = {
    "minisgl_fail_allocations": None,
    "minisgl_has_avx512_bf16": _int,
    "minisgl_has_avx2": _int,
    "minisgl_has_avx512": _int,
    "minisgl_has_amx": _int,
    "minisgl_has_amx_int8": _int,
    "minisgl_has_vnni": _int,
    "minisgl_gemv_bf16": None,
    "minisgl_packed_elems": _i64,
    "minisgl_pack_weight": None,
    "minisgl_packed_linear": _int,
    "minisgl_packed_gated_silu": _int,
    "minisgl_decode_attention": _int,
    "minisgl_add_rms_norm": None,
    "minisgl_silu_and_mul": None,
    "minisgl_argmax": None,
    "minisgl_sample_rows": None,
    "minisgl_top_candidates": _int,
    "minisgl_flag_non_finite": None,
    "minisgl_mask_disallowed": _int,
    "minisgl_tempered_softmax": None,
    "minisgl_rotary": _int,
    "minisgl_decode_attention_block": _int,
    "minisgl_prefill_attention_block": _int,
    "minisgl_decode_layer_scratch": _i64,
    "minisgl_lora_add": _int,
    "minisgl_decode_layers": _int,
    "minisgl_decode_layer_q_offset": _i64,
    "minisgl_shared_prefix_attention": _int,
    "minisgl_prefill_attention": _int,
    "minisgl_decode_layer_begin": _int,
    "minisgl_decode_layer_end": _int,
    "minisgl_packed_rows": _int,
    "minisgl_quantized_linear": _int,
    "minisgl_quantized_rows": _int,
    "minisgl_quantized_gated_silu": _int,
    "minisgl_quantized_packed": _int,
    "minisgl_quantized_fits": _int,
    "minisgl_quantized_path": _int,
    "minisgl_quantized_path_runs": None,
}


def check_status(
    kernel: str, status: int, positions: torch.Tensor | None = None, max_positions: int = 0
) -> None:
    """Raise for a kernel's failure status, naming the kernel (and the position out of range)."""
    if status == OK:
        return
    if status == ERR_NOMEM:
        raise MemoryError(f"{kernel}: out of memory (a C kernel allocation failed)")
    if status == ERR_UNSUPPORTED:
        raise RuntimeError(f"{kernel}: this build of the CPU kernels lacks its instructions")
    if status == ERR_POSITION and positions is not None:
        bad = positions[(positions < 0) | (positions >= max_positions)]
        raise ValueError(
            f"{kernel}: position {int(bad[0])} is outside the rotary tables' "
            f"{max_positions} positions"
        )
    raise ValueError(f"{kernel}: arguments the kernel cannot take (status {status})")


def require(ok: bool, message: str) -> None:
    """A ValueError naming the value unless ok; for calls off the hot paths (the message is
    formatted before the check: per-step wrappers test first, then raise)."""
    if not ok:
        raise ValueError(message)


def output_rows(
    x: torch.Tensor, out_features: int, dtype: torch.dtype, out: torch.Tensor | None
) -> torch.Tensor:
    """A matmul's output [rows of x, out_features] in `dtype`: `out` where given (checked:
    contiguous, that shape and dtype), else a new tensor."""
    rows = x.shape[0]
    if out is None:
        return x.new_empty(rows, out_features, dtype=dtype)
    if out.shape != (rows, out_features) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {dtype} tensor of shape {(rows, out_features)}, got "
            f"{out.dtype} {tuple(out.shape)}"
        )
    return out


def raise_not_contiguous(kernel: str, **tensors: torch.Tensor | None) -> None:
    """A ValueError for the first strided tensor among these, if any (the C kernels read every
    row densely: a strided view would be read as other data)."""
    for name, tensor in tensors.items():
        if tensor is not None and not tensor.is_contiguous():
            raise ValueError(
                f"{kernel}: {name} {tuple(tensor.shape)} is not contiguous (strides "
                f"{tensor.stride()})"
            )


def check_heads(kernel: str, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """Query heads a whole group per kv head, head_dim within the attention buffers."""
    if not (num_kv_heads > 0 and num_heads % num_kv_heads == 0):
        raise ValueError(
            f"{kernel}: num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
        )
    if not (0 < head_dim <= MAX_HEAD_DIM):
        raise ValueError(f"{kernel}: head_dim {head_dim} is outside the kernel's 1..{MAX_HEAD_DIM}")


def check_rope_tables(
    kernel: str, head_dim: int, tables: tuple[torch.Tensor, torch.Tensor]
) -> None:
    """cos and sin float32 [max_positions, head_dim] tables (contiguous), head_dim even."""
    cos, sin = tables
    if not (
        head_dim % 2 == 0
        and cos.dtype == sin.dtype == torch.float32
        and cos.stride() == sin.stride() == (head_dim, 1)
        and cos.shape[0] == sin.shape[0]
    ):
        raise ValueError(
            f"{kernel}: rotary tables {cos.dtype} {tuple(cos.shape)} (strides {cos.stride()}) "
            f"/ {tuple(sin.shape)} for head_dim {head_dim}"
        )


def check_prefix_state(
    kernel: str, q: torch.Tensor, prefix: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> None:
    """A cascade prefix state for q [B, heads, dim]: kv_starts [B], out float32 [B, heads,
    dim], lse float32 [B, heads], each contiguous."""
    starts, out, lse = prefix
    if not (
        starts.shape == q.shape[:1]
        and out.shape == q.shape
        and lse.shape == q.shape[:2]
        and out.dtype == lse.dtype == torch.float32
    ):
        raise ValueError(
            f"{kernel}: prefix state {tuple(out.shape)} {out.dtype} / {tuple(lse.shape)} "
            f"{lse.dtype} / starts {tuple(starts.shape)} for q {tuple(q.shape)}"
        )
    raise_not_contiguous(kernel, kv_starts=starts, prefix_out=out, prefix_lse=lse)


def check_block_inputs(
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    out_loc: torch.Tensor,
    positions: torch.Tensor,
    rope_tables: tuple[torch.Tensor, torch.Tensor],
    num_heads: int,
) -> None:
    """An attention block's fused projection [tokens, q | k | v] for the pool's heads, one
    position and KV slot per token, and its rotary tables."""
    num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    check_heads("attention block", num_heads, num_kv_heads, head_dim)
    check_rope_tables("attention block", head_dim, rope_tables)
    if not (
        qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
        and positions.shape == out_loc.shape == qkv.shape[:1]
    ):
        raise ValueError(
            f"attention block: qkv {tuple(qkv.shape)} with positions/out_loc of "
            f"{len(positions)}/{len(out_loc)} for {num_heads} + 2 x {num_kv_heads} heads "
            f"of {head_dim}"
        )


def check_prefill_tokens(kernel: str, tokens: int, extend_lens: torch.Tensor) -> None:
    """The query rows are the requests' new tokens, one after another."""
    new_tokens = int(extend_lens.sum())
    if not (tokens == new_tokens):
        raise ValueError(f"{kernel}: {tokens} query rows for {new_tokens} new tokens")


class QuantizedWeightParams(ctypes.Structure):
    """A quantized weight's integers, per-group scales and mins (NULL: none) for the C
    kernels (kernels.h's `quantized_weight`; layers/quant_weight.py's QuantizedWeight, or with
    tiled set quant_tiles.py's TiledWeight; amx: a tiled one meets bf16 rows on the AMX tiles;
    int8_x: more than W8A8_MIN_ROWS bf16 rows as int8 per row, W8A8; precise: tiled bf16 rows
    kept to 16 bits, two int8 passes, instead of one pass at int8 per 32 columns)."""

    _fields_ = [("values", _ptr), ("scales", _ptr), ("mins", _ptr)]
    _fields_ += [("bits", _i64), ("group", _i64), ("scales_f32", _i64), ("tiled", _i64)]
    _fields_ += [("amx", _i64), ("int8_x", _i64), ("precise", _i64)]


class ProjectionParams(ctypes.Structure):
    """One projection for the C decode layer: its row-major weight (read only without a packed
    copy), packed copy and bias (NULL: absent); gated: a gate_up with SiLU fused; quantized:
    its quantized weight where it has one (values NULL: none)."""

    _fields_ = [("weight", _ptr), ("tiles", _ptr), ("bias", _ptr), ("gated", _i64)]
    _fields_ += [("quantized", QuantizedWeightParams)]
    # LoRA (layers/lora.py's LoraSlots, float32; lora_a NULL: none): A, B, and their layout.
    _fields_ += [("lora_a", _ptr), ("lora_bt", _ptr)]
    _fields_ += [("lora_parts", _i64), ("lora_slots", _i64), ("lora_rank", _i64)]
    _fields_ += [("lora_part_rows", _ptr)]


class DecodeLayerParams(ctypes.Structure):
    """One layer's norms, projections and KV pool for the C decode layer (NULL: absent)."""

    _fields_ = [(name, _ptr) for name in ("input_norm", "post_norm", "q_norm", "k_norm")]
    _fields_ += [(name, ProjectionParams) for name in ("qkv", "o", "gate_up", "down")]
    _fields_ += [("k_cache", _ptr), ("v_cache", _ptr), ("window", _i64)]


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
        ("max_positions", _i64),  # rows of cos/sin: positions are checked against it (0: not)
        ("lora_slots", _ptr),  # per token its adapter's slot (-1: none); NULL: no adapters
    ]


def decode_attention_error(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    rows: torch.Tensor,
    kv_lens: torch.Tensor,
) -> None:
    """The ValueError for decode_attention arguments its one test refused, naming them."""
    raise_not_contiguous(
        "decode_attention", q=q, k_cache=k_cache, v_cache=v_cache, rows=rows, kv_lens=kv_lens
    )
    raise ValueError(
        f"decode_attention: q {q.dtype} {tuple(q.shape)}, caches {k_cache.dtype} / "
        f"{v_cache.dtype} {tuple(k_cache.shape)}, rows/kv_lens {tuple(rows.shape)} / "
        f"{tuple(kv_lens.shape)}, page table {page_table.dtype} strides {page_table.stride()}"
    )
