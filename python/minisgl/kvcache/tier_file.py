"""One disk-tier file: a checked header, the chunk's token ids, then its K and V for all layers.

Layout (little-endian): magic, format version, fingerprint (16 bytes), token count, payload
length, CRC-32 of the payload; the token ids (int32); the payload (K then V, each
[layers, tokens, kv heads, head dim] in the pool's dtype). A file is written under a temporary
name and renamed into place, so a reader sees a whole file or none.
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from pathlib import Path

import numpy as np

MAGIC = b"MSGLKVT\x00"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sI16sIQI")
SUFFIX = ".kv"


class ChunkFileError(Exception):
    """A tier file that must not be served: truncated, corrupted, stale or someone else's."""


def write_chunk(
    path: Path, fingerprint: str, ids: np.ndarray, parts: tuple[memoryview, ...]
) -> int:
    """Write one chunk file atomically; returns its size in bytes. Raises OSError."""
    payload_len = sum(p.nbytes for p in parts)
    crc = 0
    for part in parts:  # zlib releases the GIL on large buffers
        crc = zlib.crc32(part, crc)
    token_bytes = ids.astype("<i4").tobytes()
    header = _HEADER.pack(
        MAGIC, FORMAT_VERSION, bytes.fromhex(fingerprint), len(ids), payload_len, crc
    )
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_native_id()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(token_bytes)
            for part in parts:
                f.write(part)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return _HEADER.size + len(token_bytes) + payload_len


def read_chunk(path: Path, fingerprint: str, ids: np.ndarray, payload: np.ndarray) -> None:
    """Fill `payload` (uint8, the exact payload length) from the file at `path`, after checking
    its header, its token ids against `ids` and its checksum. Raises FileNotFoundError when it
    is gone, ChunkFileError when it is not a valid file of this chunk, OSError otherwise."""
    with open(path, "rb") as f:
        raw = f.read(_HEADER.size)
        if len(raw) != _HEADER.size:
            raise ChunkFileError("truncated header")
        magic, version, fp, count, payload_len, crc = _HEADER.unpack(raw)
        if magic != MAGIC or version != FORMAT_VERSION:
            raise ChunkFileError(f"not a version-{FORMAT_VERSION} tier file")
        if fp != bytes.fromhex(fingerprint):
            raise ChunkFileError("another model's or setting's file")
        if count != len(ids) or payload_len != payload.nbytes:
            raise ChunkFileError(f"{count} tokens / {payload_len} bytes: not this chunk's shape")
        # Keys are hashes: the ids themselves rule out a collision.
        if f.read(4 * count) != ids.astype("<i4").tobytes():
            raise ChunkFileError("token ids differ from the chunk's")
        if f.readinto(payload) != payload.nbytes or f.read(1):
            raise ChunkFileError("truncated or overlong payload")
    if zlib.crc32(payload) != crc:
        raise ChunkFileError("payload checksum mismatch")
