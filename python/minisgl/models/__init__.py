"""Model definitions and loading: one shared decoder for Llama, Mistral, Qwen2 and Qwen3."""

from __future__ import annotations

from pathlib import Path

import torch

from minisgl.kernel.cpu import cpu_kernels
from minisgl.layers import Linear, LMHead
from minisgl.utils.memory import empty_on_huge_pages

from .config import SUPPORTED_ARCHITECTURES, ModelConfig
from .decoder import CausalLM
from .weight import load_weights


def load_model_config(model_dir: str | Path) -> ModelConfig:
    from transformers import AutoConfig

    return ModelConfig.from_hf(AutoConfig.from_pretrained(str(model_dir)))


def create_model(
    config: ModelConfig,
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
) -> CausalLM:
    """Build the model on `device`, load its checkpoint and cast to `dtype`."""
    with torch.device("cpu"):
        model = CausalLM(config, max_positions)
    load_weights(model, Path(model_dir))
    # Only parameters take the model dtype: rotary tables stay float32 like transformers'.
    for param in model.parameters():
        param.data = param.data.to(device=device, dtype=dtype)
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            setattr(module, name, buf.to(device))
    if device.type == "cpu":
        kernels = cpu_kernels()
        for module in model.modules():
            if isinstance(module, (Linear, LMHead)):
                module.prepare_for_cpu(kernels)
        _gather_weights_on_huge_pages(model)
    return model.eval()


def _gather_weights_on_huge_pages(model: CausalLM) -> None:
    """Every parameter and every tile-layout packed copy into one buffer on huge pages, one at a
    time (each original freed as its copy lands); before the first forward, which is when the
    fused decode layer takes raw pointers."""
    params = [p for p in model.parameters() if p.numel() > 0]
    projections = [
        m.cpu_projection
        for m in model.modules()
        if isinstance(m, (Linear, LMHead)) and m.cpu_projection is not None
    ]
    # oneDNN's packed copy is an opaque mkldnn tensor: it stays where oneDNN put it.
    packed = [
        pr for pr in projections if pr.packed is not None and pr.packed.layout == torch.strided
    ]
    specs = [(p.shape, p.dtype) for p in params]
    for projection in packed:
        assert projection.packed is not None
        specs.append((projection.packed.shape, projection.packed.dtype))
    slots = empty_on_huge_pages(specs)
    for param, slot in zip(params, slots):
        param.data = slot.copy_(param.data)
    for projection, slot in zip(packed, slots[len(params) :]):
        assert projection.packed is not None
        projection.packed = slot.copy_(projection.packed)


__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CausalLM",
    "ModelConfig",
    "create_model",
    "load_model_config",
]
