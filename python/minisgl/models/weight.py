"""Load Hugging Face safetensors checkpoints (single file or sharded) into a CausalLM."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from .decoder import CausalLM

# HF projections that minisgl stores fused, and their order inside the fused weight.
_FUSED = {
    "q_proj": ("qkv_proj", 0, 3),
    "k_proj": ("qkv_proj", 1, 3),
    "v_proj": ("qkv_proj", 2, 3),
    "gate_proj": ("gate_up_proj", 0, 2),
    "up_proj": ("gate_up_proj", 1, 2),
}
# HF names whose module sits elsewhere in minisgl (q/k norms live inside the attention layer).
_RENAMES = (
    (".self_attn.q_norm.", ".self_attn.attn.q_norm."),
    (".self_attn.k_norm.", ".self_attn.attn.k_norm."),
)
_PROJ = re.compile(r"^(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({model_dir / name for name in weight_map.values()})
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def iter_checkpoint(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def load_weights(model: CausalLM, model_dir: Path) -> None:
    """Copy checkpoint tensors into `model`, fusing q/k/v and gate/up; every param must be set."""
    params = dict(model.named_parameters())
    pending: dict[str, list[torch.Tensor | None]] = {}
    loaded: set[str] = set()

    def assign(name: str, tensor: torch.Tensor) -> None:
        if name not in params:
            raise KeyError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        param = params[name]
        if param.shape != tensor.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {param.shape}")
        param.data.copy_(tensor)
        loaded.add(name)

    for name, tensor in iter_checkpoint(model_dir):
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if name.endswith("rotary_emb.inv_freq"):
            continue
        for old, new in _RENAMES:
            name = name.replace(old, new)
        match = _PROJ.match(name)
        if match is None:
            assign(name, tensor)
            continue
        prefix, proj, kind = match.groups()
        fused, slot, count = _FUSED[proj]
        fused_name = f"{prefix}.{fused}.{kind}"
        parts = pending.setdefault(fused_name, [None] * count)
        parts[slot] = tensor
        if all(p is not None for p in parts):
            assign(fused_name, torch.cat(parts, dim=0))  # type: ignore[arg-type]
            del pending[fused_name]

    if pending:
        raise ValueError(f"incomplete fused weights in checkpoint: {sorted(pending)}")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks {len(missing)} tensors, e.g. {missing[:3]}")
