"""Radix tree nodes: a run of tokens, the KV slots holding them, and eviction statistics."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeAlias

import torch

from minisgl.kernel.torch_ops import fast_compare_key

KeyFn: TypeAlias = Callable[[torch.Tensor], Any]


_last_tick = 0


def _clock() -> int:
    """time.monotonic_ns(), made strictly increasing: two accesses never tie, so the eviction
    order is the order of the calls (two reads of the clock can return the same value)."""
    global _last_tick
    _last_tick = max(time.monotonic_ns(), _last_tick + 1)
    return _last_tick


class RadixTreeNode:
    """A run of tokens (`_key`) with the KV slots holding them (`value`); children by first page."""

    counter: int = 0

    def __init__(self, key_fn: KeyFn, tic: int | None = None) -> None:
        self.key_fn = key_fn
        self.children: dict[Any, RadixTreeNode] = {}
        self._parent: RadixTreeNode | None = None
        self.ref_count = 0
        self.uuid = RadixTreeNode.counter
        RadixTreeNode.counter += 1
        self.timestamp = tic or _clock()
        # Statistics the eviction policies read (kvcache/eviction.py, NodeStats).
        self.creation_time = self.timestamp
        self.hit_count = 0
        self.priority = 0
        self._key: torch.Tensor
        self._value: torch.Tensor
        self._length: int

    def set_key_value(self, key: torch.Tensor, value: torch.Tensor) -> None:
        assert len(key) == len(value)
        self._key, self._value, self._length = key, value, len(key)

    def set_parent(self, parent: RadixTreeNode) -> None:
        self._parent = parent
        parent.children[self.key_fn(self._key)] = self

    @property
    def length(self) -> int:
        return self._length

    @property
    def parent(self) -> RadixTreeNode:
        assert self._parent is not None
        return self._parent

    @property
    def value(self) -> torch.Tensor:
        return self._value

    def is_root(self) -> bool:
        return self._parent is None

    def is_leaf(self) -> bool:
        return len(self.children) == 0

    def get_match_len(self, input_ids: torch.Tensor) -> int:
        return fast_compare_key(self._key, input_ids)

    def split_at(self, pos: int) -> RadixTreeNode:
        """Split this node at `pos`; the new head becomes this node's parent and is returned."""
        assert 0 < pos < self.length
        parent = self.parent
        new_node = RadixTreeNode(self.key_fn, self.timestamp)
        new_node.set_key_value(self._key[:pos], self._value[:pos])
        # Same first page as this node, so it takes over this node's slot in parent.children.
        new_node.set_parent(parent)
        new_node.ref_count = self.ref_count
        # The head's KV was cached, used and wanted exactly as the whole node's was.
        new_node.creation_time = self.creation_time
        new_node.hit_count, new_node.priority = self.hit_count, self.priority
        self.set_key_value(self._key[pos:], self._value[pos:])
        self.set_parent(new_node)
        return new_node

    def __lt__(self, other: RadixTreeNode) -> bool:
        # Least recently used first; uuid keeps equal timestamps in a deterministic order.
        return (self.timestamp, self.uuid) < (other.timestamp, other.uuid)


def path_of(node: RadixTreeNode) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, KV slots) of the path from the root to the end of `node`."""
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    while not node.is_root():
        keys.append(node._key)
        values.append(node.value)
        node = node.parent
    if not keys:
        return torch.empty(0, dtype=torch.int32), node.value
    return torch.cat(keys[::-1]), torch.cat(values[::-1])
