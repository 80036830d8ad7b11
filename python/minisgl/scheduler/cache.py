"""CacheManager: KV page allocation, prefix-cache matching and the per-request cache lifecycle."""

from __future__ import annotations

import hashlib
from typing import Protocol

import torch

from minisgl.core import Req
from minisgl.kvcache import BaseCacheHandle, BasePrefixCache, DiskKVTier, RadixPrefixCache
from minisgl.utils import align_down, align_up, div_ceil

from .free_pages import FreePages

# New token slots up to which allocate lists their columns in Python: a decode step's few slots
# cost one tensor, where an arange a request (and their cat) cost ~3 us each, more in a step
# whose weights just swept the caches.
LISTED_SLOTS = 4096


class AdapterKeys(Protocol):
    """How LoRA adapters' prefix-cache keys map back (engine/lora.py's LoraManager)."""

    def tier_key(self, keys: torch.Tensor) -> tuple[str, torch.Tensor] | None: ...


class CacheManager:
    """Owns the free page list and the prefix cache (and the disk tier below it, if any);
    keeps free + cached == all pages."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        page_table: torch.Tensor,
        prefix_cache: BasePrefixCache,
        tier: DiskKVTier | None = None,
    ) -> None:
        self.num_pages, self.page_size = num_pages, page_size
        self.tier = tier
        if tier is not None:
            if not isinstance(prefix_cache, RadixPrefixCache):
                raise ValueError("a disk KV tier needs the radix prefix cache")
            prefix_cache.spill = self._spill  # evicted KV goes to disk
        self.page_table = page_table
        self.device = page_table.device
        # Set where adapters are served: their KV goes to the tier under their fingerprints.
        self.adapter_keys: AdapterKeys | None = None
        self.prefix_cache = prefix_cache
        self._free_pages = FreePages(num_pages, page_size, self.device)

    # ---------------------------------------------------------------- accounting
    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def available_size(self) -> int:
        """Tokens that could be allocated now: free pages plus evictable cache."""
        return self.num_free_pages * self.page_size + self.prefix_cache.size_info.evictable_size

    def pages_to_grow(self, req: Req, new_len: int) -> int:
        """Pages `req` needs so that positions [0, new_len) have KV slots."""
        return div_ceil(new_len, self.page_size) - div_ceil(req.device_len, self.page_size)

    def check_integrity(self) -> None:
        """With no request holding pages: free pages + cached pages == all pages."""
        self.prefix_cache.check_integrity()
        cached = self.prefix_cache.size_info.total_size
        assert cached % self.page_size == 0, f"cache holds {cached} tokens, not whole pages"
        free, total = self.num_free_pages, self.num_pages
        assert free + cached // self.page_size == total, (
            f"page leak: {free} free + {cached // self.page_size} cached != {total} pages"
        )
        assert len(torch.unique(self._free_pages.all())) == free, "a page is free twice"

    def flush(self, tier: bool = False) -> tuple[int, int]:
        """Empty the prefix cache, its pages back on the free list (not written to the disk
        tier), and with `tier` the disk tier too; returns (pages freed, files deleted). Only
        while no request holds pages (a locked prefix is a RuntimeError, nothing changed)."""
        size = self.prefix_cache.size_info
        if size.protected_size:
            raise RuntimeError(f"{size.protected_size} cached tokens are in use by requests")
        radix = self.prefix_cache if isinstance(self.prefix_cache, RadixPrefixCache) else None
        spill = None if radix is None else radix.spill
        if radix is not None:
            radix.spill = None
        try:
            evicted = self.prefix_cache.evict(size.evictable_size)
        finally:
            if radix is not None:
                radix.spill = spill
        page_starts = evicted[evicted % self.page_size == 0]
        self._free_pages.add(page_starts)
        self.prefix_cache.reset()
        self.check_integrity()
        files = self.tier.clear() if tier and self.tier is not None else 0
        return len(page_starts), files

    def close(self) -> None:
        """Write what the tree holds to the disk tier (waiting for it) and stop the tier."""
        if self.tier is None:
            return
        cache = self.prefix_cache
        assert isinstance(cache, RadixPrefixCache)
        tier = self.tier
        cache.spill = lambda ids, slots, start: self._spill(ids, slots, start, block=True)
        try:
            cache.spill_all()
        finally:
            cache.spill = None
            tier.close()
            self.tier = None

    # ---------------------------------------------------------------- request lifecycle
    def match_req(self, req: Req, tier_pages: int | None = None) -> BaseCacheHandle:
        """Longest cached prefix of the prompt, stopping before its last token (>= 1 to compute).
        A request that wants its prompt's log-probabilities matches nothing: cached positions
        have no logits, so the whole prompt is computed (and cached again). With `tier_pages`,
        the match continues into the disk tier, loading up to that many pages into the tree."""
        matchable = len(req.input_ids) - 1
        if req.sampling_params.prompt_logprobs is not None and req.output_len == 0:
            matchable = 0
        if req.pooling is not None:  # every position's hidden state is pooled: none cached
            matchable = 0
        ids = req.cache_key(matchable)
        handle = self.prefix_cache.match_prefix(ids).cuda_handle
        if self.tier is None or tier_pages is None or tier_pages <= 0:
            return handle
        located = self._tier_ids(ids)
        if located is None:
            return handle
        return self._load_from_tier(req, ids, handle, tier_pages, *located)

    def _tier_ids(self, keys: torch.Tensor) -> tuple[torch.Tensor, str | None] | None:
        """(the token ids, the fingerprint where not the tier's own) that keys of the prefix
        cache name on disk: an adapter's under its own; None for an adapter no longer served."""
        if len(keys) == 0 or int(keys[0]) >= 0:
            return keys, None
        assert self.tier is not None
        located = None if self.adapter_keys is None else self.adapter_keys.tier_key(keys)
        if located is None:
            return None
        adapter, ids = located
        blob = bytes.fromhex(self.tier.fingerprint) + bytes.fromhex(adapter)
        return ids, hashlib.blake2b(blob, digest_size=16).hexdigest()

    def _spill(
        self, keys: torch.Tensor, slots: torch.Tensor, start: int, block: bool = False
    ) -> None:
        """An evicted path's KV to the tier (an adapter's under its fingerprint)."""
        assert self.tier is not None
        located = self._tier_ids(keys)
        if located is not None:
            self.tier.save(located[0], slots, start, block=block, fingerprint=located[1])

    def _load_from_tier(
        self,
        req: Req,
        ids: torch.Tensor,
        handle: BaseCacheHandle,
        max_pages: int,
        tier_ids: torch.Tensor,
        fingerprint: str | None,
    ) -> BaseCacheHandle:
        """Extend the in-memory match with the tier's consecutive chunks that fit in
        `max_pages`: their KV copied into new pages and inserted into the tree (under `ids`,
        the cache's keys; `tier_ids` and `fingerprint` name them on disk). A chunk that turns
        out missing or invalid ends the extension there (it is recomputed)."""
        assert self.tier is not None
        tier, matched = self.tier, handle.cached_len
        first, keys = tier.lookup(tier_ids, matched, fingerprint)
        c = tier.chunk
        fits = (max_pages * self.page_size + matched) // c - first
        keys = keys[: max(0, fits)]
        if not keys:
            return handle
        end = (first + len(keys)) * c
        self.lock(handle)  # page allocation may evict: not the matched prefix
        try:
            pages = (end - matched) // self.page_size
            evictable = self.prefix_cache.size_info.evictable_size // self.page_size
            if pages > self.num_free_pages + evictable:
                return handle  # the pool cannot hold them now: computed instead
            page_slots = self._take_pages(pages)
        finally:
            self.unlock(handle)
        slots = (page_slots[:, None] + torch.arange(self.page_size, device=self.device)).flatten()
        loaded = matched
        for i, key in enumerate(keys):
            lo = (first + i) * c
            skip = max(0, matched - lo)
            if not tier.read_into(
                key,
                tier_ids[lo : lo + c],
                slots[lo + skip - matched : lo + c - matched],
                skip,
                fingerprint,
            ):
                break
            loaded = lo + c
        self._free(slots[loaded - matched :])
        if loaded == matched:
            return handle
        indices = torch.cat([handle.get_matched_indices(), slots[: loaded - matched]])
        cached_len, new = self.prefix_cache.insert_prefix(
            ids[:loaded], indices, priority=req.sampling_params.priority, count_hit=False
        )
        assert cached_len == matched, "the tree changed while the tier loaded"
        return new

    def lock(self, handle: BaseCacheHandle) -> None:
        self.prefix_cache.lock_handle(handle)

    def unlock(self, handle: BaseCacheHandle) -> None:
        self.prefix_cache.lock_handle(handle, unlock=True)

    def attach(self, req: Req, handle: BaseCacheHandle) -> None:
        """Point the request's page-table row at its (locked) cache hit."""
        cached_len = handle.cached_len
        if cached_len > 0:
            self.page_table[req.table_idx, :cached_len] = handle.get_matched_indices()
        req.cache_handle = handle
        req.cached_len = req.device_len = cached_len

    def allocate(self, reqs: list[Req], new_lens: list[int]) -> None:
        """Give each request the pages that positions [device_len, new_len) need."""
        starts = [align_up(r.device_len, self.page_size) for r in reqs]
        ends = [align_up(n, self.page_size) for n in new_lens]
        counts = [(e - s) // self.page_size for s, e in zip(starts, ends)]
        total = sum(counts)
        if total == 0:
            return
        page_slots = self._take_pages(total)
        ps = self.page_size
        # Row and column of every new token slot, all requests at once.
        rows = torch.tensor(
            [r.table_idx for r, c in zip(reqs, counts) for _ in range(c * ps)],
            dtype=torch.int64,
            device=self.device,
        )
        if total * ps <= LISTED_SLOTS:
            columns = [col for s, e in zip(starts, ends) for col in range(s, e)]
            cols = torch.tensor(columns, dtype=torch.int64, device=self.device)
        else:
            ranges = [torch.arange(s, e, device=self.device) for s, e in zip(starts, ends)]
            cols = torch.cat(ranges)
        if ps > 1:
            page_slots = (page_slots[:, None] + torch.arange(ps, device=self.device)).flatten()
        self.page_table[rows, cols] = page_slots.to(self.page_table.dtype)

    def cache_req(self, req: Req, *, finished: bool) -> None:
        """Insert the request's computed KV into the prefix cache.

        [0, old.cached_len)          was a cache hit, locked by this request;
        [old.cached_len, cached_len) someone else cached meanwhile: free ours, use theirs;
        [cached_len, new.cached_len) newly cached by this insert;
        [new.cached_len, device_len) the partial tail page: freed when finished.
        """
        assert req.cache_handle is not None
        row, kv_len = req.table_idx, req.cached_len
        indices = self.page_table[row, :kv_len]
        old = req.cache_handle
        # One hit per request, at its end: prefill inserts (chunk by chunk) would count it
        # again for every chunk and make a single use look like several (LFU, SLRU).
        cached_len, new = self.prefix_cache.insert_prefix(
            req.cache_key(kv_len),
            indices,
            priority=req.sampling_params.priority,
            count_hit=finished,
        )
        if cached_len > old.cached_len:
            self._free(self.page_table[row, old.cached_len : cached_len])
            self.page_table[row, old.cached_len : cached_len] = new.get_matched_indices()[
                old.cached_len : cached_len
            ]
        self.unlock(old)
        if finished:
            tail_start = align_down(new.cached_len, self.page_size)
            self._free(self.page_table[row, tail_start : align_up(kv_len, self.page_size)])
            req.cache_handle = None
        else:
            self.lock(new)
            req.cache_handle = new

    def rewind(self, req: Req, new_len: int) -> None:
        """Keep KV for positions [0, new_len) only (a verify step's rejected drafts): the pages
        past it go back on the free list."""
        assert req.cache_handle is not None and req.cache_handle.cached_len <= new_len
        assert new_len <= req.device_len, f"rewind to {new_len} past device_len {req.device_len}"
        start, end = align_up(new_len, self.page_size), align_up(req.device_len, self.page_size)
        self._free(self.page_table[req.table_idx, start:end])
        req.cached_len = req.device_len = new_len

    def release_uncached(self, req: Req) -> None:
        """Drop a request that never inserted anything: unlock its hit, free its own pages."""
        assert req.cache_handle is not None
        start = req.cache_handle.cached_len
        self._free(self.page_table[req.table_idx, start : align_up(req.device_len, self.page_size)])
        self.unlock(req.cache_handle)
        req.cache_handle = None

    # ---------------------------------------------------------------- pages
    def _free(self, token_slots: torch.Tensor) -> None:
        """Return the pages of a page-aligned run of token slots."""
        self._free_pages.add(token_slots[:: self.page_size])

    def _take_pages(self, count: int) -> torch.Tensor:
        if count > self.num_free_pages:
            need = (count - self.num_free_pages) * self.page_size
            evicted = self.prefix_cache.evict(min(need, self.prefix_cache.size_info.evictable_size))
            self._free_pages.add(evicted[evicted % self.page_size == 0])
        if count > self.num_free_pages:
            raise RuntimeError(f"out of KV pages: need {count}, have {self.num_free_pages}")
        return self._free_pages.take(count)
