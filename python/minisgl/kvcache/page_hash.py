"""Keys of the disk KV tier: a fingerprint of everything that shapes the KV, and chained chunk
hashes of the token path from the root (as vLLM's block hashes)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from minisgl.utils import align_up

# Tokens per tier file before page rounding: small enough that a prompt restores all but its
# last < 64 tokens, large enough that a file amortises its header and its open().
CHUNK_TOKENS = 64
# Weight files whose name, size and mtime identify the checkpoint (a rewrite changes them).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def chunk_tokens(page_size: int) -> int:
    """Tokens per tier chunk: CHUNK_TOKENS rounded up to whole pages."""
    return align_up(CHUNK_TOKENS, page_size)


def _weight_files(path: Path) -> list[list[Any]]:
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    out: list[list[Any]] = []
    for f in files:
        if f.suffix in _WEIGHT_SUFFIXES:
            st = f.stat()
            out.append([f.name, st.st_size, st.st_mtime_ns])
    return out


def model_fingerprint(model_path: str, gguf_path: str | None, settings: dict[str, Any]) -> str:
    """A hex digest of the model (resolved path, config.json, weight files' names, sizes and
    mtimes, the GGUF's) and `settings` (dtype, page size, KV layout, quantization, TP rank...):
    KV written under one fingerprint is valid for exactly that combination."""
    folder = Path(model_path).resolve()
    config = folder / "config.json"
    spec = {
        "path": str(folder),
        "config": config.read_text() if config.is_file() else None,
        "weights": _weight_files(folder),
        "gguf": None if gguf_path is None else _weight_files(Path(gguf_path).resolve()),
        "settings": settings,
    }
    blob = json.dumps(spec, sort_keys=True, default=str).encode()
    return hashlib.blake2b(blob, digest_size=16).hexdigest()


def chunk_keys(fingerprint: str, ids: torch.Tensor, chunk: int, count: int) -> list[str]:
    """Keys of the first `count` whole chunks of `ids` (a path from the root): key_i hashes
    key_{i-1} and chunk i's token ids, so a key names its chunk and everything before it."""
    data = ids[: count * chunk].to(torch.int32).numpy().tobytes()
    step = 4 * chunk
    keys: list[str] = []
    prev = bytes.fromhex(fingerprint)
    for i in range(count):
        prev = hashlib.blake2b(prev + data[i * step : (i + 1) * step], digest_size=16).digest()
        keys.append(prev.hex())
    return keys
