"""Eviction policies of the radix cache against a reference model (no model involved).

The reference keeps, per cached page, the statistics SGLang's policies read (last access,
creation, hit count, priority) on its own logical clock, and orders evictions by its own copy
of each policy's definition; the cache must free exactly those slots, in that order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minisgl.core import Context, reset_global_ctx, set_global_ctx
from minisgl.kvcache import EVICTION_POLICIES, create_prefix_cache, radix_cache
from minisgl.kvcache.radix_cache import RadixCacheHandle, RadixPrefixCache, RadixTreeNode


@dataclass
class _Stats:
    last: int  # logical time of the last match / insert through the page
    created: int  # logical time of the insert that cached it
    hits: int  # counted inserts through it
    prio: int  # highest priority of the inserts through it


# SGLang's definitions (mem_cache/evict_policy.py), written out again: smaller goes first.
REFERENCE_KEYS: dict[str, Callable[[_Stats], Any]] = {
    "lru": lambda s: s.last,
    "lfu": lambda s: (s.hits, s.last),
    "fifo": lambda s: s.created,
    "mru": lambda s: -s.last,
    "filo": lambda s: -s.created,
    "priority": lambda s: (s.prio, s.last),
    "slru": lambda s: (s.hits >= 2, s.last),
}
POLICIES = sorted(REFERENCE_KEYS)


def t(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int32)


def _cache(policy: str, page_size: int = 1) -> RadixPrefixCache:
    set_global_ctx(Context(page_size=page_size))
    cache = create_prefix_cache("radix", torch.device("cpu"), policy)
    assert isinstance(cache, RadixPrefixCache)
    return cache


@pytest.fixture(autouse=True)
def _clean_global_ctx() -> Iterator[None]:
    yield
    reset_global_ctx()


def test_registry_has_sglangs_policies() -> None:
    assert EVICTION_POLICIES.names() == POLICIES
    with pytest.raises(ValueError, match="radix_eviction_policy 'lfru'"):
        _cache("lfru")


class _Reference:
    """What the cache should hold, page by page, and each page's statistics."""

    def __init__(self, page_size: int, policy: str) -> None:
        self.page_size = page_size
        self.key = REFERENCE_KEYS[policy]
        self.cached: dict[tuple[int, ...], tuple[int, ...]] = {}  # prefix -> its last page's slots
        self.stats: dict[tuple[int, ...], _Stats] = {}
        self.locked: list[tuple[RadixCacheHandle, tuple[int, ...]]] = []
        self.next_slot = 0
        self.clock = 0

    def pages(self, seq: list[int], start: int, end: int) -> Iterator[tuple[int, ...]]:
        for page_end in range(start + self.page_size, end + 1, self.page_size):
            yield tuple(seq[:page_end])

    def match_len(self, seq: list[int]) -> int:
        length, page = 0, self.page_size
        while length + page <= len(seq) and tuple(seq[: length + page]) in self.cached:
            length += page
        return length

    def indices_of(self, seq: list[int], length: int) -> list[int]:
        return [s for prefix in self.pages(seq, 0, length) for s in self.cached[prefix]]

    def match(self, seq: list[int]) -> int:
        length = self.match_len(seq)
        self.clock += 1
        for prefix in self.pages(seq, 0, length):
            self.stats[prefix].last = self.clock
        return length

    def insert(self, seq: list[int], priority: int, count_hit: bool) -> tuple[int, list[int]]:
        """(cached_len expected, the slots handed in); the walk, then the new suffix's node."""
        insert_len = len(seq) - len(seq) % self.page_size
        cached_len = self.match_len(seq[:insert_len])
        slots = list(range(self.next_slot, self.next_slot + len(seq)))
        self.next_slot += len(seq)
        self.clock += 1
        for prefix in self.pages(seq, 0, cached_len):
            stats = self.stats[prefix]
            stats.last, stats.hits = self.clock, stats.hits + count_hit
            stats.prio = max(stats.prio, priority)
        self.clock += 1
        for prefix in self.pages(seq, cached_len, insert_len):
            self.cached[prefix] = tuple(slots[len(prefix) - self.page_size : len(prefix)])
            self.stats[prefix] = _Stats(self.clock, self.clock, int(count_hit), priority)
        return cached_len, slots

    def protected_prefixes(self) -> set[tuple[int, ...]]:
        return {p for _, prefix in self.locked for p in self.pages(list(prefix), 0, len(prefix))}

    def node_stats(self, cache: RadixPrefixCache) -> dict[RadixTreeNode, _Stats]:
        """Each node's statistics in the reference: the same for every page of the node."""
        out: dict[RadixTreeNode, _Stats] = {}
        stack: list[tuple[RadixTreeNode, tuple[int, ...]]] = [
            (child, ()) for child in cache.root_node.children.values()
        ]
        while stack:
            node, prefix = stack.pop()
            tokens = node._key.tolist()
            per_page = []
            for start in range(0, len(tokens), self.page_size):
                prefix = prefix + tuple(tokens[start : start + self.page_size])
                per_page.append(self.stats[prefix])
            assert all(s == per_page[0] for s in per_page), "a node's pages disagree"
            out[node] = per_page[0]
            stack.extend((child, prefix) for child in node.children.values())
        return out

    def expected_eviction(self, cache: RadixPrefixCache, size: int) -> list[int]:
        """Slots freed by taking the unlocked leaf of smallest reference key, one at a time."""
        stats = self.node_stats(cache)
        children = {node: len(node.children) for node in stats}
        leaves = {n for n in stats if children[n] == 0 and n.ref_count == 0}
        freed: list[int] = []
        while len(freed) < size:
            keys = sorted((self.key(stats[n]), n.uuid) for n in leaves)
            assert len(keys) < 2 or keys[0][0] != keys[1][0], "two leaves tie"
            node = next(n for n in leaves if n.uuid == keys[0][1])
            leaves.remove(node)
            freed += node.value.tolist()
            parent = node.parent
            if not parent.is_root():
                children[parent] -= 1
                if children[parent] == 0 and parent.ref_count == 0:
                    leaves.add(parent)
        return freed

    def check(self, cache: RadixPrefixCache) -> None:
        cache.check_integrity()
        stats = self.node_stats(cache)
        assert len(self.cached) * self.page_size == cache.size_info.total_size
        protected = len(self.protected_prefixes()) * self.page_size
        assert cache.size_info == (len(self.cached) * self.page_size - protected, protected)
        for node, s in stats.items():
            assert (node.hit_count, node.priority) == (s.hits, s.prio)
        # The cache's clock orders nodes as the reference's logical one does.
        for field, attr in (("last", "timestamp"), ("created", "creation_time")):
            pairs = sorted({(getattr(s, field), getattr(n, attr)) for n, s in stats.items()})
            assert [v for _, v in pairs] == sorted(v for _, v in pairs)
            assert len({r for r, _ in pairs}) == len({v for _, v in pairs}) == len(pairs)


def _sequences(page_size: int) -> st.SearchStrategy[list[int]]:
    page = st.sampled_from([(0,) * page_size, (1,) * page_size, (0,) * (page_size - 1) + (2,)])
    tail = st.lists(st.integers(0, 2), max_size=page_size - 1)
    pages = st.lists(page, max_size=6 if page_size == 1 else 4)
    return st.builds(lambda ps, tl: [x for p in ps for x in p] + tl, pages, tail)


def _operations(page_size: int) -> st.SearchStrategy[list[tuple]]:
    seqs = _sequences(page_size)
    op = st.one_of(
        st.tuples(st.just("insert"), seqs, st.booleans(), st.integers(-1, 2), st.booleans()),
        st.tuples(st.just("match"), seqs, st.booleans()),
        st.tuples(st.just("unlock"), st.integers(0, 1000)),
        st.tuples(st.just("evict"), st.integers(0, 100)),
    )
    return st.lists(op, max_size=40)


def _run(policy: str, page_size: int, ops: list[tuple]) -> None:
    cache = _cache(policy, page_size)
    ref = _Reference(page_size, policy)
    for op in ops:
        if op[0] == "insert":
            _, seq, lock, priority, count_hit = op
            cached_len, slots = ref.insert(seq, priority, count_hit)
            ids = torch.tensor(seq, dtype=torch.int32)
            result = cache.insert_prefix(ids, t(*slots), priority=priority, count_hit=count_hit)
            assert result.cached_len == cached_len
            handle, length = result.handle, result.handle.cached_len
        elif op[0] == "match":
            _, seq, lock = op
            length = ref.match(seq)
            handle = cache.match_prefix(torch.tensor(seq, dtype=torch.int32)).cuda_handle
            assert handle.cached_len == length
        elif op[0] == "unlock":
            lock = False
            if ref.locked:
                unlocked, _ = ref.locked.pop(op[1] % len(ref.locked))
                cache.lock_handle(unlocked, unlock=True)
        else:
            lock = False
            size = cache.evictable_size * op[1] // 100
            expected = ref.expected_eviction(cache, size)
            protected = {s for p in ref.protected_prefixes() for s in ref.cached[p]}
            freed = cache.evict(size).tolist()
            assert freed == expected
            assert not set(freed) & protected, "evicted a locked token"
            ref.cached = {p: s for p, s in ref.cached.items() if not set(freed) & set(s)}
        if op[0] in ("insert", "match"):
            assert handle.get_matched_indices().tolist() == ref.indices_of(seq, length)
            if lock:
                assert isinstance(handle, RadixCacheHandle)
                cache.lock_handle(handle)
                ref.locked.append((handle, tuple(seq[:length])))
        ref.check(cache)
    for handle, _ in ref.locked:
        cache.lock_handle(handle, unlock=True)
    ref.locked.clear()
    expected = ref.expected_eviction(cache, cache.evictable_size)
    assert cache.evict(cache.evictable_size).tolist() == expected
    assert cache.size_info == (0, 0) and cache.num_nodes == 0
    cache.check_integrity()


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("policy", POLICIES)
def test_random_operations_follow_the_policy(
    policy: str, page_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A zero floor makes the stale-entry heap rebuild fire even on the small trees drawn here.
    monkeypatch.setattr(radix_cache, "_HEAP_MIN_REBUILD_SIZE", 0)

    @settings(
        max_examples=120,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(ops=_operations(page_size))
    def run(ops: list[tuple]) -> None:
        try:
            _run(policy, page_size, ops)
        finally:
            reset_global_ctx()

    run()


# Three leaves A, B, C (priorities 0, 2, 1) cached in that order; then A is inserted again (a
# second hit) and B matched (touched, no hit): each policy's order of the three.
EXPECTED_ORDER = {
    "lru": "CAB",  # last access C < A < B
    "lfu": "CBA",  # hits C = B = 1 < A = 2; C is the older of the two
    "fifo": "ABC",
    "mru": "BAC",
    "filo": "CBA",
    "priority": "ACB",
    "slru": "CBA",  # A is protected (2 hits); C, B probationary, older first
}


@pytest.mark.parametrize("policy", POLICIES)
def test_each_policy_orders_three_leaves(policy: str) -> None:
    cache = _cache(policy)
    leaves = {
        "A": (t(1, 2), t(10, 11), 0),
        "B": (t(3, 4), t(20, 21), 2),
        "C": (t(5, 6), t(30, 31), 1),
    }
    for ids, slots, priority in leaves.values():
        cache.insert_prefix(ids, slots, priority=priority)
    cache.insert_prefix(t(1, 2), t(90, 91))
    assert cache.match_prefix(t(3, 4)).cuda_handle.cached_len == 2
    order = [cache.evict(1).tolist() for _ in range(3)]
    assert order == [leaves[name][1].tolist() for name in EXPECTED_ORDER[policy]]
    cache.check_integrity()


@pytest.mark.parametrize("policy", POLICIES)
def test_locked_leaves_and_the_root_are_never_evicted(policy: str) -> None:
    cache = _cache(policy)
    locked = cache.insert_prefix(t(1, 2, 3), t(10, 11, 12), priority=-5).handle
    cache.lock_handle(locked)
    cache.insert_prefix(t(1, 2, 4), t(0, 0, 13), priority=7)
    cache.insert_prefix(t(5), t(50))
    assert sorted(cache.evict(2).tolist()) == [13, 50]
    assert cache.size_info == (0, 3) and not cache.evictable_leaves
    with pytest.raises(AssertionError):
        cache.evict(1)
    cache.lock_handle(locked, unlock=True)
    assert cache.evict(3).tolist() == [12, 10, 11]  # the leaf, then its parent ([1, 2])
    assert cache.num_nodes == 0 and cache.root_node.is_root()
    cache.check_integrity()


class _CountingHeapq:
    """radix_cache's heapq, counting pops."""

    def __init__(self) -> None:
        import heapq

        self._heapq, self.pops = heapq, 0

    def heappop(self, heap: list) -> Any:
        self.pops += 1
        return self._heapq.heappop(heap)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._heapq, name)


@pytest.mark.parametrize("policy", POLICIES)
def test_eviction_cost_grows_with_what_is_evicted(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1000 leaves, 50 of them touched again: 20 single evictions pop O(evicted + touched)
    heap entries, not O(leaves)."""
    cache = _cache(policy)
    for i in range(1000):
        cache.insert_prefix(t(i), t(i), priority=i % 3)
    for i in range(0, 1000, 20):
        cache.insert_prefix(t(i), t(i))  # a second hit: LFU / SLRU keys change too
    counting = _CountingHeapq()
    monkeypatch.setattr(radix_cache, "heapq", counting)
    for _ in range(20):
        assert len(cache.evict(1)) == 1
    assert counting.pops <= 20 + 50
    cache.check_integrity()


def test_mru_touch_churn_keeps_heap_bounded() -> None:
    """MRU re-files a leaf at every touch (its key shrinks); stale entries are rebuilt away."""
    cache = _cache("mru")
    for i in range(4):
        cache.insert_prefix(t(i), t(i))
    for _ in range(500):
        for i in range(4):
            cache.match_prefix(t(i))
    assert len(cache._leaf_heap) <= 4 * len(cache.evictable_leaves) + 64
    assert cache.evict(4).tolist() == [3, 2, 1, 0]
    cache.check_integrity()
