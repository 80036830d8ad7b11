"""The one decoder-only transformer shared by every supported architecture."""

from __future__ import annotations

import torch
from torch import nn

from minisgl.core import TensorParallel, get_global_ctx
from minisgl.layers import (
    AttentionLayer,
    Linear,
    LMHead,
    RMSNorm,
    RotaryEmbedding,
    RotaryInputs,
    SparseMoE,
    VocabEmbedding,
)
from minisgl.moe import MOE_BACKENDS

from .config import ModelConfig
from .fused_decode import FusedDecode, LayerParts
from .sharding import Shard


class MLP(nn.Module):
    """gate_up column-parallel, down row-parallel: one all-reduce under tensor parallelism."""

    def __init__(self, config: ModelConfig, shard: Shard, tp: TensorParallel | None = None) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, shard.intermediate
        self.gate_up_proj = Linear(hidden, 2 * inter, bias=config.mlp_bias, gated=True)
        self.down_proj = Linear(inter, hidden, bias=config.mlp_bias, reduce=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.silu_and_mul(x))


class SelfAttention(nn.Module):
    """This rank's heads (`shard`): qkv column-parallel, o row-parallel (one all-reduce)."""

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        rotary: RotaryEmbedding,
        shard: Shard,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        head_dim = config.head_dim
        q_size = shard.q_heads * head_dim
        kv_size = shard.kv_heads * head_dim
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=config.o_bias, reduce=tp)
        self.attn = AttentionLayer(
            layer_id,
            shard.q_heads,
            shard.kv_heads,
            head_dim,
            rotary,
            qk_norm_eps=config.rms_norm_eps if config.qk_norm else None,
            sliding_window=config.sliding_windows[layer_id],
        )

    def forward(self, x: torch.Tensor, rope: RotaryInputs) -> torch.Tensor:
        return self.o_proj(self.attn(self.qkv_proj(x), rope))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        rotary: RotaryEmbedding,
        shard: Shard,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config, layer_id, rotary, shard, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: MLP | SparseMoE
        if config.moe_layers[layer_id]:
            self.mlp = SparseMoE(
                config.hidden_size,
                shard.moe_intermediate,
                config.num_experts,
                config.num_experts_per_tok,
                config.norm_topk_prob,
                MOE_BACKENDS["torch"],
                reduce=tp,
            )
        else:
            self.mlp = MLP(config, shard, tp)

    def parts(self) -> LayerParts | None:
        """This layer's modules in forward order: what the fused C decode layer reads (None: a
        sparse expert block, which the C layer does not compute)."""
        attn, mlp = self.self_attn, self.mlp
        if not isinstance(mlp, MLP):
            return None
        return LayerParts(
            self.input_layernorm,
            attn.qkv_proj,
            attn.attn,
            attn.o_proj,
            self.post_attention_layernorm,
            mlp.gate_up_proj,
            mlp.down_proj,
        )

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RotaryInputs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


def rotary_for(config: ModelConfig, max_positions: int) -> RotaryEmbedding:
    """The model's rotary tables for positions [0, max_positions)."""
    inv_freq, scaling = config.rope_inv_freq()
    return RotaryEmbedding(inv_freq, scaling, max_positions)


class DecoderModel(nn.Module):
    """rotary: its tables, when built elsewhere (the loader builds the model on the meta
    device, where computing them would only make meta tensors). tp: this rank's shard of a
    tensor-parallel model (see models.sharding)."""

    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        rotary: RotaryEmbedding | None = None,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.tp = tp if tp is not None and tp.sharded else None
        shard = Shard(config) if self.tp is None else Shard(config, self.tp.rank, self.tp.size)
        self.shard = shard
        self.rotary = rotary_for(config, max_positions) if rotary is None else rotary
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, self.tp)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, self.rotary, shard, self.tp) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._fused: FusedDecode | None = None
        self._fused_checked = False

    def _fused_decode(self, x: torch.Tensor) -> FusedDecode | None:
        """The fused C decode layers for this model and engine, when they apply (CPU, bf16)."""
        if not self._fused_checked:
            self._fused_checked = True
            # The C layers compute whole layers: a shard's would skip the all-reduces.
            kernels = None if self.tp is not None else FusedDecode.supported(self, x)
            self._fused = None if kernels is None else FusedDecode(self, get_global_ctx(), kernels)
        if self._fused is not None and not self._fused.matches(get_global_ctx()):
            self._fused = FusedDecode(self, get_global_ctx(), self._fused.kernels)
        return self._fused

    def forget_fused_decode(self) -> None:
        """Build the C decode layers' parameter blocks again at the next forward (after a
        projection's weight was replaced: they hold pointers into it)."""
        self._fused, self._fused_checked = None, False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        fused = self._fused_decode(x)
        if fused is not None:
            out = fused.run(self, x, positions, get_global_ctx().batch)
            if out is not None:
                return out
        rope = self.rotary.prepare(positions, x.dtype)
        for layer in self.layers:
            x, residual = layer(x, residual, rope)
        return self.norm(x, residual)[0]


class CausalLM(nn.Module):
    """Decoder plus LM head; `forward` returns logits only for the rows asked for: float32 where
    the CPU's packed matmul computes the head (bf16 weights, avx512_bf16 or AVX2), else in the
    model's dtype. rotary, tp: see DecoderModel."""

    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        rotary: RotaryEmbedding | None = None,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, max_positions, rotary, tp)
        self.shard = self.model.shard
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tied, self.model.tp)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor | None = None,
        reuse_logits: bool = False,
    ) -> torch.Tensor:
        """reuse_logits: the logits may live in a buffer the next such call overwrites (see
        LMHead.forward)."""
        hidden = self.hidden_states(input_ids, positions)
        if logits_indices is not None:
            hidden = hidden[logits_indices]
        return self.logits(hidden, reuse_logits)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The final normed hidden state of every token [tokens, hidden]."""
        return self.model(input_ids, positions)

    def logits(self, hidden: torch.Tensor, reuse_logits: bool = False) -> torch.Tensor:
        """The output head over hidden rows [rows, hidden] (see `forward` for the dtype)."""
        return self.lm_head(hidden, reuse_logits)
