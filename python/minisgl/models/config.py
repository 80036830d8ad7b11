"""Model configuration: the architecture facts minisgl needs, read from a Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
)


@dataclass(frozen=True)
class ModelConfig:
    """One decoder-only transformer shape; variants (biases, q/k norm, windows, experts) are
    flags. num_experts 0: every layer a dense MLP; else `moe_layers` says which are sparse."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    hidden_act: str
    max_position_embeddings: int
    sliding_windows: tuple[int | None, ...]
    eos_token_ids: tuple[int, ...]
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    moe_intermediate_size: int
    moe_layers: tuple[bool, ...]
    hf_config: Any

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        archs = getattr(hf_config, "architectures", None) or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or hf_config.model_type!r}; "
                f"minisgl supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf_config.hidden_act!r}; only silu")
        eos = getattr(hf_config, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        is_moe = arch == "Qwen3MoeForCausalLM"
        num_experts = int(hf_config.num_experts) if is_moe else 0
        top_k = int(hf_config.num_experts_per_tok) if is_moe else 0
        if num_experts > 0 and not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in [1, {num_experts}]")
        return cls(
            architecture=arch,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_qo_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            hidden_act="silu",
            max_position_embeddings=hf_config.max_position_embeddings,
            sliding_windows=_sliding_windows(hf_config),
            eos_token_ids=eos_ids,
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            norm_topk_prob=is_moe and bool(hf_config.norm_topk_prob),
            moe_intermediate_size=int(hf_config.moe_intermediate_size) if is_moe else 0,
            moe_layers=_moe_layers(hf_config, num_experts),
            hf_config=hf_config,
        )

    def rope_inv_freq(self) -> tuple[torch.Tensor, float]:
        """Inverse frequencies and cos/sin scale, computed exactly as transformers does."""
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = getattr(self.hf_config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params.get("rope_theta", getattr(self.hf_config, "rope_theta", 10000.0))
            exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float()
            return 1.0 / (base ** (exponents / self.head_dim)), 1.0
        if rope_type == "dynamic":
            raise ValueError("rope_type 'dynamic' depends on sequence length: not supported")
        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"unsupported rope_type {rope_type!r}")
        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](self.hf_config, torch.device("cpu"))
        return inv_freq.float(), float(scale)


def _moe_layers(hf_config: Any, num_experts: int) -> tuple[bool, ...]:
    """Per layer, whether its MLP is a sparse expert block: transformers' Qwen3MoeDecoderLayer
    rule (not in mlp_only_layers, and every decoder_sparse_step-th layer)."""
    num_layers = hf_config.num_hidden_layers
    if num_experts <= 0:
        return (False,) * num_layers
    dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
    step = getattr(hf_config, "decoder_sparse_step", 1)
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))


def _sliding_windows(hf_config: Any) -> tuple[int | None, ...]:
    """Per-layer attention window (None = full attention)."""
    num_layers = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if window is None:
        return (None,) * num_layers
    if layer_types is not None:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if getattr(hf_config, "use_sliding_window", None) is False:
        return (None,) * num_layers
    return (window,) * num_layers
