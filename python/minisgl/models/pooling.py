"""How a model folder's embeddings are made, from its sentence-transformers files (modules.json,
the Pooling module's config.json): which hidden states are pooled and whether the vector is
normalized. A folder without them: the last token's, normalized (as vLLM pools decoders)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

# sentence-transformers' pooling flags (and v5's `pooling_mode` names) -> Req.pooling
_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}
_NAMES = {"lasttoken": "last", "mean": "mean"}


@dataclass(frozen=True)
class PoolingConfig:
    """mode: core.POOLING_MODES; normalize: the vector scaled to unit length."""

    mode: str = "last"
    normalize: bool = True


def pooling_config(model_dir: str | Path) -> PoolingConfig:
    """The folder's pooling (ValueError naming a mode it uses that is not served)."""
    folder = Path(model_dir)
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return PoolingConfig()
    modules = json.loads(modules_file.read_text())
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules}
    normalize = "Normalize" in kinds
    pooling = kinds.get("Pooling")
    if pooling is None:
        return PoolingConfig("last", normalize)
    config = json.loads((folder / pooling.get("path", "") / "config.json").read_text())
    if isinstance(config.get("pooling_mode"), str):
        name = config["pooling_mode"]
        if name not in _NAMES:
            raise ValueError(f"{folder}: pooling mode {name!r} is not served (last or mean)")
        return PoolingConfig(_NAMES[name], normalize)
    on = [flag for flag, value in config.items() if flag.startswith("pooling_mode_") and value]
    if len(on) != 1 or on[0] not in _MODES:
        raise ValueError(f"{folder}: pooling {on} is not served (one of lasttoken, mean_tokens)")
    return PoolingConfig(_MODES[on[0]], normalize)


def finish_embedding(vector: list[float], dimensions: int | None, normalize: bool) -> list[float]:
    """A pooled vector as returned: cut to its first `dimensions` (Matryoshka), then scaled to
    unit length where the model normalizes (ValueError naming `dimensions` out of range)."""
    if dimensions is not None:
        if not 1 <= dimensions <= len(vector):
            raise ValueError(f"dimensions must lie in [1, {len(vector)}], got {dimensions}")
        vector = vector[:dimensions]
    if not normalize:
        return vector
    values = torch.tensor(vector, dtype=torch.float64)
    return (values / values.norm().clamp_min(1e-12)).tolist()
