"""The disk KV tier: chunks of KV that left memory, in files keyed by chained token hashes
(kvcache/page_hash.py) under DIR/<fingerprint>/, so a restarted server reuses them.

Threads: the scheduler thread owns the index and every decision; one writer thread checksums
and writes files. They talk through two lock-free queues only (queue.SimpleQueue), so a step
never waits on the writer, and a full write queue drops the write (the tier is a cache).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from minisgl.utils import init_logger

from .mha_pool import MHAKVCache
from .page_hash import chunk_keys, chunk_tokens
from .tier_file import SUFFIX, ChunkFileError, read_chunk, write_chunk

logger = init_logger(__name__)

# A writer's temporary file this old is left over from a crash, not a write in progress.
_STALE_TMP_S = 3600.0


@dataclass
class TierStats:
    """Lifetime counters of the tier (and two gauges: files and bytes on disk now)."""

    chunks_written: int = 0
    bytes_written: int = 0
    chunks_read: int = 0
    bytes_read: int = 0
    tokens_loaded: int = 0  # prompt tokens whose KV came back from disk
    writes_dropped: int = 0  # chunks not written: the write queue was full
    corrupt_skipped: int = 0  # files rejected (header, token ids, checksum) and deleted
    missing_skipped: int = 0  # files gone between the index and the read
    files_evicted: int = 0  # deleted to stay within the disk budget
    write_errors: int = 0
    files: int = 0
    disk_bytes: int = 0


@dataclass
class _WriteJob:
    keys: list[str]
    fingerprint: str  # what the KV was computed under (the tier's, or a LoRA adapter's)
    ids: np.ndarray  # [chunks, chunk tokens] int32
    k: np.ndarray  # [layers, chunks * chunk tokens, heads, head_dim * itemsize] uint8
    v: np.ndarray


class DiskKVTier:
    """Saves evicted KV chunks to disk and loads them back into the KV pool; bounded by
    `max_bytes` with LRU eviction of files (a read touches its file's mtime)."""

    def __init__(
        self,
        root: str | os.PathLike,
        fingerprint: str,
        pool: MHAKVCache,
        page_size: int,
        max_bytes: int,
        max_pending_bytes: int = 512 << 20,
    ) -> None:
        """Raises OSError if the directory cannot be created, read or written."""
        self.dir = Path(root) / fingerprint
        self.dir.mkdir(parents=True, exist_ok=True)
        if not os.access(self.dir, os.R_OK | os.W_OK | os.X_OK):
            raise PermissionError(f"{self.dir} is not readable and writable")
        self.fingerprint, self.pool = fingerprint, pool
        self.chunk = chunk_tokens(page_size)
        _, heads, head_dim = pool.k_cache(0).shape
        self._dtype = pool.k_cache(0).dtype
        self._shape = (2, pool.num_layers, self.chunk, heads, head_dim)
        self.chunk_bytes = int(np.prod(self._shape)) * self._dtype.itemsize
        self.max_bytes, self.max_pending_bytes = max_bytes, max_pending_bytes
        self.stats = TierStats()
        self._index: OrderedDict[str, int] = self._scan()  # key -> file size, oldest first
        self.stats.disk_bytes = sum(self._index.values())
        self.stats.files = len(self._index)
        self._pending: set[str] = set()
        self._pending_bytes = 0
        self._read_buffer = np.empty(self.chunk_bytes, dtype=np.uint8)
        self._writable = True  # scheduler thread's view
        self._write_failed = False  # writer thread's
        self._jobs: queue.SimpleQueue[_WriteJob | list[Path] | threading.Event | None] = (
            queue.SimpleQueue()
        )
        self._done: queue.SimpleQueue[tuple[str, int]] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
        self._writer.start()
        self._enforce_budget()
        logger.info(
            "KV tier at %s: %d files, %.2f GiB (budget %.2f GiB), chunks of %d tokens",
            self.dir,
            len(self._index),
            self.stats.disk_bytes / 2**30,
            max_bytes / 2**30,
            self.chunk,
        )

    # ---------------------------------------------------------------- writes
    def save(
        self,
        ids: torch.Tensor,
        slots: torch.Tensor,
        start: int,
        block: bool = False,
        fingerprint: str | None = None,
    ) -> None:
        """Queue the whole chunks of the path `ids` (KV at `slots`) that end after `start` and
        are not on disk yet. The KV is copied now (its pages are about to be reused); the write
        happens later, or not at all if the queue is full, unless `block` (shutdown) waits.
        fingerprint: what the KV was computed under where not the tier's own (an adapter's)."""
        if not self._writable:
            return
        self._drain()
        c = self.chunk
        first, count = start // c, len(ids) // c
        if first >= count:
            return
        fingerprint = fingerprint or self.fingerprint
        keys = chunk_keys(fingerprint, ids, c, count)
        new = [i for i in range(first, count) if keys[i] not in self._index]
        new = [i for i in new if keys[i] not in self._pending]
        if block:
            while self._pending_bytes and self._pending_bytes + len(new) * self.chunk_bytes > (
                self.max_pending_bytes
            ):
                self._drain(wait=True)
        elif self._pending_bytes:  # an idle writer takes any one node, however large
            room = max(0, (self.max_pending_bytes - self._pending_bytes) // self.chunk_bytes)
            self.stats.writes_dropped += max(0, len(new) - room)
            new = new[:room]  # the earlier chunks: later ones are only reachable through them
        if not new:
            return
        token_slots = torch.cat([slots[i * c : (i + 1) * c] for i in new])
        k, v = self.pool.gather(token_slots)
        ids_np = torch.stack([ids[i * c : (i + 1) * c] for i in new]).to(torch.int32).numpy()
        job = _WriteJob([keys[i] for i in new], fingerprint, ids_np, _as_bytes(k), _as_bytes(v))
        self._pending.update(job.keys)
        self._pending_bytes += len(new) * self.chunk_bytes
        self._jobs.put(job)

    def _write_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            if isinstance(job, threading.Event):
                job.set()  # everything queued before it is done
            elif isinstance(job, list):
                for path in job:
                    try:
                        path.unlink(missing_ok=True)
                    except OSError as exc:  # someone else's file now, or a read-only disk
                        logger.warning("KV tier: cannot delete %s: %s", path, exc)
            else:
                self._write_job(job)

    def _write_job(self, job: _WriteJob) -> None:
        c = self.chunk
        for j, key in enumerate(job.keys):
            if self._write_failed:
                self._done.put((key, -1))
                continue
            # Each layer's rows of this chunk are contiguous: written without another copy.
            parts = [x[i, j * c : (j + 1) * c] for x in (job.k, job.v) for i in range(len(x))]
            path = self._path(key)
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                size = write_chunk(path, job.fingerprint, job.ids[j], parts)
            except Exception as exc:  # disk full, read-only, gone: the engine runs on
                self._write_failed = True
                self._done.put((key, -1))
                logger.warning("KV tier: writing %s failed (%s); no more writes", path, exc)
                continue
            self._done.put((key, size))

    def _drain(self, wait: bool = False) -> None:
        """Take in the writer's finished writes (waiting for one if `wait`)."""
        while True:
            try:
                key, size = self._done.get(block=wait)
            except queue.Empty:
                break
            wait = False
            self._pending.discard(key)
            self._pending_bytes -= self.chunk_bytes
            if size < 0:
                self.stats.write_errors += 1
                self._writable = False  # disk full or read-only: run on without writes
                continue
            self.stats.chunks_written += 1
            self.stats.bytes_written += size
            self._add(key, size)
        self._enforce_budget()

    # ---------------------------------------------------------------- reads
    def lookup(
        self, ids: torch.Tensor, start: int, fingerprint: str | None = None
    ) -> tuple[int, list[str]]:
        """(index of the chunk holding token `start`, keys of the consecutive whole chunks of
        `ids` from it on that the tier holds; fingerprint: as `save`'s)."""
        self._drain()
        c = self.chunk
        first, count = start // c, len(ids) // c
        if first >= count:
            return first, []
        held: list[str] = []
        for key in chunk_keys(fingerprint or self.fingerprint, ids, c, count)[first:]:
            if key not in self._index and not self._adopt(key):
                break
            held.append(key)
        return first, held

    def read_into(
        self,
        key: str,
        ids: torch.Tensor,
        slots: torch.Tensor,
        skip: int,
        fingerprint: str | None = None,
    ) -> bool:
        """Copy chunk `key`'s KV for its tokens [skip, chunk) into `slots`, after checking the
        file against `ids` (the chunk's token ids) and `fingerprint` (as `save`'s). False if it
        is gone or invalid (forgotten, and deleted if invalid): the caller recomputes it."""
        path = self._path(key)
        try:
            expected = fingerprint or self.fingerprint
            read_chunk(path, expected, ids.to(torch.int32).numpy(), self._read_buffer)
        except FileNotFoundError:
            self.stats.missing_skipped += 1
            self._forget(key, delete=False)
            return False
        except ChunkFileError as exc:
            logger.warning("KV tier: skipping %s: %s", path, exc)
            self.stats.corrupt_skipped += 1
            self._forget(key, delete=True)
            return False
        except OSError as exc:
            logger.warning("KV tier: cannot read %s: %s", path, exc)
            self._forget(key, delete=False)
            return False
        kv = torch.from_numpy(self._read_buffer).view(self._dtype).view(self._shape)
        self.pool.scatter(slots, kv[0, :, skip:], kv[1, :, skip:])
        self.stats.chunks_read += 1
        self.stats.bytes_read += self.chunk_bytes
        self.stats.tokens_loaded += self.chunk - skip
        self._index.move_to_end(key)
        try:
            os.utime(path)  # LRU order survives a restart
        except OSError:
            pass  # evicted meanwhile by another server: the copy in memory is what counts
        return True

    # ---------------------------------------------------------------- index
    def _path(self, key: str) -> Path:
        return self.dir / key[:2] / (key + SUFFIX)

    def _scan(self) -> OrderedDict[str, int]:
        """The files on disk now, least recently used first; stale temporary files removed."""
        found: list[tuple[float, str, int]] = []
        now = time.time()
        for sub in self.dir.iterdir():
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                try:
                    st = entry.stat()
                except OSError:
                    continue  # deleted by another server meanwhile
                if entry.name.endswith(SUFFIX) and not entry.name.startswith("."):
                    found.append((st.st_mtime, entry.name.removesuffix(SUFFIX), st.st_size))
                elif entry.name.endswith(".tmp") and now - st.st_mtime > _STALE_TMP_S:
                    Path(entry.path).unlink(missing_ok=True)
        found.sort()
        return OrderedDict((key, size) for _, key, size in found)

    def _adopt(self, key: str) -> bool:
        """Whether another server wrote `key` since the scan (then it joins the index)."""
        try:
            size = self._path(key).stat().st_size
        except OSError:
            return False
        self._add(key, size)
        return True

    def _add(self, key: str, size: int) -> None:
        self._forget(key, delete=False)
        self._index[key] = size
        self.stats.disk_bytes += size
        self.stats.files = len(self._index)

    def _forget(self, key: str, delete: bool) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self.stats.disk_bytes -= size
            self.stats.files = len(self._index)
        if delete:
            self._jobs.put([self._path(key)])

    def _enforce_budget(self) -> None:
        doomed: list[Path] = []
        while self.stats.disk_bytes > self.max_bytes and self._index:
            key, size = self._index.popitem(last=False)
            self.stats.disk_bytes -= size
            self.stats.files_evicted += 1
            doomed.append(self._path(key))
        if doomed:
            self.stats.files = len(self._index)
            self._jobs.put(doomed)

    # ---------------------------------------------------------------- lifecycle
    def clear(self) -> int:
        """Delete every file of this fingerprint (other servers' too); returns how many."""
        self.wait_writes()
        removed = 0
        for path in self.dir.glob("*/*" + SUFFIX):
            try:
                path.unlink()
                removed += 1
            except OSError as exc:  # gone already, or not ours to delete
                logger.warning("KV tier: cannot delete %s: %s", path, exc)
        self._index.clear()
        self.stats.disk_bytes = self.stats.files = 0
        return removed

    def wait_writes(self) -> None:
        """Block until every write queued so far is on disk (or failed) and accounted for."""
        if not self._writer.is_alive():
            return
        done = threading.Event()
        self._jobs.put(done)
        while not done.wait(1.0) and self._writer.is_alive():
            pass
        self._drain()

    def close(self) -> None:
        """Finish the queued writes (and the deletions they make due) and stop the writer."""
        self.wait_writes()
        if self._writer.is_alive():
            self._jobs.put(None)
            self._writer.join()


def _as_bytes(x: torch.Tensor) -> np.ndarray:
    """A CPU tensor's bytes as a uint8 array of the same shape but the last dim in bytes."""
    x = x.cpu().contiguous()
    return x.view(torch.uint8).numpy()
