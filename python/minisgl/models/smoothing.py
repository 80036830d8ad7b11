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

import hashlib
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
    `int8` quantized at load (its LoRA adapters' A take the scales too: engine/lora.py)."""
    projection = linear.cpu_projection
    return (
        linear.quantization == "int8"
        and isinstance(projection, QuantizedProjection)
        and projection.rounds_x_per_32
    )


def smoothing_plan(model: CausalLM) -> list[LayerSmoothing]:
    """Per decoder layer with anything to smooth, what (a bf16 model's: the engine's `smooths`
    asks that)."""
    plan: list[LayerSmoothing] = []
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


def smoothed_weight(
    projection: str, weight: torch.Tensor, scales: dict[str, torch.Tensor]
) -> torch.Tensor:
    """A projection's dense weight (as loaded, not written) with its smoothing: columns times
    its scales, and a gate_up's up rows divided by its down's (float32; `weight` itself where
    `scales` has neither). projection: its name, e.g. "model.layers.3.mlp.gate_up_proj"."""
    columns = scales.get(projection)
    downs = None
    if projection.endswith(".mlp.gate_up_proj"):
        downs = scales.get(projection.removesuffix("gate_up_proj") + "down_proj")
    if columns is None and downs is None:
        return weight
    smoothed = weight.to(torch.float32, copy=True)
    if columns is not None:
        smoothed.mul_(columns)
    if downs is not None:  # silu(gate) * up / s: the up rows carry down's 1/s
        smoothed[smoothed.shape[0] // 2 :].div_(downs[:, None])
    return smoothed


def fold_into_neighbours(model: CausalLM, scales: dict[str, torch.Tensor]) -> None:
    """Divide by the scales where each smoothed input is produced: qkv's by the input norm's
    weight, gate_up's by the post-attention norm's, down's by gate_up's up bias (its up rows
    are `smoothed_weight`'s). In place: the C decode layer holds their addresses."""

    def divide(tensor: torch.Tensor, by: torch.Tensor) -> None:
        tensor.copy_((tensor.float() / by).to(tensor.dtype))

    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}"
        qkv = scales.get(f"{prefix}.self_attn.qkv_proj")
        if qkv is not None:
            divide(layer.input_layernorm.weight.data, qkv)
        gate_up = scales.get(f"{prefix}.mlp.gate_up_proj")
        if gate_up is not None:
            divide(layer.post_attention_layernorm.weight.data, gate_up)
        down = scales.get(f"{prefix}.mlp.down_proj")
        if down is not None and isinstance(layer.mlp, MLP):
            bias = layer.mlp.gate_up_proj.bias
            if bias is not None:
                divide(bias.data[bias.shape[0] // 2 :], down)


class _Reader:
    """This rank's projections' dense weights read again from the checkpoint in float32, as the
    loader hands a weight quantized at load over (so that smoothing now and smoothing from
    cached scales as they load give the same integers)."""

    def __init__(self, checkpoint: Checkpoint, cut: Cut | None) -> None:
        self.checkpoint, self.cut = checkpoint, cut

    def __call__(self, linear: Linear, name: str) -> torch.Tensor | None:
        shape = (linear.out_features, linear.in_features)
        return dense_weight(self.checkpoint, f"{name}.weight", shape, torch.float32, self.cut)


def _layer_scales(
    smoothed: LayerSmoothing, maxima: dict[Linear, torch.Tensor], read: _Reader
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[Linear, torch.Tensor]]]:
    """One planned layer's scales by projection name, and the dense weights read for them (a
    weight the checkpoint holds quantized, or whose input went unseen, is left as it is, and
    down without gate_up, whose up rows carry its 1/s)."""
    scales: dict[str, torch.Tensor] = {}
    dense: dict[str, tuple[Linear, torch.Tensor]] = {}

    def take(linear: Linear, name: str) -> bool:
        weight = read(linear, name) if linear in maxima else None
        if weight is None:
            return False
        scales[name] = smoothing_scales(maxima[linear], weight.abs().amax(0))
        dense[name] = (linear, weight)
        return True

    prefix = smoothed.prefix
    if smoothed.qkv is not None:
        take(smoothed.qkv, f"{prefix}.self_attn.qkv_proj")
    if smoothed.gate_up is not None and take(smoothed.gate_up, f"{prefix}.mlp.gate_up_proj"):
        if smoothed.down is not None:
            take(smoothed.down, f"{prefix}.mlp.down_proj")
    return scales, dense


def smooth(
    model: CausalLM,
    plan: list[LayerSmoothing],
    maxima: dict[Linear, torch.Tensor],
    kernels: CpuKernels | None,
    model_dir: str | Path,
    quantization: str,
    gguf_path: str | Path | None = None,
) -> dict[str, torch.Tensor]:
    """Smooth the planned layers, each projection re-quantized from the checkpoint's dense
    weight times its scales; the scales applied, by projection name."""
    cut = model.shard.cut if model.shard.size > 1 else None
    applied: dict[str, torch.Tensor] = {}
    with open_checkpoint(Path(model_dir), quantization, gguf_path) as checkpoint:
        read = _Reader(checkpoint, cut)
        for smoothed in plan:
            scales, dense = _layer_scales(smoothed, maxima, read)
            for name, (linear, weight) in dense.items():
                linear.prepare_for_cpu(kernels, None, smoothed_weight(name, weight, scales))
            applied.update(scales)
            del dense
    fold_into_neighbours(model, applied)
    if applied:
        model.model.forget_fused_decode()
    return applied


def scales_digest(scales: dict[str, torch.Tensor]) -> str | None:
    """A digest of the scales applied (None: none): what a model's KV depends on beyond its
    checkpoint and quantization (the disk KV tier's fingerprint)."""
    if not scales:
        return None
    digest = hashlib.sha256()
    for name in sorted(scales):
        digest.update(name.encode())
        digest.update(scales[name].float().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


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
    "fold_into_neighbours",
    "scales_digest",
    "input_maxima",
    "smooth",
    "smoothed_weight",
    "smoothing_plan",
    "smoothing_scales",
]
