"""Read a GGUF file's weights under their Hugging Face names, keeping the quantized ones
quantized: Q8_0, Q4_0, Q4_1, Q4_K, Q6_K and (in the 8-bit layout) Q5_0, Q5_1, Q5_K blocks are
repacked into QuantizedWeight exactly
(same integers, same float arithmetic as gguf-py's dequantization), tensor by tensor from the
memory-mapped file."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import Q4_K, dequantize

from minisgl.layers.quant_weight import NIBBLE_BLOCK, QuantizedWeight, pack_nibbles
from minisgl.utils.memory import drop_pages

from .weight import TensorEntry

# Architectures whose tensors follow the names below (mistral files say "llama").
_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe")
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.gate",  # a MoE layer's router
}
# A MoE layer's experts, one 3-D tensor [experts, rows, columns] per projection: each expert's
# matrix is an HF tensor of its own (what models/weight.py stacks).
_EXPERT_NAMES = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
_LAYER = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL = re.compile(r"^(\w+)\.(weight|bias)$")

Q = GGMLQuantizationType


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama/qwen2/qwen3(moe) GGUF tensor (None: one HF does not
    load; a MoE layer's expert tensors: `_expert_names`)."""
    match = _LAYER.match(gguf_name)
    if match is not None:
        layer, part, kind = match.groups()
        if part not in _LAYER_NAMES:
            return None
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    match = _GLOBAL.match(gguf_name)
    if match is None or match.group(1) not in _GLOBAL_NAMES:
        return None
    return f"{_GLOBAL_NAMES[match.group(1)]}.{match.group(2)}"


def _expert_names(gguf_name: str, experts: int) -> list[str] | None:
    """The HF names of each expert's matrix in a MoE layer's 3-D expert tensor (None: not one)."""
    match = _LAYER.match(gguf_name)
    if match is None or match.group(2) not in _EXPERT_NAMES or match.group(3) != "weight":
        return None
    layer, proj = match.group(1), _EXPERT_NAMES[match.group(2)]
    return [f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight" for e in range(experts)]


def _f16(fields: np.ndarray) -> np.ndarray:
    """A block's 2-byte float16 field (uint8 [..., 2]) as float32 [..., 1]."""
    return np.array(fields).view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """Q4_0/Q4_1 quants (uint8 [rows, blocks, 16]: column i low, i + 16 high) as 0..15 per
    column [rows, blocks * 32]."""
    rows = packed.shape[0]
    return np.concatenate((packed & 0x0F, packed >> 4), axis=-1).reshape(rows, -1)


def _four_bit(
    integers: np.ndarray, scales: np.ndarray, mins: np.ndarray | None, group: int
) -> QuantizedWeight:
    """0..15 integers [N, K] in the 4-bit layout, or the 8-bit one where K is not a multiple of
    the 64-column nibble block (the same integers either way)."""
    values = torch.from_numpy(integers)
    scale_t = torch.from_numpy(np.array(scales))
    min_t = None if mins is None else torch.from_numpy(np.array(mins))
    if integers.shape[1] % NIBBLE_BLOCK:
        return QuantizedWeight(values.to(torch.int8), scale_t, min_t, 8, group)
    return QuantizedWeight(pack_nibbles(values), scale_t, min_t, 4, group)


def _q8_0(blocks: np.ndarray) -> QuantizedWeight:
    rows = blocks.shape[0]
    values = np.array(blocks[..., 2:]).view(np.int8).reshape(rows, -1)
    scales = np.array(blocks[..., :2]).view(np.float16).reshape(rows, -1)
    return QuantizedWeight(torch.from_numpy(values), torch.from_numpy(scales), None, 8, 32)


def _q4_0(blocks: np.ndarray) -> QuantizedWeight:
    # gguf-py: d * (q - 8); d * q + (-8 d) is the same float32 value, as d * q and 8 d are both
    # exact in float32 (an 11-bit mantissa times 4 bits), so only a zero's sign can differ.
    rows = blocks.shape[0]
    d = _f16(blocks[..., :2]).reshape(rows, -1)
    mins = -8.0 * d
    with np.errstate(over="ignore"):
        wide = not np.array_equal(mins.astype(np.float16).astype(np.float32), mins)
    dtype = np.float32 if wide else np.float16  # -8 d overflows float16 for |d| >= 8190
    return _four_bit(_nibbles(blocks[..., 2:]), d.astype(dtype), mins.astype(dtype), 32)


def _q4_1(blocks: np.ndarray) -> QuantizedWeight:
    rows = blocks.shape[0]
    scales = np.array(blocks[..., :2]).view(np.float16).reshape(rows, -1)
    mins = np.array(blocks[..., 2:4]).view(np.float16).reshape(rows, -1)
    return _four_bit(_nibbles(blocks[..., 4:]), scales, mins, 32)


def _q4_k(blocks: np.ndarray) -> QuantizedWeight:
    # Each 64 columns' 32 quant bytes hold columns j (low) and j + 32 (high): already the
    # QuantizedWeight nibble layout, so they are taken as they are.
    rows, per_row = blocks.shape[:2]
    flat = blocks.reshape(-1, blocks.shape[-1])
    d, dmin = _f16(flat[:, 0:2]), _f16(flat[:, 2:4])
    sc, m = Q4_K.get_scale_min(np.array(flat[:, 4:16]))
    scales = (d * sc.astype(np.float32)).reshape(rows, per_row * 8)
    mins = -(dmin * m.astype(np.float32)).reshape(rows, per_row * 8)  # gguf-py: d q - dmin m
    values = np.array(flat[:, 16:]).reshape(rows, -1)
    return QuantizedWeight(
        torch.from_numpy(values), torch.from_numpy(scales), torch.from_numpy(mins), 4, 32
    )


def _q6_k(blocks: np.ndarray) -> QuantizedWeight:
    # The same unpacking as gguf-py's Q6_K, stopped at the signed integers.
    rows, per_row = blocks.shape[:2]
    flat = blocks.reshape(-1, blocks.shape[-1])
    n = flat.shape[0]
    ql, qh = flat[:, :128], flat[:, 128:192]
    sc = np.array(flat[:, 192:208]).view(np.int8).astype(np.float32)
    scales = (_f16(flat[:, 208:210]) * sc).reshape(rows, per_row * 16)
    ql = ql.reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & np.uint8(0x0F)).reshape(n, 8, 32)
    qh = qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = (qh & np.uint8(0x03)).reshape(n, 8, 32)
    values = ((ql | (qh << np.uint8(4))).astype(np.int8) - np.int8(32)).reshape(rows, -1)
    return QuantizedWeight(torch.from_numpy(values), torch.from_numpy(scales), None, 8, 16)


def _five_bit(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 quants as 0..31 per column [rows, blocks * 32]: the low nibbles as Q4_0's,
    bit i of the block's 32-bit qh the fifth bit of column i (gguf-py's unpacking)."""
    rows = qs.shape[0]
    high = np.array(qh).view(np.uint32)[..., None] >> np.arange(32, dtype=np.uint32)
    return _nibbles(qs) | ((high & 1).astype(np.uint8).reshape(rows, -1) << np.uint8(4))


def _q5_0(blocks: np.ndarray) -> QuantizedWeight:
    # gguf-py: d * (q - 16): kept as the signed integers q - 16, no offset (the same product).
    rows = blocks.shape[0]
    values = _five_bit(blocks[..., 2:6], blocks[..., 6:]).astype(np.int8) - np.int8(16)
    scales = np.array(blocks[..., :2]).view(np.float16).reshape(rows, -1)
    return QuantizedWeight(torch.from_numpy(values), torch.from_numpy(scales), None, 8, 32)


def _q5_1(blocks: np.ndarray) -> QuantizedWeight:
    rows = blocks.shape[0]
    values = _five_bit(blocks[..., 4:8], blocks[..., 8:]).astype(np.int8)
    scales = np.array(blocks[..., :2]).view(np.float16).reshape(rows, -1)
    mins = np.array(blocks[..., 2:4]).view(np.float16).reshape(rows, -1)
    return QuantizedWeight(
        torch.from_numpy(values), torch.from_numpy(scales), torch.from_numpy(mins), 8, 32
    )


def _q5_k(blocks: np.ndarray) -> QuantizedWeight:
    # Q4_K's scales and nibbles, plus a fifth bit per column: bit j of qh[i] for column i of
    # sub-block j (gguf-py's unpacking); 0..31 in the 8-bit layout.
    rows, per_row = blocks.shape[:2]
    flat = blocks.reshape(-1, blocks.shape[-1])
    n = flat.shape[0]
    d, dmin = _f16(flat[:, 0:2]), _f16(flat[:, 2:4])
    sc, m = Q4_K.get_scale_min(np.array(flat[:, 4:16]))
    scales = (d * sc.astype(np.float32)).reshape(rows, per_row * 8)
    mins = -(dmin * m.astype(np.float32)).reshape(rows, per_row * 8)
    qh, qs = flat[:, 16:48], flat[:, 48:]
    low = qs.reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    high = qh.reshape(n, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    values = (low & np.uint8(0x0F)).reshape(n, 8, 32) | (
        (high & np.uint8(1)).reshape(n, 8, 32) << np.uint8(4)
    )
    return QuantizedWeight(
        torch.from_numpy(values.astype(np.int8).reshape(rows, -1)),
        torch.from_numpy(scales),
        torch.from_numpy(mins),
        8,
        32,
    )


_REPACK = {Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q4_K: _q4_k, Q.Q6_K: _q6_k}
_REPACK.update({Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q5_K: _q5_k})
# The block types `repack` keeps quantized; the rest are served dense.
QUANTIZED_TYPES = tuple(_REPACK)


def repack(data: np.ndarray, qtype: GGMLQuantizationType) -> QuantizedWeight | None:
    """GGUF blocks (uint8 [rows, bytes per row], as GGUFReader maps a 2-D tensor) as a
    QuantizedWeight whose `dequantize()` is gguf-py's; None for a type kept dense."""
    if qtype not in _REPACK or data.ndim != 2:
        return None
    blocks = np.asarray(data).view(np.uint8)
    rows = blocks.shape[0]
    return _REPACK[qtype](blocks.reshape(rows, -1, GGML_QUANT_SIZES[qtype][1]))


def _field(reader: GGUFReader, key: str, default: object = None) -> object:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _head_permutation(rows: int, heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's rotary interleave of q/k (transformers'
    `_reverse_permute_weights`): HF row (h, i, j) is GGUF row (h, j, i), i < 2."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)


class GgufCheckpoint:
    """A GGUF file's tensors under Hugging Face names: `quantized` repacks the supported block
    types, `tensor` gives any as dense float32 (what transformers' GGUF loader makes). Use as a
    context manager; what it returns is copied out of the mapping, so it may outlive it."""

    def __init__(self, path: Path) -> None:
        # The reader is dropped once the tensors are listed: its parsed metadata (a tokenizer's
        # vocabulary, one array per token) takes more memory than a small model's weights.
        reader = GGUFReader(str(path))
        self.architecture: str = str(_field(reader, "general.architecture"))
        if self.architecture not in _ARCHITECTURES:
            raise ValueError(
                f"{Path(path).name}: GGUF architecture {self.architecture!r} is not supported "
                f"(supported: {', '.join(_ARCHITECTURES)})"
            )
        self.entries: dict[str, TensorEntry] = {}
        self.unmapped: list[str] = []  # GGUF tensors HF does not load (e.g. rope_freqs)
        # name -> (the tensor's bytes as mapped, its type); the views keep the file mapped.
        self._data: dict[str, tuple[np.ndarray, GGMLQuantizationType]] = {}
        for tensor in reader.tensors:
            shape = tuple(int(dim) for dim in reversed(tensor.shape))  # GGUF lists ne0 first
            experts = _expert_names(tensor.name, shape[0])
            if experts is not None and len(shape) == 3:  # data [experts, rows, row bytes]
                for expert, name in enumerate(experts):
                    self.entries[name] = TensorEntry(0, shape[1:])
                    self._data[name] = (tensor.data[expert], tensor.tensor_type)
                continue
            name = hf_name(tensor.name)
            if name is None:
                self.unmapped.append(tensor.name)
                continue
            self.entries[name] = TensorEntry(0, shape)
            self._data[name] = (tensor.data, tensor.tensor_type)
        self._permuted = self._permuted_heads(reader)
        self._closed = False

    def _permuted_heads(self, reader: GGUFReader) -> dict[str, int]:
        """HF names of the q/k tensors stored rotary-interleaved, with their head counts."""
        if self.architecture != "llama":  # transformers un-permutes only llama (and mistral)
            return {}
        heads = _field(reader, "llama.attention.head_count")
        kv_heads = _field(reader, "llama.attention.head_count_kv", heads)
        if not isinstance(heads, int) or not isinstance(kv_heads, int):
            raise ValueError(f"GGUF head counts must be integers, got {heads!r}, {kv_heads!r}")
        permuted = {}
        for name in self.entries:
            if ".self_attn.q_proj." in name:
                permuted[name] = heads
            elif ".self_attn.k_proj." in name:
                permuted[name] = kv_heads
        return permuted

    def _raw(self, name: str) -> tuple[np.ndarray, GGMLQuantizationType]:
        """The tensor's data as mapped (rows in HF order: a copy where they are permuted)."""
        if self._closed:
            raise RuntimeError("GgufCheckpoint used after it was closed")
        data, qtype = self._data[name]
        if name in self._permuted:
            # Per-row block formats: permuting the raw rows equals permuting the dequantized.
            data = data[_head_permutation(data.shape[0], self._permuted[name])]
        return data, qtype

    def tensor(self, name: str) -> torch.Tensor:
        """The dense float32 tensor (gguf-py's dequantization, q/k rows un-permuted)."""
        data, qtype = self._raw(name)
        dense = np.array(dequantize(data, qtype), dtype=np.float32)  # a copy, out of the map
        return torch.from_numpy(dense.reshape(self.entries[name].shape))

    @functools.cached_property
    def quantized_names(self) -> frozenset[str]:
        """The tensors `quantized` repacks (the rest are served dense); the loader asks once per
        parameter."""
        return frozenset(
            name
            for name, (_, qtype) in self._data.items()
            if len(self.entries[name].shape) == 2 and qtype in QUANTIZED_TYPES
        )

    def quantized(self, name: str) -> QuantizedWeight | None:
        """The 2-D tensor repacked exactly (QUANTIZED_TYPES); None otherwise."""
        if self._closed:
            raise RuntimeError("GgufCheckpoint used after it was closed")
        if len(self.entries[name].shape) != 2 or self._data[name][1] not in QUANTIZED_TYPES:
            return None
        return repack(*self._raw(name))

    def release(self, name: str) -> None:
        """Drop the pages of the tensor's bytes from this process (they stay in the page cache)."""
        if not self._closed:
            data = self._data[name][0]
            drop_pages(data.ctypes.data, data.nbytes)

    def __enter__(self) -> GgufCheckpoint:
        return self

    def __exit__(self, *exc_info: object) -> None:
        # Everything handed out is a copy: the file is unmapped once these views are gone.
        self._closed = True
        self._data.clear()
