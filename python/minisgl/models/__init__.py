"""Model definitions and loading: one shared decoder for Llama, Mistral, Qwen2, Qwen3 and
Qwen3-MoE."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from minisgl.core import TensorParallel
from minisgl.kernel.cpu import CpuKernels, cpu_kernels
from minisgl.layers import Linear, LMHead, SparseMoE, VocabEmbedding
from minisgl.layers.linear import keeps_weight, tile_copy_elems
from minisgl.layers.moe import EXPERT_STACKS, packs_dense_experts
from minisgl.layers.quant_weight import QuantizedWeight
from minisgl.layers.quantized import LOAD_QUANTIZATIONS
from minisgl.utils.memory import (
    empty_on_huge_pages,
    freed_memory_returned,
    release_freed_memory,
)

from .checkpoint import open_checkpoint
from .config import SUPPORTED_ARCHITECTURES, ModelConfig
from .decoder import CausalLM, rotary_for
from .smoothing import fold_into_neighbours, smoothed_weight
from .weight import Checkpoint, load_weights, quantized_targets


def load_model_config(model_dir: str | Path) -> ModelConfig:
    from transformers import AutoConfig

    return ModelConfig.from_hf(AutoConfig.from_pretrained(str(model_dir)))


def create_model(
    config: ModelConfig,
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    quantization: str | None = None,
    gguf_path: str | Path | None = None,
    tp: TensorParallel | None = None,
    smoothing: dict[str, torch.Tensor] | None = None,
) -> CausalLM:
    """Build the model on `device` in `dtype` and load its checkpoint into it tensor by tensor,
    each weight resident once: on the CPU every parameter and packed copy in one buffer on
    huge pages, a projection's packed or quantized copy in place of its weight (see
    `_CpuPlacement`). quantization: quantized.QUANTIZATIONS ("gguf": the quantized tensors of
    `gguf_path`; None: as the checkpoint holds them). tp: load only this tensor-parallel
    rank's shard (see models.sharding; a quantized tensor's shard stays quantized, or where its
    columns cut a group, is loaded dense). smoothing: `int8` smoothing's scales by projection
    name, applied as the weights load (models/smoothing.py; from smoothing_cache)."""
    # Rotary tables are computed, not loaded: on the CPU in float32, like transformers'.
    rotary = rotary_for(config, max_positions).to(device)
    with torch.device("meta"):
        model = CausalLM(config, max_positions, rotary, tp)
    cut = model.shard.cut if model.shard.size > 1 else None
    with open_checkpoint(Path(model_dir), quantization, gguf_path) as checkpoint:
        prequantized = quantized_targets(checkpoint, model, cut)
        if device.type != "cpu":
            if quantization in LOAD_QUANTIZATIONS or prequantized:
                raise ValueError(f"quantized weights ({quantization}) run on the CPU only for now")
            for name, param in list(model.named_parameters()):
                _replace_param(model, name, torch.empty(param.shape, dtype=dtype, device=device))
            load_weights(model, checkpoint, dtype, cut=cut)
            return model.eval()
        if quantization in LOAD_QUANTIZATIONS:
            # Routers stay dense: a few bytes, and their rounding would change which experts run.
            routers = {m.gate for m in model.modules() if isinstance(m, SparseMoE)}
            for module in model.modules():
                if isinstance(module, (Linear, LMHead, SparseMoE)) and module not in routers:
                    module.quantization = quantization
        with freed_memory_returned():
            placement = _CpuPlacement(model, dtype, cpu_kernels(), prequantized, smoothing)
            load_weights(
                model, checkpoint, dtype, placement.take_packed, cut, placement.hand_over_dtype
            )
            placement.finish()
        if smoothing:
            fold_into_neighbours(model, smoothing)
    release_freed_memory()
    return model.eval()


def _replace_param(model: CausalLM, name: str, tensor: torch.Tensor) -> None:
    """The parameter `name` becomes `tensor` (a meta parameter's data cannot be swapped)."""
    owner, _, attr = name.rpartition(".")
    setattr(model.get_submodule(owner), attr, nn.Parameter(tensor, requires_grad=False))


class _CpuPlacement:
    """Where each weight of a CPU model lives. A projection whose weight the kernels multiply
    through a packed copy gets only that copy (in the C tile layout, a slot here; oneDNN's
    opaque one, where oneDNN puts it): its weight stays on the meta device until the loader
    hands it over (`take_packed`). Every other parameter and tile copy has a slot in one
    buffer on huge pages (see `empty_on_huge_pages`), laid out before anything is read; its
    pages are only taken as the loader fills them, so memory grows by each weight as it lands.
    The fused decode layer takes raw pointers into it at the first forward."""

    def __init__(
        self,
        model: CausalLM,
        dtype: torch.dtype,
        kernels: CpuKernels | None,
        prequantized: set[str],
        smoothing: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.kernels, self.dtype = kernels, dtype
        self.smoothing = smoothing or {}
        params = dict(model.named_parameters())
        # Parameter name -> the module whose packed or quantized copy replaces it, and that
        # copy's elements in the tile layout (None: oneDNN's copy, or quantized).
        self.packed: dict[str, tuple[Linear | LMHead | VocabEmbedding | SparseMoE, int | None]]
        self.packed = {}
        head, embed = model.lm_head, model.model.embed_tokens
        for name, module in model.named_modules():
            if isinstance(module, Linear) and (
                module.quantization is not None or f"{name}.weight" in prequantized
            ):
                self.packed[f"{name}.weight"] = (module, None)  # quantized as handed over
            if isinstance(module, SparseMoE):  # its experts, quantized or packed per expert
                for stack in EXPERT_STACKS:
                    if (
                        module.quantization is not None
                        or f"{name}.{stack}" in prequantized
                        or packs_dense_experts(dtype, kernels)
                    ):
                        self.packed[f"{name}.{stack}"] = (module, None)
        head_quantized = head.quantization is not None or "lm_head.weight" in prequantized
        embed_quantized = "model.embed_tokens.weight" in prequantized
        if head.tied is not None and (head_quantized or embed_quantized):
            self.packed["model.embed_tokens.weight"] = (head, None)
        elif head.tied is None:
            if head_quantized:
                self.packed["lm_head.weight"] = (head, None)
            if embed_quantized:
                self.packed["model.embed_tokens.weight"] = (embed, None)
        if not keeps_weight(dtype, kernels):
            for name, module in model.named_modules():
                untied_head = isinstance(module, LMHead) and module.tied is None
                if (isinstance(module, Linear) or untied_head) and f"{name}.weight" not in (
                    self.packed
                ):
                    self.packed[f"{name}.weight"] = (module, self._tile_elems(module.weight))
        tied_elems = self._tile_elems(embed.weight)
        if head.tied is not None and tied_elems is not None:
            self.packed.setdefault("model.embed_tokens.weight", (head, tied_elems))
        stays = [name for name in params if name not in self.packed]
        tiles = [(name, elems) for name, (_, elems) in self.packed.items() if elems is not None]
        specs = [(params[name].shape, dtype) for name in stays]
        specs += [(torch.Size([elems]), torch.bfloat16) for _, elems in tiles]
        slots = empty_on_huge_pages(specs)
        for name, slot in zip(stays, slots):
            _replace_param(model, name, slot)
        self.tile_slots = {name: slot for (name, _), slot in zip(tiles, slots[len(stays) :])}
        self.prepared: set[Linear | LMHead | VocabEmbedding] = set()
        self.modules: list[Linear | LMHead | VocabEmbedding] = [
            m for m in model.modules() if isinstance(m, (Linear, LMHead))
        ]

    def _tile_elems(self, weight: torch.Tensor) -> int | None:
        out_features, in_features = weight.shape
        return tile_copy_elems(out_features, in_features, self.dtype, self.kernels)

    def hand_over_dtype(self, name: str) -> torch.dtype:
        """float32 for a projection quantized at load (rounded from the checkpoint's values, not
        from the model dtype's rounding of them), else the model's dtype."""
        module, _ = self.packed[name]
        quantizes = isinstance(module, Linear) and module.quantization is not None
        return torch.float32 if quantizes else self.dtype

    def take_packed(self, name: str, weight: torch.Tensor | QuantizedWeight) -> None:
        """The loader's hand-over of a weight that a packed copy replaces."""
        module, _ = self.packed[name]
        if isinstance(module, SparseMoE):
            module.prepare_for_cpu(name.rpartition(".")[2], weight, self.kernels)
            return
        if isinstance(module, Linear) and isinstance(weight, torch.Tensor) and self.smoothing:
            weight = smoothed_weight(name.removesuffix(".weight"), weight, self.smoothing)
        # dtype: a quantized embedding's rows, or a weight no group fits, in the model's
        module.prepare_for_cpu(self.kernels, self.tile_slots.get(name), weight, self.dtype)
        self.prepared.add(module)

    def finish(self) -> None:
        """Pick the matmul path of every projection whose weight stayed where it was loaded."""
        for module in self.modules:
            if module not in self.prepared:
                module.prepare_for_cpu(self.kernels)


__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "Checkpoint",
    "CausalLM",
    "ModelConfig",
    "create_model",
    "load_model_config",
]
