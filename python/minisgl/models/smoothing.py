"""SmoothQuant's per-channel smoothing for `int8` weights whose bf16 activations are rounded to
int8 per 32 columns (VNNI without AMX-INT8): a norm's output channel j is divided by s_j and the projection it feeds
multiplies its column j by s_j before quantization, so the product is the same in exact
arithmetic while the activations' outlier channels shrink and the weights' quiet columns grow
(Xiao et al. 2023). s_j = max|x_j|^alpha / max|W_:,j|^(1 - alpha), max|x_j| from a short
calibration prefill. Folding 1/s into the norm's weight costs nothing per token.

Pairs smoothed: each layer's input norm with qkv, and its post-attention norm with a dense
MLP's gate_up (an expert block's norm also feeds its router: left as it is). Not where
AMX-INT8 rounds x per row beside outlier columns against one scale per weight row: there the
default model measured no gain (KL from bf16 5.5e-3 -> 5.4e-3, perplexity on docs and code
+0.3% -> +1.2%; the per-row weights take the moved magnitude badly)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from minisgl.kernel.cpu import CpuKernels
from minisgl.layers import Linear, RMSNorm
from minisgl.layers.quantized import QuantizedProjection

from .checkpoint import open_checkpoint
from .decoder import MLP, CausalLM
from .weight import dense_weight

# SmoothQuant's migration strength. The default model, teacher-forced on text unseen in
# calibration (float32 simulation, weights int8 per 64 columns, activations per 32): KL from
# float32 3.5e-3 unsmoothed, 2.0e-3 at 0.3 and 0.4, 1.7e-3 at 0.5, 2.3e-3 at 0.7.
SMOOTHING_ALPHA = 0.5
# Tokens of the calibration prefill: 32 to 512 tokens, text or random ids, gave the same KL
# within 10% in that simulation (the channels that carry outliers do so on any input).
CALIBRATION_TOKENS = 128
CALIBRATION_SEED = 0


@dataclass(frozen=True)
class SmoothedPair:
    """A norm and the one projection its output feeds; target: the projection's weight name."""

    norm: RMSNorm
    linear: Linear
    target: str


def smoothing_pairs(model: CausalLM, dtype: torch.dtype) -> list[SmoothedPair]:
    """The pairs whose projection rounds its input to int8 per 32 columns (bf16 activations,
    `dtype`; see `rounds_x_per_32`) from a weight quantized at load by `int8`, without adapters (their
    deltas read the norm's output as it was)."""
    pairs: list[SmoothedPair] = []
    if dtype != torch.bfloat16:
        return pairs
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}"
        candidates = [
            (layer.input_layernorm, layer.self_attn.qkv_proj, f"{prefix}.self_attn.qkv_proj")
        ]
        if isinstance(layer.mlp, MLP):
            mlp = layer.mlp.gate_up_proj
            candidates.append((layer.post_attention_layernorm, mlp, f"{prefix}.mlp.gate_up_proj"))
        for norm, linear, name in candidates:
            projection = linear.cpu_projection
            if (
                linear.quantization == "int8"
                and linear.lora is None
                and isinstance(projection, QuantizedProjection)
                and projection.rounds_x_per_32
            ):
                pairs.append(SmoothedPair(norm, linear, f"{name}.weight"))
    return pairs


def input_maxima(
    pairs: list[SmoothedPair], run_calibration: Callable[[], None]
) -> dict[RMSNorm, torch.Tensor]:
    """Each pair's norm output's largest magnitude per channel (float32) over the forward that
    `run_calibration` runs."""
    maxima: dict[RMSNorm, torch.Tensor] = {}

    def record(norm: torch.nn.Module, args: object, output: tuple[torch.Tensor, ...]) -> None:
        del args
        assert isinstance(norm, RMSNorm)
        largest = output[0].detach().reshape(-1, output[0].shape[-1]).abs().amax(0).float()
        seen = maxima.get(norm)
        maxima[norm] = largest if seen is None else torch.maximum(seen, largest)

    handles = [pair.norm.register_forward_hook(record) for pair in pairs]
    try:
        run_calibration()
    finally:
        for handle in handles:
            handle.remove()
    return maxima


def smoothing_scales(
    input_max: torch.Tensor, weight_max: torch.Tensor, alpha: float = SMOOTHING_ALPHA
) -> torch.Tensor:
    """s per input channel, SmoothQuant's max|x|^alpha / max|W|^(1 - alpha); 1 where either
    maximum is zero or not finite (nothing to balance, or nothing trustworthy)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"smoothing alpha must lie in [0, 1], got {alpha}")
    usable = (
        torch.isfinite(input_max) & torch.isfinite(weight_max) & (input_max > 0) & (weight_max > 0)
    )
    scales = input_max.clamp_min(1e-30).pow(alpha) / weight_max.clamp_min(1e-30).pow(1 - alpha)
    usable &= torch.isfinite(scales) & (scales > 0)
    return torch.where(usable, scales, torch.ones_like(scales))


def smooth(
    model: CausalLM,
    pairs: list[SmoothedPair],
    maxima: dict[RMSNorm, torch.Tensor],
    kernels: CpuKernels | None,
    model_dir: str | Path,
    quantization: str,
    gguf_path: str | Path | None = None,
) -> int:
    """Fold each pair's scales into its norm's weight and re-quantize its projection from the
    checkpoint's dense weight times them; the pairs done (a weight the checkpoint holds
    quantized stays as it is)."""
    cut = model.shard.cut if model.shard.size > 1 else None
    done = 0
    with open_checkpoint(Path(model_dir), quantization, gguf_path) as checkpoint:
        for pair in pairs:
            linear, shape = pair.linear, (pair.linear.out_features, pair.linear.in_features)
            weight = dense_weight(checkpoint, pair.target, shape, cut)
            input_max = maxima.get(pair.norm)
            if weight is None or input_max is None:
                continue
            scales = smoothing_scales(input_max, weight.abs().amax(0))
            norm_weight = pair.norm.weight.data
            norm_weight.copy_((norm_weight.float() / scales).to(norm_weight.dtype))
            weight.mul_(scales)
            linear.prepare_for_cpu(kernels, None, weight)
            del weight
            done += 1
    if done:
        model.model.forget_fused_decode()
    return done


def calibration_ids(vocab_size: int, tokens: int = CALIBRATION_TOKENS) -> torch.Tensor:
    """Seeded random token ids: the calibration prefill's input (no tokenizer at this layer;
    outlier channels show on any input, see CALIBRATION_TOKENS)."""
    generator = torch.Generator().manual_seed(CALIBRATION_SEED)
    return torch.randint(0, vocab_size, (max(1, tokens),), generator=generator)


__all__ = [
    "CALIBRATION_TOKENS",
    "SMOOTHING_ALPHA",
    "SmoothedPair",
    "calibration_ids",
    "input_maxima",
    "smooth",
    "smoothing_pairs",
    "smoothing_scales",
]
