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
from .mha_pool import MHAKVCache
from .naive_cache import NaivePrefixCache
from .radix_cache import RadixPrefixCache

PREFIX_CACHES: Registry[Callable[[torch.device], BasePrefixCache]] = Registry("cache_type")
PREFIX_CACHES.register("naive")(NaivePrefixCache)
PREFIX_CACHES.register("radix")(RadixPrefixCache)


def create_prefix_cache(cache_type: str, device: torch.device) -> BasePrefixCache:
    return PREFIX_CACHES[cache_type](device)


__all__ = [
    "PREFIX_CACHES",
    "BaseCacheHandle",
    "BaseKVCache",
    "BasePrefixCache",
    "InsertResult",
    "MHAKVCache",
    "MatchResult",
    "NaivePrefixCache",
    "RadixPrefixCache",
    "SizeInfo",
    "create_prefix_cache",
]
