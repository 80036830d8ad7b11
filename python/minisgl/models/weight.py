"""Load checkpoints into a CausalLM tensor by tensor: Hugging Face safetensors (single file or
sharded) from the memory-mapped files, each straight into the target dtype and device, or any
other `Checkpoint` (a GGUF file, a quantized folder), whose quantized tensors are handed over
as they are."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from minisgl.layers.quant_weight import QuantizedWeight, concat_rows, narrow
from minisgl.utils.memory import drop_pages

from .decoder import CausalLM

# HF projections that minisgl stores fused, and their order inside the fused weight.
_FUSED = {
    "q_proj": ("qkv_proj", 0, 3),
    "k_proj": ("qkv_proj", 1, 3),
    "v_proj": ("qkv_proj", 2, 3),
    "gate_proj": ("gate_up_proj", 0, 2),
    "up_proj": ("gate_up_proj", 1, 2),
}
_PART_NAMES = {
    fused: [proj for proj, (name, _, _) in _FUSED.items() if name == fused]
    for fused in ("qkv_proj", "gate_up_proj")
}
# HF names whose module sits elsewhere in minisgl (q/k norms live inside the attention layer).
_RENAMES = (
    (".self_attn.q_norm.", ".self_attn.attn.q_norm."),
    (".self_attn.k_norm.", ".self_attn.attn.k_norm."),
)
_PROJ = re.compile(r"^(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
# A sparse layer's experts, stacked per layer: every expert's gate and up into w_gate_up
# [E, 2I, H], its down into w_down [E, H, I] (filled as if flattened to [E * rows, cols]).
_EXPERT = re.compile(r"^(.*)\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_STACKS = {
    "gate_proj": ("w_gate_up", ("gate_proj", "up_proj")),
    "up_proj": ("w_gate_up", ("gate_proj", "up_proj")),
    "down_proj": ("w_down", ("down_proj",)),
}


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({model_dir / name for name in weight_map.values()})
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


@dataclass(frozen=True)
class TensorEntry:
    """Where one checkpoint tensor lies (its file) and its shape."""

    file: int
    shape: tuple[int, ...]


class MappedCheckpoint:
    """Every tensor of a safetensors checkpoint as safetensors maps it: a view of the
    memory-mapped file, read only when touched; `release` lets go of a tensor's pages once it
    has been copied (they stay in the page cache, not in this process). Use as a context
    manager: no view may outlive it."""

    def __init__(self, model_dir: Path) -> None:
        self.entries: dict[str, TensorEntry] = {}
        self._files = [safe_open(str(f), framework="pt") for f in safetensors_files(model_dir)]
        # Metadata only: safetensors reads pages around each tensor it makes a view of.
        for index, handle in enumerate(self._files):
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                shape = tuple(handle.get_slice(name).get_shape())
                self.entries[name] = TensorEntry(index, shape)
        self._viewed: dict[str, tuple[int, int]] = {}  # name -> (address, bytes) in its mapping

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor as it lies in the file (a view of the mapping)."""
        view = self._files[self.entries[name].file].get_tensor(name)
        self._viewed[name] = (view.data_ptr(), view.numel() * view.element_size())
        return view

    @property
    def quantized_names(self) -> frozenset[str]:
        return frozenset()

    def quantized(self, name: str) -> QuantizedWeight | None:
        """None: a plain safetensors checkpoint holds every tensor dense."""
        del name
        return None

    def release(self, name: str) -> None:
        """Drop the pages of a tensor read through `tensor` (a later read maps them again)."""
        if name in self._viewed:
            drop_pages(*self._viewed.pop(name))

    def __enter__(self) -> MappedCheckpoint:
        return self

    def __exit__(self, *exc_info: object) -> None:
        # The files are unmapped once the last view of them is gone.
        self._files.clear()


class Checkpoint(Protocol):
    """Tensors by Hugging Face name, dense shapes in `entries`; `quantized` gives a tensor the
    checkpoint holds quantized as a QuantizedWeight (None: dense), `tensor` any as a dense
    tensor, `quantized_names` which are quantized (without reading them)."""

    entries: dict[str, TensorEntry]

    @property
    def quantized_names(self) -> frozenset[str]: ...

    def tensor(self, name: str) -> torch.Tensor: ...

    def quantized(self, name: str) -> QuantizedWeight | None: ...

    def release(self, name: str) -> None: ...


def _model_name(checkpoint_name: str) -> str:
    for old, new in _RENAMES:
        checkpoint_name = checkpoint_name.replace(old, new)
    return checkpoint_name


# A model parameter's checkpoint tensors, each with the first row it fills.
Sources = list[tuple[str, int]]
# (parameter, checkpoint tensor) -> the (dim, start, length) of the tensor that this
# tensor-parallel rank's parameter takes (models.sharding.Shard.cut); None: all of it.
Cut = Callable[[str, str], tuple[int, int, int] | None]


def _part_shape(checkpoint: Checkpoint, target: str, part: str, cut: Cut | None) -> tuple:
    """A checkpoint tensor's shape as this rank's parameter takes it."""
    shape = list(checkpoint.entries[part].shape)
    where = None if cut is None else cut(target, part)
    if where is not None:
        shape[where[0]] = where[2]
    return tuple(shape)


def _stacked(checkpoint: Checkpoint, target: str, parts: list[str], cut: Cut | None) -> Sources:
    """The parts of a fused or stacked parameter, each with its first row; raises for a part
    the checkpoint lacks."""
    missing = [p for p in parts if p not in checkpoint.entries]
    if missing:
        raise ValueError(f"incomplete fused weights in checkpoint: {target} lacks {missing[:3]}")
    rows = [0]
    for part in parts:
        rows.append(rows[-1] + _part_shape(checkpoint, target, part, cut)[0])
    return list(zip(parts, rows))


def _rows_shape(shape: torch.Size) -> tuple[int, ...]:
    """A parameter's shape as its parts fill it: a stack of matrices as one [rows, cols]."""
    return (math.prod(shape[:-1]), shape[-1]) if len(shape) > 2 else tuple(shape)


def _sources(checkpoint: Checkpoint, model: CausalLM, cut: Cut | None = None) -> dict[str, Sources]:
    """Every parameter of `model` and where it comes from (`cut`: this rank's shard of each);
    raises for a tensor without a place and for a parameter (or part) the checkpoint lacks."""
    params = dict(model.named_parameters())
    sources: dict[str, Sources] = {}
    placed: set[str] = set()  # checkpoint tensors inside a fused or stacked parameter
    for name in checkpoint.entries:
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if name.endswith("rotary_emb.inv_freq") or name in placed:
            continue
        expert, match = _EXPERT.match(name), _PROJ.match(name)
        if expert is not None:
            prefix, proj = expert.groups()
            stack, projs = _EXPERT_STACKS[proj]
            target = f"{prefix}.{stack}"
            if target not in params:  # reported below as a tensor without a place
                sources[name] = [(name, 0)]
                continue
            num_experts = params[target].shape[0]
            parts = [f"{prefix}.experts.{e}.{p}.weight" for e in range(num_experts) for p in projs]
        elif match is not None:
            prefix, proj, kind = match.groups()
            fused = _FUSED[proj][0]
            target = f"{prefix}.{fused}.{kind}"
            parts = [f"{prefix}.{part}.{kind}" for part in _PART_NAMES[fused]]
        else:
            sources[_model_name(name)] = [(name, 0)]
            continue
        sources[target] = _stacked(checkpoint, target, parts, cut)
        placed.update(parts)
        if name not in placed:  # e.g. an expert past the layer's count
            raise KeyError(f"checkpoint tensor {name!r} has no place in {target}")
    unknown = sorted(set(sources) - set(params))
    if unknown:
        raise KeyError(f"checkpoint tensor {unknown[0]!r} has no place in {type(model).__name__}")
    missing = sorted(set(params) - set(sources))
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    for target, parts in sources.items():
        shapes = [_part_shape(checkpoint, target, name, cut) for name, _ in parts]
        shape = (sum(s[0] for s in shapes), *shapes[0][1:])
        want = _rows_shape(params[target].shape)
        if shape != want or any(s[1:] != shapes[0][1:] for s in shapes):
            raise ValueError(f"{target}: checkpoint shapes {shapes} do not make {want}")
    return sources


def quantized_targets(checkpoint: Checkpoint, model: CausalLM, cut: Cut | None = None) -> set[str]:
    """The model parameters the checkpoint fills with quantized weights (every part of a fused
    one quantized; cut: this tensor-parallel rank's shards)."""
    quantized = checkpoint.quantized_names
    if not quantized:
        return set()
    return {
        target
        for target, parts in _sources(checkpoint, model, cut).items()
        if all(name in quantized for name, _ in parts)
    }


def _quantized_whole(
    checkpoint: Checkpoint, target: str, parts: Sources, cut: Cut | None
) -> QuantizedWeight | None:
    """A parameter's quantized weight (parts stacked, each cut to this rank's shard), or None
    where any part is dense or its cut splits a group."""
    if not all(name in checkpoint.quantized_names for name, _ in parts):
        return None
    weights = []
    for name, _ in parts:
        weight = checkpoint.quantized(name)
        where = None if cut is None or weight is None else cut(target, name)
        if where is not None:
            weight = narrow(weight, *where)
        if weight is None:
            return None
        weights.append(weight)
    return weights[0] if len(weights) == 1 else concat_rows(weights)


def _copy_rows(
    checkpoint: Checkpoint, target: str, parts: Sources, into: torch.Tensor, cut: Cut | None
) -> None:
    """The parts (each cut to this rank's shard) into their rows of `into` (converted to its
    dtype and device as copied); a stack of matrices takes them as one [rows, cols] matrix."""
    if into.dim() > 2:
        into = into.view(-1, into.shape[-1])
    for name, row in parts:
        source = checkpoint.tensor(name)
        where = None if cut is None else cut(target, name)
        if where is not None:  # a view: only the shard's pages are read
            source = source.narrow(*where)
        into[row : row + source.shape[0]].copy_(source)
        del source
        checkpoint.release(name)


def load_weights(
    model: CausalLM,
    checkpoint: Checkpoint,
    dtype: torch.dtype,
    on_loaded: Callable[[str, torch.Tensor | QuantizedWeight], None] | None = None,
    cut: Cut | None = None,
    hand_over_dtype: Callable[[str], torch.dtype] | None = None,
) -> None:
    """Fill every parameter of `model` from `checkpoint` (open), in `dtype`, fusing q/k/v and
    gate/up. A parameter with storage is written in place, converted as it is copied. One on
    the meta device is handed whole to `on_loaded(name, weight)`: its QuantizedWeight where the
    checkpoint holds it quantized, else a tensor (a view of the mapped file where the
    checkpoint holds it as it is, else a temporary), which must not be kept; those come after
    every parameter with storage, so a module's bias is in place by then. cut: this
    tensor-parallel rank's shard of each parameter (see `Cut`). hand_over_dtype: the dtype a
    parameter handed to `on_loaded` comes in, where not `dtype` (a weight quantized at load: the
    checkpoint's precision, not the model's)."""
    params = dict(model.named_parameters())
    sources = _sources(checkpoint, model, cut)

    def file_order(target: str) -> tuple[bool, int]:
        return params[target].is_meta, checkpoint.entries[sources[target][0][0]].file

    for target in sorted(sources, key=file_order):
        param, parts = params[target], sources[target]
        if not param.is_meta:
            _copy_rows(checkpoint, target, parts, param.data, cut)
            continue
        assert on_loaded is not None, f"{target} is on the meta device and nothing takes it"
        quantized = _quantized_whole(checkpoint, target, parts, cut)
        if quantized is not None:
            on_loaded(target, quantized)
            for name, _ in parts:
                checkpoint.release(name)
            continue
        uncut = len(parts) == 1 and (cut is None or cut(target, parts[0][0]) is None)
        whole = checkpoint.tensor(parts[0][0]) if uncut else None
        wanted = dtype if hand_over_dtype is None else hand_over_dtype(target)
        if whole is None or whole.dtype != wanted:  # converted, fused or cut: a temporary
            whole = torch.empty(param.shape, dtype=wanted)
            _copy_rows(checkpoint, target, parts, whole, cut)
        on_loaded(target, whole)
        del whole
        checkpoint.release(parts[0][0])


def dense_weight(
    checkpoint: Checkpoint,
    target: str,
    shape: tuple[int, int],
    dtype: torch.dtype,
    cut: Cut | None = None,
) -> torch.Tensor | None:
    """A 2-D parameter's weight read again from the checkpoint (open) in `dtype`, as
    `load_weights` hands it over: q/k/v or gate/up fused, cut to this tensor-parallel rank's
    shard; None where the checkpoint holds any part quantized (re-rounding its integers would
    only add error)."""
    prefix, _, kind = target.rpartition(".")
    fused = prefix.rpartition(".")[2]
    if target in checkpoint.entries or fused not in _PART_NAMES:
        names = [target]
    else:
        names = [f"{prefix.rpartition('.')[0]}.{part}.{kind}" for part in _PART_NAMES[fused]]
    if any(name in checkpoint.quantized_names for name in names):
        return None
    weight = torch.empty(shape, dtype=dtype)
    _copy_rows(checkpoint, target, _stacked(checkpoint, target, names, cut), weight, cut)
    return weight


def checkpoint_bytes(model_dir: Path, dtype: torch.dtype, tied: bool) -> int:
    """Bytes the checkpoint's tensors take in `dtype` (a tied lm_head counted once)."""
    total = 0
    with MappedCheckpoint(Path(model_dir)) as checkpoint:
        for name, entry in checkpoint.entries.items():
            if (name == "lm_head.weight" and tied) or name.endswith("rotary_emb.inv_freq"):
                continue
            total += math.prod(entry.shape) * dtype.itemsize
    return total
