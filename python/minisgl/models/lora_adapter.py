"""PEFT LoRA adapter folders (`adapter_config.json` + `adapter_model.safetensors`): each
adapted projection's A and B, its scaling folded into B, keyed by the model's fused projection
(qkv_proj, gate_up_proj, o_proj, down_proj) and the part of it the HF module is."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

# HF module -> (our projection, part index within it).
TARGETS = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)"
    r"\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)


@dataclass
class LoraAdapter:
    """One adapter: per (layer, our projection) the parts it adapts, each (A [r, in],
    B [out, r] * scaling)."""

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]]


def _invalid(path: Path, message: str) -> ValueError:
    return ValueError(f"LoRA adapter {str(path)!r}: {message}")


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    safetensors_file = folder / "adapter_model.safetensors"
    if safetensors_file.is_file():
        from safetensors.torch import load_file

        return load_file(str(safetensors_file))
    bin_file = folder / "adapter_model.bin"
    if bin_file.is_file():
        return torch.load(str(bin_file), map_location="cpu", weights_only=True)
    raise _invalid(folder, "has no adapter_model.safetensors (or .bin)")


def read_adapter(name: str, path: str, max_rank: int) -> LoraAdapter:
    """Read and check a PEFT LoRA folder: rank <= max_rank, only q/k/v/o and gate/up/down
    targets, no DoRA, no bias, no modules_to_save; ValueError naming what is wrong."""
    folder = Path(path)
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise _invalid(folder, "has no adapter_config.json (not a PEFT adapter folder)")
    config = json.loads(config_file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise _invalid(folder, f"peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("use_dora"):
        raise _invalid(folder, "DoRA (use_dora) is not supported")
    if config.get("modules_to_save"):
        raise _invalid(folder, f"modules_to_save {config['modules_to_save']} is not supported")
    if config.get("bias", "none") != "none":
        raise _invalid(folder, f"bias={config['bias']!r} is not supported")
    rank = int(config["r"])
    alpha = float(config.get("lora_alpha", rank))
    alpha_pattern = config.get("alpha_pattern") or {}
    rslora = bool(config.get("use_rslora", False))
    weights: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in _tensors(folder).items():
        match = _KEY.match(key)
        if match is None or match.group(2) not in TARGETS:
            raise _invalid(folder, f"adapts {key!r}: only q/k/v/o and gate/up/down projections")
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        pairs.setdefault((layer, module), {})[which] = tensor.float()
    for (layer, module), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise _invalid(folder, f"layer {layer} {module}: lora_A and lora_B must both be there")
        a, b = pair["A"], pair["B"]
        r = a.shape[0]
        if r > max_rank:
            raise _invalid(folder, f"rank {r} exceeds --max-lora-rank {max_rank}")
        if b.shape[1] != r:
            raise _invalid(folder, f"layer {layer} {module}: B {tuple(b.shape)} vs A rank {r}")
        projection, part = TARGETS[module]
        full = f"model.layers.{layer}.{projection.split('.')[0]}.{module}"
        # The module's own rank (its A's rows: PEFT's rank_pattern) and alpha (alpha_pattern).
        a_here = float(_pattern(alpha_pattern, full, alpha))
        scaling = a_here / (math.sqrt(r) if rslora else r)
        weights.setdefault((layer, projection), {})[part] = (a, b * scaling)
    if not weights:
        raise _invalid(folder, "holds no LoRA weights")
    used = max(a.shape[0] for parts in weights.values() for a, _ in parts.values())
    return LoraAdapter(name, str(folder), used, weights)


def _pattern(patterns: dict[str, float], module: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern: the value of the first key the module name ends
    with (as PEFT matches them), else the default."""
    for key, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default
