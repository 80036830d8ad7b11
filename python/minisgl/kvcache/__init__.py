"""KV pool and prefix caches, with a registry of prefix-cache types."""

from __future__ import annotations

from collections.abc import Callable

import torch

from minisgl.utils import Registry

from .base import (
    BaseCacheHandle,
    BaseKVCache,
    BasePrefixCache,
    InsertResult,
    MatchResult,
    SizeInfo,
)
from .disk_tier import DiskKVTier, TierStats
from .eviction import EVICTION_POLICIES, EvictionPolicy, make_eviction_policy
from .mha_pool import MHAKVCache
from .naive_cache import NaivePrefixCache
from .page_hash import chunk_keys, chunk_tokens, model_fingerprint
from .radix_cache import RadixPrefixCache

# Factories of (device, eviction policy name); a cache that evicts nothing ignores the policy.
PREFIX_CACHES: Registry[Callable[[torch.device, str], BasePrefixCache]] = Registry("cache_type")
PREFIX_CACHES.register("naive")(lambda device, _policy: NaivePrefixCache(device))
PREFIX_CACHES.register("radix")(RadixPrefixCache)


def create_prefix_cache(
    cache_type: str, device: torch.device, eviction_policy: str = "lru"
) -> BasePrefixCache:
    """A prefix cache by type name; `eviction_policy` names an EVICTION_POLICIES entry."""
    make_eviction_policy(eviction_policy)  # an unknown name raises, whatever the cache type
    return PREFIX_CACHES[cache_type](device, eviction_policy)


__all__ = [
    "EVICTION_POLICIES",
    "PREFIX_CACHES",
    "BaseCacheHandle",
    "BaseKVCache",
    "BasePrefixCache",
    "DiskKVTier",
    "EvictionPolicy",
    "InsertResult",
    "MHAKVCache",
    "MatchResult",
    "NaivePrefixCache",
    "RadixPrefixCache",
    "SizeInfo",
    "TierStats",
    "chunk_keys",
    "chunk_tokens",
    "create_prefix_cache",
    "make_eviction_policy",
    "model_fingerprint",
]
