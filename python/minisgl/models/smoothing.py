"""SmoothQuant's per-channel smoothing for `int8` weights whose bf16 activations are rounded to
int8 per 32 columns (VNNI without AMX-INT8): input channel j of a projection is divided by s_j
where it is produced and the projection's column j multiplied by s_j before quantization, so
the product is the same in exact arithmetic while the activations' outlier channels shrink and
the weight's quiet columns grow (Xiao et al. 2023). s_j = max|x_j|^alpha / max|W[:, j]|^(1 -
alpha), max|x_j| from a short calibration prefill. Nothing is added per token: 1/s rides on a
norm's weight (qkv, a dense MLP's gate_up) or on gate_up's up rows (down, whose input is
silu(gate) * up). o_proj's input comes out of attention (no weight of its own to carry 1/s); a
sparse block's norm also feeds its router: both left as they are. Not where AMX-INT8 rounds x
per row beside outlier columns against one scale per weight row: there the default model
measured no gain (KL from bf16 5.5e-3 -> 5.4e-3, perplexity on docs and code +0.3% -> +1.2%;
the per-row weights take the moved magnitude badly)."""

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
from .weight import Checkpoint, Cut, dense_weight

# SmoothQuant's migration strength. The default model, teacher-forced on text unseen in
# calibration (float32 simulation, weights int8 per 64 columns, activations per 32): KL from
# float32 3.5e-3 unsmoothed, 2.0e-3 at 0.3 and 0.4, 1.7e-3 at 0.5, 2.3e-3 at 0.7.
SMOOTHING_ALPHA = 0.5
# Tokens of the calibration prefill: 32 to 512 tokens, text or random ids, gave the same KL
# within 10% in that simulation (the channels that carry outliers do so on any input).
CALIBRATION_TOKENS = 128
CALIBRATION_SEED = 0


@dataclass(frozen=True)
class LayerSmoothing:
    """What of one decoder layer is smoothed (None: left as it is): qkv against the input norm,
    gate_up against the post-attention norm, down against gate_up's up rows (only with
    gate_up). prefix: the layer's parameter names' ("model.layers.3")."""

    prefix: str
    attn_norm: RMSNorm
    qkv: Linear | None
    mlp_norm: RMSNorm
    gate_up: Linear | None
    down: Linear | None

    def projections(self) -> list[Linear]:
        return [p for p in (self.qkv, self.gate_up, self.down) if p is not None]


def _smoothable(linear: Linear) -> bool:
    """Its input is rounded to int8 per 32 columns (`rounds_x_per_32`) against a weight that
    `int8` quantized at load, and no adapter reads that input as it was."""
    projection = linear.cpu_projection
    return (
        linear.quantization == "int8"
        and linear.lora is None
        and isinstance(projection, QuantizedProjection)
        and projection.rounds_x_per_32
    )


def smoothing_plan(model: CausalLM, dtype: torch.dtype) -> list[LayerSmoothing]:
    """Per decoder layer with anything to smooth, what (bf16 activations, `dtype`, only)."""
    plan: list[LayerSmoothing] = []
    if dtype != torch.bfloat16:
        return plan
    for i, layer in enumerate(model.model.layers):
        qkv = layer.self_attn.qkv_proj
        gate_up = down = None
        if isinstance(layer.mlp, MLP) and _smoothable(layer.mlp.gate_up_proj):
            gate_up = layer.mlp.gate_up_proj
            down = layer.mlp.down_proj if _smoothable(layer.mlp.down_proj) else None
        smoothed = LayerSmoothing(
            f"model.layers.{i}",
            layer.input_layernorm,
            qkv if _smoothable(qkv) else None,
            layer.post_attention_layernorm,
            gate_up,
            down,
        )
        if smoothed.projections():
            plan.append(smoothed)
    return plan


def input_maxima(
    plan: list[LayerSmoothing], run_calibration: Callable[[], object]
) -> dict[Linear, torch.Tensor]:
    """Each planned projection's input's largest magnitude per channel (float32) over the
    forward that `run_calibration` runs."""
    maxima: dict[Linear, torch.Tensor] = {}

    def record(linear: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        assert isinstance(linear, Linear)
        x = args[0]
        largest = x.detach().reshape(-1, x.shape[-1]).abs().amax(0).float()
        seen = maxima.get(linear)
        maxima[linear] = largest if seen is None else torch.maximum(seen, largest)

    handles = [p.register_forward_pre_hook(record) for s in plan for p in s.projections()]
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


def _divide_norm(norm: RMSNorm, scales: torch.Tensor) -> None:
    weight = norm.weight.data  # in place: the C decode layer holds its address
    weight.copy_((weight.float() / scales).to(weight.dtype))


class _Reader:
    """Dense float32 weights of this rank's projections, read again from the checkpoint."""

    def __init__(self, checkpoint: Checkpoint, cut: Cut | None) -> None:
        self.checkpoint, self.cut = checkpoint, cut

    def __call__(self, linear: Linear, target: str) -> torch.Tensor | None:
        shape = (linear.out_features, linear.in_features)
        return dense_weight(self.checkpoint, f"{target}.weight", shape, self.cut)


def _smooth_layer(
    smoothed: LayerSmoothing,
    maxima: dict[Linear, torch.Tensor],
    read: _Reader,
    kernels: CpuKernels | None,
) -> int:
    """Smooth one layer as planned; the projections re-quantized (a weight the checkpoint holds
    quantized, or whose input went unseen, stays as it is, and so does what carries its 1/s)."""
    done = 0
    qkv, gate_up, down = smoothed.qkv, smoothed.gate_up, smoothed.down
    if qkv is not None and qkv in maxima:
        weight = read(qkv, f"{smoothed.prefix}.self_attn.qkv_proj")
        if weight is not None:
            scales = smoothing_scales(maxima[qkv], weight.abs().amax(0))
            _divide_norm(smoothed.attn_norm, scales)
            qkv.prepare_for_cpu(kernels, None, weight.mul_(scales))
            done += 1
    if gate_up is None or gate_up not in maxima:
        return done
    weight = read(gate_up, f"{smoothed.prefix}.mlp.gate_up_proj")
    if weight is None:
        return done
    scales = smoothing_scales(maxima[gate_up], weight.abs().amax(0))
    if down is not None and down in maxima:
        down_weight = read(down, f"{smoothed.prefix}.mlp.down_proj")
        if down_weight is not None:
            down_scales = smoothing_scales(maxima[down], down_weight.abs().amax(0))
            down.prepare_for_cpu(kernels, None, down_weight.mul_(down_scales))
            del down_weight
            # silu(gate) * up / s: the up rows (and their bias) carry down's 1/s.
            inter = down.in_features
            weight[inter:].div_(down_scales[:, None])
            if gate_up.bias is not None:
                bias = gate_up.bias.data[inter:]
                bias.copy_((bias.float() / down_scales).to(bias.dtype))
            done += 1
    _divide_norm(smoothed.mlp_norm, scales)
    gate_up.prepare_for_cpu(kernels, None, weight.mul_(scales))
    return done + 1


def smooth(
    model: CausalLM,
    plan: list[LayerSmoothing],
    maxima: dict[Linear, torch.Tensor],
    kernels: CpuKernels | None,
    model_dir: str | Path,
    quantization: str,
    gguf_path: str | Path | None = None,
) -> int:
    """Smooth the planned layers, each projection re-quantized from the checkpoint's dense
    weight times its scales; the projections done."""
    cut = model.shard.cut if model.shard.size > 1 else None
    done = 0
    with open_checkpoint(Path(model_dir), quantization, gguf_path) as checkpoint:
        read = _Reader(checkpoint, cut)
        for smoothed in plan:
            done += _smooth_layer(smoothed, maxima, read, kernels)
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
    "LayerSmoothing",
    "calibration_ids",
    "input_maxima",
    "smooth",
    "smoothing_plan",
    "smoothing_scales",
]
