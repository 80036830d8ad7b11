"""The fused C decode layers: every bf16 decoder layer of a decode step in one C call.

At batch 1 a layer is ~10 short kernels and the Python between them cost as much as reading
the weights; `minisgl_decode_layers` runs the same kernels in the same order from C, so its
output equals the module-by-module path bit for bit (tests/test_cpu_kernels.py). Projections
read their packed copies, the weights' only ones: batches up to the GEMV's row limit with
vdpbf16ps, larger ones on the AMX tiles where the CPU has them, every batch with FMA on AVX2
CPUs (csrc/matmul_avx2.c), or their quantized copies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from minisgl.core import Batch, Context, get_global_ctx
from minisgl.kernel.cpu import (
    MAX_GROUP,
    MAX_HEAD_DIM,
    MAX_INTERMEDIATE,
    MAX_NORM_HIDDEN,
    CpuKernels,
    DecodeLayerParams,
    DecodeModelParams,
    ProjectionParams,
    cpu_kernels,
)
from minisgl.layers import AttentionLayer, Linear, RMSNorm, RotaryEmbedding
from minisgl.layers.linear import GEMV_MAX_ROWS
from minisgl.layers.quantized import QUANTIZED_GEMV_MAX_ROWS, QuantizedProjection

from .config import ModelConfig


@dataclass(frozen=True)
class LayerParts:
    """One decoder layer's modules in the order its forward runs them: x + residual ->
    input_norm -> qkv -> attention -> o -> + residual -> post_norm -> gate_up (SiLU) -> down.
    The fused layer reads each module's own description of itself (its weights, bias, packed
    copy, norms, window), so a change made to a module reaches both paths."""

    input_norm: RMSNorm
    qkv: Linear
    attention: AttentionLayer
    o: Linear
    post_norm: RMSNorm
    gate_up: Linear
    down: Linear

    def projections(self) -> tuple[Linear, Linear, Linear, Linear]:
        return self.qkv, self.o, self.gate_up, self.down


class DecoderLayer(Protocol):
    """What the fused layers read of a decoder layer (`models.decoder.DecoderLayer`)."""

    def parts(self) -> LayerParts | None: ...


class DecoderModel(Protocol):
    """What the fused layers read of a decoder model (`models.decoder.DecoderModel`, which
    imports this module: a Protocol keeps the import one way)."""

    config: ModelConfig
    rotary: RotaryEmbedding
    layers: nn.ModuleList
    norm: RMSNorm


# Decode batches the C layer takes through the packed matmul; larger ones go module by module.
TILES_MAX_TOKENS = 1023


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None or tensor.numel() == 0 else tensor.data_ptr()


def _layer_parts(model: DecoderModel) -> list[LayerParts] | None:
    """Every layer's parts, or None where a layer has none the C layer computes (experts)."""
    layers: list[DecoderLayer] = list(model.layers)  # type: ignore[arg-type]
    parts = [layer.parts() for layer in layers]
    dense = [p for p in parts if p is not None]
    return dense if len(dense) == len(parts) else None


def _fused_takes(params: ProjectionParams | None) -> bool:
    """Whether the C layer multiplies this projection from its only copy: packed or quantized."""
    return params is not None and bool(params.tiles or params.quantized.values)


class FusedDecode:
    """ctypes parameter blocks for one model on one KV pool (pointers are stable)."""

    def __init__(self, model: DecoderModel, ctx: Context, kernels: CpuKernels) -> None:
        config = model.config
        assert ctx.kv_cache is not None and ctx.page_table is not None
        self.kernels = kernels
        self.kv_cache, self.page_table = ctx.kv_cache, ctx.page_table
        layers = _layer_parts(model)
        assert layers is not None, "FusedDecode.supported refuses models with expert layers"
        projections = [
            linear.cpu_projection
            for parts in layers
            for linear in parts.projections()
            if linear.cpu_projection is not None
        ]
        quantized = [isinstance(p, QuantizedProjection) for p in projections]
        gemv_max_rows = min(
            (p.gemv_max_rows for p, q in zip(projections, quantized) if not q),
            default=GEMV_MAX_ROWS,
        )
        # Larger batches multiply quantized weights dequantized, module by module.
        self.max_tokens = QUANTIZED_GEMV_MAX_ROWS if any(quantized) else TILES_MAX_TOKENS
        self.model_params = DecodeModelParams(
            hidden=config.hidden_size,
            inter=config.intermediate_size,
            num_heads=config.num_qo_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            eps=config.rms_norm_eps,
            scale=1.0 / math.sqrt(config.head_dim),
            cos=_ptr(model.rotary.cos),
            sin=_ptr(model.rotary.sin),
            page_table=_ptr(ctx.page_table),
            table_stride=ctx.page_table.stride(0),
            gemv_max_rows=gemv_max_rows,
            use_tiles=int(kernels.has_amx),
            max_positions=model.rotary.cos.shape[0],  # positions past the tables are refused
        )
        self.layer_params = []
        for i, parts in enumerate(layers):
            qk_norms = parts.attention.qk_norms()
            self.layer_params.append(
                DecodeLayerParams(
                    input_norm=_ptr(parts.input_norm.weight),
                    post_norm=_ptr(parts.post_norm.weight),
                    q_norm=None if qk_norms is None else _ptr(qk_norms[0]),
                    k_norm=None if qk_norms is None else _ptr(qk_norms[1]),
                    qkv=parts.qkv.fused_params(),
                    o=parts.o.fused_params(),
                    gate_up=parts.gate_up.fused_params(),
                    down=parts.down.fused_params(),
                    k_cache=_ptr(ctx.kv_cache.k_cache(i)),
                    v_cache=_ptr(ctx.kv_cache.v_cache(i)),
                    window=parts.attention.sliding_window or 0,
                )
            )
        # Adapters' deltas in the C layer: float32 slots on every projection, and no gate_up
        # whose packed copy interleaves gate and up (its plain product's order is not
        # the deltas').
        self.takes_lora = all(
            p.lora_a and not (p.gated and p.tiles)
            for layer in self.layer_params
            for p in (layer.qkv, layer.o, layer.gate_up, layer.down)
        )
        # The same blocks side by side, for the one call that runs every layer.
        self.layer_array = (DecodeLayerParams * len(self.layer_params))(*self.layer_params)

    @staticmethod
    def supported(model: DecoderModel, x: torch.Tensor) -> CpuKernels | None:
        """The kernels when this model can run fused layers on activations like x."""
        config = model.config
        kernels = cpu_kernels() if x.device.type == "cpu" else None
        if kernels is None or x.dtype != torch.bfloat16:
            return None
        # Without bf16 dot products (AVX2) the projections' C forms take float32 products.
        if not kernels.has_avx512_bf16 and not kernels.has_avx2:
            return None
        # Every layer dense, every projection multiplied from its packed or quantized copy, its
        # only one.
        layers = _layer_parts(model)
        if layers is None:
            return None
        if not all(_fused_takes(m.fused_params()) for parts in layers for m in parts.projections()):
            return None
        fits = (
            config.head_dim <= MAX_HEAD_DIM
            and config.num_qo_heads // config.num_kv_heads <= MAX_GROUP
            and config.hidden_size <= MAX_NORM_HIDDEN
            and config.intermediate_size <= MAX_INTERMEDIATE
        )
        return kernels if fits else None

    def matches(self, ctx: Context) -> bool:
        return ctx.kv_cache is self.kv_cache and ctx.page_table is self.page_table

    def run(
        self, model: DecoderModel, x: torch.Tensor, positions: torch.Tensor, batch: Batch
    ) -> torch.Tensor | None:
        """The final hidden states, or None when this batch must take the module path."""
        if not batch.is_decode or x.shape[0] > self.max_tokens or batch.out_loc is None:
            return None
        if batch.lora_slots is not None and not self.takes_lora:
            return None
        backend = get_global_ctx().attn_backend
        if backend is None:
            return None
        args = backend.paged_decode_args(batch)
        # Requests sharing a cached prefix: each layer runs in two halves around the backend's
        # attention over the shared positions (one product for the whole batch).
        cascade = args is None
        if cascade:
            args = backend.cascade_decode_args(batch)
        if args is None:
            return None
        rows, kv_lens = args
        positions = positions.long().contiguous()
        out_loc = batch.out_loc.long().contiguous()
        kernels, model_params = self.kernels, self.model_params
        lora_slots = None if batch.lora_slots is None else batch.lora_slots.long().contiguous()
        model_params.lora_slots = _ptr(lora_slots)  # (kept alive until this returns)
        scratch = x.new_empty(kernels.decode_layer_scratch(model_params, x.shape[0]))
        if not cascade:
            x, residual = kernels.decode_layers(
                self.layer_array, model_params, x, positions, rows, kv_lens, out_loc, scratch
            )
            return model.norm(x, residual)[0]
        q = kernels.decode_layer_queries(model_params, scratch, x.shape[0])
        residual = None
        for layer_id, params in enumerate(self.layer_params):
            residual = kernels.decode_layer_begin(
                params, model_params, x, residual, positions, out_loc, scratch
            )
            prefix = backend.shared_prefix_state(q, layer_id, batch)
            x, residual = kernels.decode_layer_end(
                params, model_params, residual, rows, kv_lens, scratch, prefix
            )
        return model.norm(x, residual)[0]
