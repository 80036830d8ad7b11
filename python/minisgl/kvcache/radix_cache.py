"""Radix prefix cache: a compressed prefix tree of token runs and the KV slots that hold them."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch

from minisgl.core import get_global_ctx
from minisgl.utils import align_down

from .base import BaseCacheHandle, BasePrefixCache, InsertResult, MatchResult, SizeInfo
from .eviction import EvictionPolicy, make_eviction_policy
from .radix_node import KeyFn, RadixTreeNode, _clock, path_of

__all__ = ["RadixCacheHandle", "RadixPrefixCache", "RadixTreeNode", "SpillFn"]

# Told about a node whose KV leaves memory: (token ids and KV slots of the path from the root
# to the node's end, where the node starts in that path). The slots are valid during the call.
SpillFn: TypeAlias = Callable[[torch.Tensor, torch.Tensor, int], None]

# Rebuild the lazily cleaned heap once stale entries outnumber live leaves this many times over.
_HEAP_SLACK_FACTOR = 4
_HEAP_MIN_REBUILD_SIZE = 64

# A heap entry: (the policy's key when pushed, node uuid as the tie-break, node).
_HeapEntry: TypeAlias = tuple[Any, int, RadixTreeNode]


@dataclass(frozen=True)
class RadixCacheHandle(BaseCacheHandle):
    """A prefix of `cached_len` tokens ending at `node` (the path from the root to it)."""

    cached_len: int
    node: RadixTreeNode

    def get_matched_indices(self) -> torch.Tensor:
        node = self.node
        values: list[torch.Tensor] = []
        while not node.is_root():
            values.append(node.value)
            node = node.parent
        if not values:
            return node.value  # the root's empty value, on the cache's device
        values.reverse()
        return torch.cat(values)


def _make_key_fn(page_size: int) -> KeyFn:
    if page_size == 1:
        return lambda ids: int(ids[0])
    return lambda ids: tuple(ids[:page_size].tolist())


class RadixPrefixCache(BasePrefixCache):
    """Shares KV of common prefixes across requests; evicts unlocked leaves in the order of its
    eviction policy (kvcache/eviction.py; LRU by default).

    Unlocked leaves are tracked incrementally in `evictable_leaves`, so eviction costs grow with
    what is evicted rather than with the size of the tree.
    """

    def __init__(self, device: torch.device, eviction_policy: str | EvictionPolicy = "lru") -> None:
        self.device = device
        self.page_size = get_global_ctx().page_size
        self.key_fn = _make_key_fn(self.page_size)
        self.empty_tensor = torch.empty(0, dtype=torch.int32, device=device)
        self.eviction_policy = make_eviction_policy(eviction_policy)
        self._evict_key = self.eviction_policy.key
        # A lower KV tier (kvcache/disk_tier.py) that keeps what is evicted; None: nothing does.
        self.spill: SpillFn | None = None
        self.evicted_tokens = 0  # lifetime total, for /metrics
        self.reset()

    def reset(self) -> None:
        """Drop every cached prefix and start from an empty tree."""
        self.root_node = RadixTreeNode(self.key_fn)
        self.root_node.set_key_value(torch.empty(0, dtype=torch.int32), self.empty_tensor)
        # The root holds no tokens and must never look like an evictable leaf.
        self.root_node.ref_count = 1
        self.evictable_size = 0
        self.protected_size = 0
        self.evictable_leaves: set[RadixTreeNode] = set()
        # Lazily cleaned: an entry is stale once its node left `evictable_leaves`, or its key
        # changed since the push (a smaller one is re-pushed when popped, a larger one dropped).
        self._leaf_heap: list[_HeapEntry] = []
        self._num_nodes = 0

    @property
    def num_nodes(self) -> int:
        """Number of nodes in the tree, not counting the root."""
        return self._num_nodes

    def match_prefix(self, input_ids: torch.Tensor) -> MatchResult:
        node, prefix_len = self._tree_walk(input_ids)
        return MatchResult(RadixCacheHandle(prefix_len, node))

    def insert_prefix(
        self,
        input_ids: torch.Tensor,
        indices: torch.Tensor,
        priority: int = 0,
        count_hit: bool = True,
    ) -> InsertResult:
        """Cache the whole pages of `input_ids`; `cached_len` is what was cached beforehand.
        Every node on the path takes at least `priority`, and one hit if `count_hit`."""
        insert_len = align_down(len(input_ids), self.page_size)
        input_ids, indices = input_ids[:insert_len], indices[:insert_len]
        node, prefix_len = self._tree_walk(input_ids, priority, count_hit)
        if prefix_len != insert_len:
            new_node = RadixTreeNode(self.key_fn)
            new_node.set_key_value(input_ids[prefix_len:], indices[prefix_len:].clone())
            new_node.set_parent(node)
            new_node.hit_count, new_node.priority = int(count_hit), priority
            self._num_nodes += 1
            self.evictable_size += new_node.length
            self.evictable_leaves.discard(node)  # it has a child now
            self._add_evictable_leaf(new_node)
            node = new_node
        return InsertResult(prefix_len, RadixCacheHandle(insert_len, node))

    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None:
        """Pin (or unpin) every node on the path from the handle's node to the root."""
        assert isinstance(handle, RadixCacheHandle)
        node = handle.node
        while not node.is_root():
            if unlock:
                node.ref_count -= 1
                assert node.ref_count >= 0
                if node.ref_count == 0:
                    self.evictable_size += node.length
                    self.protected_size -= node.length
                    if node.is_leaf():
                        self._add_evictable_leaf(node)
            else:
                if node.ref_count == 0:
                    self.evictable_size -= node.length
                    self.protected_size += node.length
                    self.evictable_leaves.discard(node)
                node.ref_count += 1
            node = node.parent

    def evict(self, size: int) -> torch.Tensor:
        """Free at least `size` tokens by dropping unlocked leaves, smallest policy key first."""
        if size == 0:
            return self.empty_tensor
        assert size <= self.evictable_size, f"Cannot evict {size}, only {self.evictable_size}"
        heap, evict_key = self._leaf_heap, self._evict_key
        evicted: list[torch.Tensor] = []
        evicted_size = 0
        while evicted_size < size:
            assert heap, f"Cannot evict enough cache: need {size}, got {evicted_size}"
            pushed_key, _, node = heapq.heappop(heap)
            if node not in self.evictable_leaves:
                continue  # locked, grew a child, or already evicted since the push
            key = evict_key(node)
            if pushed_key != key:
                # Touched since the push. Every evictable leaf has an entry no larger than its
                # key: a smaller stale one is re-filed now, a larger one has a newer twin.
                if pushed_key < key:
                    heapq.heappush(heap, (key, node.uuid, node))
                continue
            evicted_size += node.length
            evicted.append(node.value)
            if self.spill is not None:
                self._spill(node)
            self._remove_leaf(node)
            heap = self._leaf_heap  # _remove_leaf may have rebuilt it
        self.evicted_tokens += evicted_size
        return torch.cat(evicted)

    def spill_all(self) -> None:
        """Offer every node to `spill` (parents first), as if all were evicted; nothing changes."""
        if self.spill is None:
            return
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            self._spill(node)
            stack.extend(node.children.values())

    def _spill(self, node: RadixTreeNode) -> None:
        assert self.spill is not None
        ids, slots = path_of(node)
        self.spill(ids, slots, len(ids) - node.length)

    @property
    def size_info(self) -> SizeInfo:
        return SizeInfo(evictable_size=self.evictable_size, protected_size=self.protected_size)

    def check_integrity(self) -> None:
        """Re-walk the tree and check the counters and the evictable-leaf set against it."""
        evictable = protected = num_nodes = 0
        unlocked_leaves: set[RadixTreeNode] = set()
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            num_nodes += 1
            assert node.ref_count >= 0
            assert node.length > 0 and node.length % self.page_size == 0, "unaligned node"
            assert len(node.value) == node.length
            for key, child in node.children.items():
                assert child.parent is node and key == self.key_fn(child._key), "bad child link"
                assert child.ref_count <= node.ref_count, "child locked more than its parent"
                stack.append(child)
            if node.ref_count == 0:
                evictable += node.length
                if node.is_leaf():
                    unlocked_leaves.add(node)
            else:
                protected += node.length
        assert (evictable, protected) == (self.evictable_size, self.protected_size), (
            f"size mismatch: tree=({evictable}, {protected}), "
            f"counter=({self.evictable_size}, {self.protected_size})"
        )
        assert num_nodes == self._num_nodes, f"node count: tree={num_nodes}, {self._num_nodes}"
        assert unlocked_leaves == self.evictable_leaves, (
            f"evictable leaf set mismatch: {len(unlocked_leaves)} unlocked leaves in the tree, "
            f"{len(self.evictable_leaves)} tracked"
        )
        # Every evictable leaf needs a heap entry no larger than its key, or evict misses it.
        smallest_entry: dict[RadixTreeNode, Any] = {}
        for pushed_key, _, node in self._leaf_heap:
            if node not in smallest_entry or pushed_key < smallest_entry[node]:
                smallest_entry[node] = pushed_key
        for node in self.evictable_leaves:
            assert node in smallest_entry and smallest_entry[node] <= self._evict_key(node), (
                "evictable leaf missing from the heap"
            )

    def _tree_walk(
        self, input_ids: torch.Tensor, priority: int | None = None, count_hit: bool = False
    ) -> tuple[RadixTreeNode, int]:
        """Follow `input_ids` down the tree, touching each node passed; an insert also raises
        their priority to `priority` and counts a hit on them if `count_hit`."""
        prefix_len, total = 0, len(input_ids)
        node = self.root_node
        tic = _clock()
        while prefix_len < total:
            child = node.children.get(self.key_fn(input_ids[prefix_len:]))
            if child is None:
                return node, prefix_len
            node = child
            # Entering the child means its first page matched; page-align the full match.
            match_len = align_down(node.get_match_len(input_ids[prefix_len:]), self.page_size)
            prefix_len += match_len
            if match_len != node.length:
                # Split so the returned node ends exactly where the match ends; the tail keeps
                # its old statistics and its leaf status, the head is internal.
                node = node.split_at(match_len)
                self._num_nodes += 1
                self._touch(node, tic, priority, count_hit)
                return node, prefix_len
            self._touch(node, tic, priority, count_hit)
        return node, prefix_len

    def _touch(self, node: RadixTreeNode, tic: int, priority: int | None, count_hit: bool) -> None:
        # A touched evictable leaf keeps its heap entry if its key can only have grown (evict
        # re-files it lazily); a policy whose keys shrink on access needs it re-filed now.
        refile = not self.eviction_policy.keys_only_grow and node in self.evictable_leaves
        node.timestamp = tic
        if count_hit:
            node.hit_count += 1
        if priority is not None and priority > node.priority:
            node.priority = priority
        if refile:
            self._push(node)

    def _add_evictable_leaf(self, node: RadixTreeNode) -> None:
        self.evictable_leaves.add(node)
        self._push(node)

    def _push(self, node: RadixTreeNode) -> None:
        heapq.heappush(self._leaf_heap, (self._evict_key(node), node.uuid, node))
        live = len(self.evictable_leaves)
        if len(self._leaf_heap) > _HEAP_SLACK_FACTOR * live + _HEAP_MIN_REBUILD_SIZE:
            key = self._evict_key
            self._leaf_heap = [(key(n), n.uuid, n) for n in self.evictable_leaves]
            heapq.heapify(self._leaf_heap)

    def _remove_leaf(self, node: RadixTreeNode) -> None:
        """Detach an evictable leaf; its parent joins the evictable leaves if it becomes one."""
        self.evictable_leaves.remove(node)
        self.evictable_size -= node.length
        self._num_nodes -= 1
        parent = node.parent
        del parent.children[self.key_fn(node._key)]
        if parent.ref_count == 0 and parent.is_leaf() and not parent.is_root():
            self._add_evictable_leaf(parent)
