"""Interfaces of the KV pool and of prefix caches."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch


class BaseKVCache(ABC):
    """Per-layer K and V buffers of `num_pages * page_size` token slots."""

    @abstractmethod
    def k_cache(self, layer_id: int) -> torch.Tensor: ...

    @abstractmethod
    def v_cache(self, layer_id: int) -> torch.Tensor: ...

    @abstractmethod
    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor, layer_id: int
    ) -> None: ...

    @property
    @abstractmethod
    def num_layers(self) -> int: ...


class BaseCacheHandle(ABC):
    """A matched (or inserted) prefix: its length and the KV slots that hold it."""

    cached_len: int

    @abstractmethod
    def get_matched_indices(self) -> torch.Tensor: ...


class SizeInfo(NamedTuple):
    evictable_size: int
    protected_size: int

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size


class MatchResult(NamedTuple):
    """The longest cached prefix of the query, as a handle (`handle, = cache.match_prefix(ids)`)."""

    cuda_handle: BaseCacheHandle


class InsertResult(NamedTuple):
    """`cached_len`: how much of the inserted prefix was already cached before this insert.

    Unpacks as `cached_len, handle = cache.insert_prefix(ids, indices)`.
    """

    cached_len: int
    handle: BaseCacheHandle


class BasePrefixCache(ABC):
    """Remembers the KV slots of token prefixes so later requests can reuse them."""

    @abstractmethod
    def match_prefix(self, input_ids: torch.Tensor) -> MatchResult: ...

    @abstractmethod
    def insert_prefix(
        self,
        input_ids: torch.Tensor,
        indices: torch.Tensor,
        priority: int = 0,
        count_hit: bool = True,
    ) -> InsertResult:
        """Cache `input_ids` whose KV sits at `indices`. `priority`: the inserting request's
        (larger = keep longer); `count_hit`: count this insert as a use of the prefix."""

    @abstractmethod
    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None: ...

    @abstractmethod
    def evict(self, size: int) -> torch.Tensor:
        """Free at least `size` unlocked tokens (whole nodes); return their slot indices."""

    @property
    @abstractmethod
    def size_info(self) -> SizeInfo: ...

    @abstractmethod
    def check_integrity(self) -> None: ...

    @abstractmethod
    def reset(self) -> None: ...
