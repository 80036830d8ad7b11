"""GGUF weights repacked once: the first load of a GGUF file writes every tensor it handed out
(quantized ones in QuantizedWeight's layout, dense ones as loaded) to one safetensors file in
the cache, keyed by the file's path, size and modification time and by the layout's version;
later loads read that file instead (no GGUF parse, no repacking: the default model starts ~4 s
sooner)."""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from minisgl.layers.quant_weight import QuantizedWeight
from minisgl.utils.hf import cache_dir, short_digest

from .gguf import GgufCheckpoint
from .weight import TensorEntry

# Bumped whenever QuantizedWeight's layout or a repacking changes: old files are then ignored.
LAYOUT_VERSION = 2
# Dense tensors are kept (float32) until the cache is written: skip caching files with more.
MAX_DENSE_BYTES = 256 << 20


# A cache file's name: the GGUF's stem and its path's digest (`source`), then the version's.
_CACHE_NAME = re.compile(r"(?P<source>.+-[0-9a-f]{8})[0-9a-f]{8}\.safetensors")


def cache_file(gguf: Path) -> Path:
    """Where the repacked tensors of this GGUF file live: named by the file's path, then by its
    size, modification time and the layout's version (a changed file gets a new name; writing
    it removes the path's older ones, `_remove_older_copies`)."""
    stat = gguf.stat()
    version = short_digest(f"{stat.st_size}:{stat.st_mtime_ns}:{LAYOUT_VERSION}")
    return (
        cache_dir()
        / "gguf"
        / f"{gguf.stem}-{short_digest(str(gguf.resolve()))}{version}.safetensors"
    )


def _remove_older_copies(target: Path) -> None:
    """Delete the cache files of target's GGUF path but target: copies of the file before it
    was replaced or touched, or of an older layout, never read again."""
    named = _CACHE_NAME.fullmatch(target.name)
    if named is None:
        return
    for old in target.parent.iterdir():
        other = _CACHE_NAME.fullmatch(old.name)
        if other is not None and other["source"] == named["source"] and old != target:
            old.unlink(missing_ok=True)


class CachedGguf:
    """A GGUF file's tensors as an earlier load repacked them (the Checkpoint protocol)."""

    def __init__(self, path: Path) -> None:
        self._file = safe_open(str(path), framework="pt")
        layout = json.loads(self._file.metadata()["layout"])
        self.entries = {name: TensorEntry(0, tuple(item["shape"])) for name, item in layout.items()}
        self._quantized = {name: item["quantized"] for name, item in layout.items()}

    @functools.cached_property
    def quantized_names(self) -> frozenset[str]:
        return frozenset(name for name, q in self._quantized.items() if q is not None)

    def tensor(self, name: str) -> torch.Tensor:
        weight = self.quantized(name)
        return self._file.get_tensor(name) if weight is None else weight.dequantize()

    def quantized(self, name: str) -> QuantizedWeight | None:
        layout = self._quantized[name]
        if layout is None:
            return None
        mins = f"{name}:mins" if layout["mins"] else None
        return QuantizedWeight(
            self._file.get_tensor(f"{name}:values"),
            self._file.get_tensor(f"{name}:scales"),
            None if mins is None else self._file.get_tensor(mins),
            layout["bits"],
            layout["group"],
        )

    def release(self, name: str) -> None:
        del name  # get_tensor copies out of the mapping

    def __enter__(self) -> CachedGguf:
        return self

    def __exit__(self, *exc_info: object) -> None:
        del self._file


class CachingGguf(GgufCheckpoint):
    """A GgufCheckpoint that writes what it hands out to `cache_file` when the load completes
    (every tensor taken, no error), atomically: a crash leaves no half-written cache."""

    def __init__(self, path: Path, target: Path) -> None:
        super().__init__(path)
        self._target = target
        self._taken: dict[str, torch.Tensor | QuantizedWeight] = {}
        self._dense_bytes = 0

    def tensor(self, name: str) -> torch.Tensor:
        dense = super().tensor(name)
        self._dense_bytes += dense.numel() * dense.element_size()
        if self._dense_bytes <= MAX_DENSE_BYTES:
            self._taken[name] = dense
        return dense

    def quantized(self, name: str) -> QuantizedWeight | None:
        weight = super().quantized(name)
        if weight is not None:
            self._taken[name] = weight
        return weight

    def __exit__(self, *exc_info: object) -> None:
        super().__exit__(*exc_info)
        complete = exc_info[0] is None and set(self._taken) == set(self.entries)
        if complete and self._dense_bytes <= MAX_DENSE_BYTES:
            self._write()
        self._taken.clear()

    def _write(self) -> None:
        tensors: dict[str, torch.Tensor] = {}
        layout: dict[str, dict] = {}
        for name, item in self._taken.items():
            quantized = None
            if isinstance(item, QuantizedWeight):
                tensors[f"{name}:values"] = item.values.contiguous()
                tensors[f"{name}:scales"] = item.scales.contiguous()
                if item.mins is not None:
                    tensors[f"{name}:mins"] = item.mins.contiguous()
                quantized = {"bits": item.bits, "group": item.group, "mins": item.mins is not None}
            else:
                tensors[name] = item.contiguous()
            layout[name] = {"shape": list(self.entries[name].shape), "quantized": quantized}
        self._target.parent.mkdir(parents=True, exist_ok=True)
        staging = self._target.with_name(self._target.name + f".tmp{os.getpid()}")
        save_file(tensors, str(staging), metadata={"layout": json.dumps(layout)})
        staging.rename(self._target)
        _remove_older_copies(self._target)


def open_gguf(path: Path) -> CachedGguf | CachingGguf:
    """The GGUF's tensors: from its cache file where an earlier load wrote one (an unreadable
    one is replaced), else from the file itself, writing the cache as they are taken."""
    target = cache_file(path)
    if target.exists():
        try:
            return CachedGguf(target)
        except Exception:  # any unreadable file (safetensors raises its own error types)
            target.unlink(missing_ok=True)
    return CachingGguf(path, target)
