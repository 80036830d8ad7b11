"""Load Hugging Face safetensors checkpoints (single file or sharded) into a CausalLM, tensor by
tensor from the memory-mapped files, each straight into the target dtype and device."""

from __future__ import annotations

import json
import math
import mmap
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import torch

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
# The safetensors format's dtype names.
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
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
    """Where one tensor lies in a checkpoint: file, byte range, dtype and shape."""

    file: int
    start: int
    end: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class MappedCheckpoint:
    """Every tensor of a safetensors checkpoint as a view of its memory-mapped file, read only
    when touched; `release` lets go of a tensor's pages once it has been copied (they stay in
    the page cache, not in this process). Use as a context manager: no view may outlive it."""

    def __init__(self, model_dir: Path) -> None:
        self.entries: dict[str, TensorEntry] = {}
        self._maps: list[mmap.mmap] = []
        for index, file in enumerate(safetensors_files(model_dir)):
            with open(file, "rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(header_len))
                # Copy-on-write: torch wants a writable buffer; nothing is ever written.
                self._maps.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY))
            base = 8 + header_len
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if info["dtype"] not in _DTYPES:
                    raise ValueError(
                        f"{file}: tensor {name!r} has unsupported dtype {info['dtype']}"
                    )
                start, end = info["data_offsets"]
                shape = tuple(info["shape"])
                self.entries[name] = TensorEntry(
                    index, base + start, base + end, _DTYPES[info["dtype"]], shape
                )

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor as it lies in the file (a view of the mapping)."""
        e = self.entries[name]
        count = math.prod(e.shape)
        if count == 0:
            return torch.empty(e.shape, dtype=e.dtype)
        flat = torch.frombuffer(self._maps[e.file], dtype=e.dtype, count=count, offset=e.start)
        return flat.view(e.shape)

    def release(self, name: str) -> None:
        """Drop the tensor's pages from this process (a later read maps them again)."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        e = self.entries[name]
        first = e.start - e.start % mmap.PAGESIZE
        if e.end > first:
            self._maps[e.file].madvise(mmap.MADV_DONTNEED, first, e.end - first)

    def close(self) -> None:
        """Unmap the files; raises BufferError while a view of them is still referenced."""
        while self._maps:
            self._maps[-1].close()
            self._maps.pop()

    def __enter__(self) -> MappedCheckpoint:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if kind is None:
            self.close()
        else:  # the frames of the error may still hold views: unmapped when they go
            self._maps.clear()


def _model_name(checkpoint_name: str) -> str:
    for old, new in _RENAMES:
        checkpoint_name = checkpoint_name.replace(old, new)
    return checkpoint_name


# A model parameter's checkpoint tensors, each with the first row it fills.
Sources = list[tuple[str, int]]


def _sources(checkpoint: MappedCheckpoint, model: CausalLM) -> dict[str, Sources]:
    """Every parameter of `model` and where it comes from; raises for a tensor without a place
    and for a parameter (or part of a fused one) the checkpoint lacks."""
    params = dict(model.named_parameters())
    sources: dict[str, Sources] = {}
    for name in checkpoint.entries:
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if name.endswith("rotary_emb.inv_freq"):
            continue
        match = _PROJ.match(name)
        if match is None:
            sources[_model_name(name)] = [(name, 0)]
            continue
        prefix, proj, kind = match.groups()
        fused = _FUSED[proj][0]
        target = f"{prefix}.{fused}.{kind}"
        if target in sources:
            continue
        parts = [f"{prefix}.{part}.{kind}" for part in _PART_NAMES[fused]]
        missing = [p for p in parts if p not in checkpoint.entries]
        if missing:
            raise ValueError(f"incomplete fused weights in checkpoint: {target} lacks {missing}")
        rows = [0]
        for part in parts:
            rows.append(rows[-1] + checkpoint.entries[part].shape[0])
        sources[target] = list(zip(parts, rows))
    unknown = sorted(set(sources) - set(params))
    if unknown:
        raise KeyError(f"checkpoint tensor {unknown[0]!r} has no place in {type(model).__name__}")
    missing = sorted(set(params) - set(sources))
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    for target, parts in sources.items():
        shapes = [checkpoint.entries[name].shape for name, _ in parts]
        shape = (sum(s[0] for s in shapes), *shapes[0][1:])
        want = tuple(params[target].shape)
        if shape != want or any(s[1:] != shapes[0][1:] for s in shapes):
            raise ValueError(f"{target}: checkpoint shapes {shapes} do not make {want}")
    return sources


def _copy_rows(checkpoint: MappedCheckpoint, parts: Sources, into: torch.Tensor) -> None:
    """The parts into their rows of `into` (converted to its dtype and device as copied)."""
    for name, row in parts:
        source = checkpoint.tensor(name)
        into[row : row + source.shape[0]].copy_(source)
        del source
        checkpoint.release(name)


def load_weights(
    model: CausalLM,
    model_dir: Path,
    dtype: torch.dtype,
    on_loaded: Callable[[str, torch.Tensor], None] | None = None,
) -> None:
    """Fill every parameter of `model` from the checkpoint in `model_dir`, in `dtype`, fusing
    q/k/v and gate/up. A parameter with storage is written in place, converted as it is copied.
    One on the meta device is handed whole to `on_loaded(name, tensor)` (a view of the mapped
    file where the checkpoint holds it as it is, else a temporary), which must not keep it;
    those come after every parameter with storage, so a module's bias is in place by then."""
    params = dict(model.named_parameters())
    with MappedCheckpoint(Path(model_dir)) as checkpoint:
        sources = _sources(checkpoint, model)

        def file_order(target: str) -> tuple[bool, int, int]:
            first = checkpoint.entries[sources[target][0][0]]
            return params[target].is_meta, first.file, first.start

        for target in sorted(sources, key=file_order):
            param, parts = params[target], sources[target]
            if not param.is_meta:
                _copy_rows(checkpoint, parts, param.data)
                continue
            assert on_loaded is not None, f"{target} is on the meta device and nothing takes it"
            if len(parts) == 1 and checkpoint.entries[parts[0][0]].dtype == dtype:
                whole = checkpoint.tensor(parts[0][0])
            else:
                whole = torch.empty(param.shape, dtype=dtype)
                _copy_rows(checkpoint, parts, whole)
            on_loaded(target, whole)
            del whole
            checkpoint.release(parts[0][0])


def checkpoint_bytes(model_dir: Path, dtype: torch.dtype, tied: bool) -> int:
    """Bytes the checkpoint's tensors take in `dtype` (a tied lm_head counted once)."""
    total = 0
    with MappedCheckpoint(Path(model_dir)) as checkpoint:
        for name, entry in checkpoint.entries.items():
            if (name == "lm_head.weight" and tied) or name.endswith("rotary_emb.inv_freq"):
                continue
            total += math.prod(entry.shape) * dtype.itemsize
    return total
