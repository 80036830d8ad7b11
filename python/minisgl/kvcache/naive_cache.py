"""The prefix cache that caches nothing: every request computes its whole prompt."""

from __future__ import annotations

import torch

from .base import BaseCacheHandle, BasePrefixCache, InsertResult, MatchResult, SizeInfo


class NaiveCacheHandle(BaseCacheHandle):
    def __init__(self, device: torch.device) -> None:
        self.cached_len = 0
        self._empty = torch.empty(0, dtype=torch.int32, device=device)

    def get_matched_indices(self) -> torch.Tensor:
        return self._empty


class NaivePrefixCache(BasePrefixCache):
    """Matches nothing and keeps nothing; inserted pages go straight back to the caller."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.empty_tensor = torch.empty(0, dtype=torch.int32, device=device)
        self._handle = NaiveCacheHandle(device)

    def match_prefix(self, input_ids: torch.Tensor) -> MatchResult:
        return MatchResult(self._handle)

    def insert_prefix(
        self,
        input_ids: torch.Tensor,
        indices: torch.Tensor,
        priority: int = 0,
        count_hit: bool = True,
    ) -> InsertResult:
        return InsertResult(0, self._handle)

    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None:
        pass

    def evict(self, size: int) -> torch.Tensor:
        if size != 0:
            raise ValueError(f"naive cache holds nothing to evict, asked for {size}")
        return self.empty_tensor

    @property
    def size_info(self) -> SizeInfo:
        return SizeInfo(0, 0)

    def check_integrity(self) -> None:
        pass

    def reset(self) -> None:
        pass
