"""Eviction policies of the radix cache: which unlocked leaf goes first (SGLang's names).

A policy maps a node's statistics to a sort key; the cache evicts the unlocked leaf with the
smallest key. Keys must totally order the leaves together with the node's uuid (the cache's
tie-break), and a key may change only when the cache touches the node (a match or an insert
walking through it), so the cache knows when to re-file it in its heap.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

from minisgl.utils import Registry


class NodeStats(Protocol):
    """What a policy may read of a radix node."""

    # Clock of the node's last access (match or insert through it); strictly increasing.
    timestamp: int
    # Clock of when its KV entered the cache (a split's head keeps the original's).
    creation_time: int
    # Counted inserts that walked through the node: about one per finished request using it.
    hit_count: int
    # The highest priority of the requests that inserted through it (larger = keep longer).
    priority: int


class EvictionPolicy(ABC):
    """Orders unlocked leaves for eviction: the smallest `key` is evicted first."""

    name: ClassVar[str]
    # Whether a node's key only ever grows when it is touched. Then the cache's heap may keep a
    # touched leaf's older, smaller entry and re-file it lazily; otherwise it re-files at once.
    keys_only_grow: ClassVar[bool] = True

    @abstractmethod
    def key(self, node: NodeStats) -> Any:
        """The node's eviction key: smaller is evicted first."""


EVICTION_POLICIES: Registry[Callable[[], EvictionPolicy]] = Registry("radix_eviction_policy")


@EVICTION_POLICIES.register("lru")
class LRUPolicy(EvictionPolicy):
    """Least recently used first (the default)."""

    name = "lru"

    def key(self, node: NodeStats) -> int:
        return node.timestamp


@EVICTION_POLICIES.register("lfu")
class LFUPolicy(EvictionPolicy):
    """Least frequently used first; equal counts least recently used first."""

    name = "lfu"

    def key(self, node: NodeStats) -> tuple[int, int]:
        return node.hit_count, node.timestamp


@EVICTION_POLICIES.register("fifo")
class FIFOPolicy(EvictionPolicy):
    """Oldest cached first, however often it is used."""

    name = "fifo"

    def key(self, node: NodeStats) -> int:
        return node.creation_time


@EVICTION_POLICIES.register("mru")
class MRUPolicy(EvictionPolicy):
    """Most recently used first (scans that never come back)."""

    name = "mru"
    keys_only_grow = False  # an access makes the key smaller

    def key(self, node: NodeStats) -> int:
        return -node.timestamp


@EVICTION_POLICIES.register("filo")
class FILOPolicy(EvictionPolicy):
    """Newest cached first: the oldest prefixes stay."""

    name = "filo"

    def key(self, node: NodeStats) -> int:
        return -node.creation_time


@EVICTION_POLICIES.register("priority")
class PriorityPolicy(EvictionPolicy):
    """Lowest request priority first; equal priorities least recently used first."""

    name = "priority"

    def key(self, node: NodeStats) -> tuple[int, int]:
        return node.priority, node.timestamp


@EVICTION_POLICIES.register("slru")
class SLRUPolicy(EvictionPolicy):
    """Segmented LRU: nodes hit fewer than `protected_threshold` times (probationary) go before
    the others (protected), least recently used first within each segment."""

    name = "slru"

    def __init__(self, protected_threshold: int = 2) -> None:
        if protected_threshold < 1:
            raise ValueError(f"protected_threshold must be >= 1, got {protected_threshold}")
        self.protected_threshold = protected_threshold

    def key(self, node: NodeStats) -> tuple[int, int]:
        return int(node.hit_count >= self.protected_threshold), node.timestamp


def make_eviction_policy(policy: str | EvictionPolicy) -> EvictionPolicy:
    """A policy by name (EVICTION_POLICIES), or the given instance."""
    return policy if isinstance(policy, EvictionPolicy) else EVICTION_POLICIES[policy]()
