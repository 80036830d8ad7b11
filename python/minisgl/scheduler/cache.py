"""CacheManager: KV page allocation, prefix-cache matching and the per-request cache lifecycle."""

from __future__ import annotations

import torch

from minisgl.core import Req
from minisgl.kvcache import BaseCacheHandle, BasePrefixCache
from minisgl.utils import align_down, align_up, div_ceil


class CacheManager:
    """Owns the free page list and the prefix cache; keeps free + cached == all pages."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        page_table: torch.Tensor,
        prefix_cache: BasePrefixCache,
    ) -> None:
        self.num_pages, self.page_size = num_pages, page_size
        self.page_table = page_table
        self.device = page_table.device
        self.prefix_cache = prefix_cache
        # Page-aligned first slot of each free page, handed out lowest first.
        self._free_slots = (
            torch.arange(num_pages, dtype=torch.int32, device=self.device) * page_size
        )
        self._free_sorted = True

    # ---------------------------------------------------------------- accounting
    @property
    def num_free_pages(self) -> int:
        return len(self._free_slots)

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
        assert len(torch.unique(self._free_slots)) == free, "a page is on the free list twice"

    def flush(self) -> int:
        """Empty the prefix cache, its pages back on the free list; returns how many. Only
        while no request holds pages (a locked prefix is a RuntimeError, nothing changed)."""
        size = self.prefix_cache.size_info
        if size.protected_size:
            raise RuntimeError(f"{size.protected_size} cached tokens are in use by requests")
        evicted = self.prefix_cache.evict(size.evictable_size)
        page_starts = evicted[evicted % self.page_size == 0]
        self._free_slots = torch.cat([self._free_slots, page_starts.to(self._free_slots)])
        self._free_sorted = False
        self.prefix_cache.reset()
        self.check_integrity()
        return len(page_starts)

    # ---------------------------------------------------------------- request lifecycle
    def match_req(self, req: Req) -> BaseCacheHandle:
        """Longest cached prefix of the prompt, stopping before its last token (>= 1 to compute).
        A request that wants its prompt's log-probabilities matches nothing: cached positions
        have no logits, so the whole prompt is computed (and cached again)."""
        matchable = len(req.input_ids) - 1
        if req.sampling_params.prompt_logprobs is not None and req.output_len == 0:
            matchable = 0
        return self.prefix_cache.match_prefix(req.input_ids[:matchable]).cuda_handle

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
        cols = torch.cat([torch.arange(s, e, device=self.device) for s, e in zip(starts, ends)])
        slots = (page_slots[:, None] + torch.arange(ps, device=self.device)).flatten()
        self.page_table[rows, cols] = slots.to(self.page_table.dtype)

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
            req.input_ids[:kv_len],
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
        if len(token_slots) == 0:
            return
        self._free_slots = torch.cat([self._free_slots, token_slots[:: self.page_size]])
        self._free_sorted = False

    def _take_pages(self, count: int) -> torch.Tensor:
        if count > self.num_free_pages:
            need = (count - self.num_free_pages) * self.page_size
            evicted = self.prefix_cache.evict(min(need, self.prefix_cache.size_info.evictable_size))
            page_starts = evicted[evicted % self.page_size == 0]
            self._free_slots = torch.cat([self._free_slots, page_starts.to(self._free_slots)])
            self._free_sorted = False
        if count > self.num_free_pages:
            raise RuntimeError(f"out of KV pages: need {count}, have {self.num_free_pages}")
        if not self._free_sorted:
            # Lowest slots first: pages freed together come back as runs, so a prompt's KV stays
            # contiguous and decode attention streams it (scattered slots read ~1.5x slower).
            self._free_slots = self._free_slots.sort().values
            self._free_sorted = True
        taken, self._free_slots = self._free_slots[:count], self._free_slots[count:]
        return taken
