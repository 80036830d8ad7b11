"""Data-structure tests of the radix prefix cache (no model involved)."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minisgl.core import Context, reset_global_ctx, set_global_ctx
from minisgl.kernel.torch_ops import fast_compare_key
from minisgl.kvcache import radix_cache
from minisgl.kvcache.radix_cache import RadixCacheHandle, RadixPrefixCache, RadixTreeNode


def t(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int32)


def _cache(page_size: int = 1) -> RadixPrefixCache:
    set_global_ctx(Context(page_size=page_size))
    return RadixPrefixCache(torch.device("cpu"))


@pytest.fixture(autouse=True)
def _clean_global_ctx() -> Iterator[None]:
    yield
    reset_global_ctx()


def _tree_shape(node: RadixTreeNode) -> list[tuple[list[int], list[int], int, list]]:
    """The subtree below `node` as nested (key, value, ref_count, children), sorted by key."""
    children = sorted(node.children.values(), key=lambda n: n._key.tolist())
    return [(c._key.tolist(), c.value.tolist(), c.ref_count, _tree_shape(c)) for c in children]


def test_fast_compare_key() -> None:
    assert fast_compare_key(t(1, 2, 3), t(1, 2, 4)) == 2
    assert fast_compare_key(t(1, 2, 3), t(1, 2)) == 2
    assert fast_compare_key(t(5), t(6, 7)) == 0
    assert fast_compare_key(t(), t(1)) == 0
    assert fast_compare_key(t(1, 2), t(1, 2)) == 2


# The seed's test_lock_protects_from_eviction_and_lru_order lives in test_ch09_radix.py.


def test_seed_example_tree() -> None:
    cache = _cache()
    cache.insert_prefix(t(1, 2, 3, 4), t(10, 11, 12, 13))
    cache.insert_prefix(t(1, 2, 5, 6), t(10, 11, 20, 21))
    cache.insert_prefix(t(7, 8), t(30, 31))
    assert _tree_shape(cache.root_node) == [
        ([1, 2], [10, 11], 0, [([3, 4], [12, 13], 0, []), ([5, 6], [20, 21], 0, [])]),
        ([7, 8], [30, 31], 0, []),
    ]
    assert cache.num_nodes == 4

    handle = cache.match_prefix(t(1, 2, 3, 9)).cuda_handle
    cache.lock_handle(handle)
    assert handle.cached_len == 3
    assert handle.get_matched_indices().tolist() == [10, 11, 12]
    assert _tree_shape(cache.root_node) == [
        (
            [1, 2],
            [10, 11],
            1,
            [([3], [12], 1, [([4], [13], 0, [])]), ([5, 6], [20, 21], 0, [])],
        ),
        ([7, 8], [30, 31], 0, []),
    ]
    assert tuple(cache.size_info) == (5, 3)

    assert cache.evict(2).tolist() == [13, 20, 21]
    assert cache.evict(1).tolist() == [30, 31]
    assert _tree_shape(cache.root_node) == [([1, 2], [10, 11], 1, [([3], [12], 1, [])])]
    assert cache.size_info == (0, 3)
    cache.check_integrity()


def test_page_size_16_caches_whole_pages_only() -> None:
    cache = _cache(page_size=16)
    prompt = torch.arange(100, 130, dtype=torch.int32)  # 30 tokens
    slots = torch.arange(1000, 1030, dtype=torch.int32)
    result = cache.insert_prefix(prompt, slots)
    assert result.cached_len == 0
    assert result.handle.cached_len == 16
    assert cache.size_info == (16, 0)
    assert result.handle.get_matched_indices().tolist() == slots[:16].tolist()

    assert cache.match_prefix(prompt).cuda_handle.cached_len == 16
    assert cache.match_prefix(prompt[:20]).cuda_handle.cached_len == 16
    assert cache.match_prefix(prompt[:15]).cuda_handle.cached_len == 0  # not one whole page
    diverges_mid_page = prompt[:16].clone()
    diverges_mid_page[10] = 7
    assert cache.match_prefix(diverges_mid_page).cuda_handle.cached_len == 0

    again = cache.insert_prefix(prompt, slots + 100)
    assert again.cached_len == 16  # already cached: the caller frees its duplicate page
    assert cache.size_info == (16, 0)
    assert cache.num_nodes == 1
    cache.check_integrity()


def test_page_size_4_splits_on_page_boundaries() -> None:
    cache = _cache(page_size=4)
    ids = torch.arange(12, dtype=torch.int32)
    cache.insert_prefix(ids, ids + 100)
    assert cache.num_nodes == 1

    # Differs at token 6: the match stops at the page boundary 4 and splits the node there.
    query = ids.clone()
    query[6] = 99
    handle = cache.match_prefix(query).cuda_handle
    assert isinstance(handle, RadixCacheHandle)
    assert handle.cached_len == 4
    assert handle.node._key.tolist() == [0, 1, 2, 3]
    assert handle.get_matched_indices().tolist() == [100, 101, 102, 103]
    assert _tree_shape(cache.root_node) == [
        (
            [0, 1, 2, 3],
            [100, 101, 102, 103],
            0,
            [(list(range(4, 12)), list(range(104, 112)), 0, [])],
        )
    ]
    assert (0, 1, 2, 3) in cache.root_node.children  # children keyed by the first page

    # Inserting the diverging query adds only its whole pages past the shared one.
    result = cache.insert_prefix(query[:10], torch.arange(200, 210, dtype=torch.int32))
    assert result.cached_len == 4
    assert result.handle.cached_len == 8
    assert result.handle.get_matched_indices().tolist() == [100, 101, 102, 103, 204, 205, 206, 207]
    assert cache.size_info == (16, 0)
    assert cache.num_nodes == 3
    cache.check_integrity()


def test_evict_edge_cases_and_reset() -> None:
    cache = _cache()
    assert cache.evict(0).numel() == 0
    cache.insert_prefix(t(1, 2, 3), t(10, 11, 12))
    handle = cache.insert_prefix(t(1, 2, 3, 4), t(0, 0, 0, 13)).handle
    cache.lock_handle(handle)
    with pytest.raises(AssertionError):
        cache.evict(1)  # everything is locked
    cache.lock_handle(handle, unlock=True)
    # Freeing the leaf [4] makes [1, 2, 3] an unlocked leaf, which goes next.
    assert cache.evict(2).tolist() == [13, 10, 11, 12]
    assert cache.num_nodes == 0 and not cache.evictable_leaves
    cache.insert_prefix(t(5, 6), t(50, 51))
    cache.reset()
    assert cache.size_info == (0, 0) and cache.num_nodes == 0
    assert cache.match_prefix(t(5, 6)).cuda_handle.get_matched_indices().numel() == 0
    cache.check_integrity()


# ---------------------------------------------------------------------------------------------
# Property-based test against a reference model of cached prefixes.


def _page_patterns(page_size: int) -> list[tuple[int, ...]]:
    if page_size == 1:
        return [(0,), (1,), (2,), (3,)]
    half = page_size // 2
    return [
        (0,) * page_size,
        (0,) * half + (1,) * (page_size - half),  # shares half a page with the first
        (0,) * (page_size - 1) + (2,),  # differs from the first only in the last token
        (1,) * page_size,
    ]


def _sequences(page_size: int) -> st.SearchStrategy[list[int]]:
    max_pages = 8 if page_size == 1 else 4
    pages = st.lists(st.sampled_from(_page_patterns(page_size)), max_size=max_pages)
    tail = st.lists(st.integers(0, 3), max_size=page_size if page_size > 1 else 0)
    return st.builds(lambda ps, tl: [x for p in ps for x in p] + tl, pages, tail)


def _operations(page_size: int) -> st.SearchStrategy[list[tuple]]:
    seqs = _sequences(page_size)
    op = st.one_of(
        st.tuples(st.just("insert"), seqs, st.booleans()),
        st.tuples(st.just("match"), seqs, st.booleans()),
        st.tuples(st.just("unlock"), st.integers(0, 1000)),
        st.tuples(st.just("evict"), st.integers(0, 100)),
    )
    return st.lists(op, max_size=40)


def _expected_seed_eviction(cache: RadixPrefixCache, size: int) -> list[int]:
    """The slots the seed's full-tree-walk evict would free, in order, without mutating."""
    if size == 0:
        return []
    num_children: dict[RadixTreeNode, int] = {}
    heap: list[tuple[int, int, RadixTreeNode]] = []
    stack = [cache.root_node]
    while stack:
        node = stack.pop()
        num_children[node] = len(node.children)
        stack.extend(node.children.values())
        if not node.is_root() and node.is_leaf() and node.ref_count == 0:
            heap.append((node.timestamp, node.uuid, node))
    heapq.heapify(heap)
    freed: list[int] = []
    while len(freed) < size:
        _, _, node = heapq.heappop(heap)
        freed += node.value.tolist()
        parent = node.parent
        num_children[parent] -= 1
        if num_children[parent] == 0 and parent.ref_count == 0 and not parent.is_root():
            heapq.heappush(heap, (parent.timestamp, parent.uuid, parent))
    return freed


def _tree_contents(cache: RadixPrefixCache) -> dict[tuple[int, ...], tuple[int, ...]]:
    """Every cached page-aligned token prefix mapped to the slots of its last page."""
    page = cache.page_size
    contents: dict[tuple[int, ...], tuple[int, ...]] = {}
    stack: list[tuple[RadixTreeNode, tuple[int, ...]]] = [(cache.root_node, ())]
    while stack:
        node, prefix = stack.pop()
        tokens, slots = node._key.tolist(), node.value.tolist()
        for start in range(0, len(tokens), page):
            prefix = prefix + tuple(tokens[start : start + page])
            contents[prefix] = tuple(slots[start : start + page])
        stack.extend((child, prefix) for child in node.children.values())
    return contents


class _Reference:
    """What the cache should hold, page by page: a cached prefix -> slots of its last page.

    Pages, not tokens, are the unit: two siblings may share the first tokens of their first page,
    so the same token prefix can sit in the tree twice with different slots.
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.cached: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.locked: list[tuple[RadixCacheHandle, tuple[int, ...]]] = []
        self.slots_taken_in: set[int] = set()
        self.slots_freed: set[int] = set()
        self.next_slot = 0
        # Logical time of each cached page's last access: a walk touches exactly the pages it
        # matched, and a newly inserted suffix is created after that walk.
        self.last_access: dict[tuple[int, ...], int] = {}
        self.clock = 0

    def touch(self, seq: list[int], start: int, end: int) -> None:
        """Record an access to the pages of `seq[start:end]`, later than every earlier one."""
        self.clock += 1
        for page_end in range(start + self.page_size, end + 1, self.page_size):
            self.last_access[tuple(seq[:page_end])] = self.clock

    def match_len(self, seq: list[int]) -> int:
        length, page = 0, self.page_size
        while length + page <= len(seq) and tuple(seq[: length + page]) in self.cached:
            length += page
        return length

    def indices_of(self, seq: list[int], length: int) -> list[int]:
        page = self.page_size
        return [s for end in range(page, length + 1, page) for s in self.cached[tuple(seq[:end])]]

    def protected_prefixes(self) -> set[tuple[int, ...]]:
        page = self.page_size
        return {
            prefix[:end] for _, prefix in self.locked for end in range(page, len(prefix) + 1, page)
        }

    def cached_slots(self, prefixes: Iterable[tuple[int, ...]]) -> set[int]:
        return {slot for prefix in prefixes for slot in self.cached[prefix]}

    def check(self, cache: RadixPrefixCache) -> None:
        cache.check_integrity()
        assert _tree_contents(cache) == self.cached
        self.check_lru_timestamps(cache)
        protected = len(self.protected_prefixes()) * self.page_size
        total = len(self.cached) * self.page_size
        assert cache.size_info == (total - protected, protected)
        cached_slots = self.cached_slots(self.cached)
        assert len(cached_slots) == total
        assert not cached_slots & self.slots_freed
        assert cached_slots | self.slots_freed == self.slots_taken_in

    def check_lru_timestamps(self, cache: RadixPrefixCache) -> None:
        """Node timestamps must order nodes exactly as the logical last-access times do."""
        page = self.page_size
        time_pairs: set[tuple[int, int]] = set()
        stack: list[tuple[RadixTreeNode, tuple[int, ...]]] = [(cache.root_node, ())]
        while stack:
            node, prefix = stack.pop()
            tokens = node._key.tolist()
            node_times = set()
            for start in range(0, len(tokens), page):
                prefix = prefix + tuple(tokens[start : start + page])
                node_times.add(self.last_access[prefix])
            if not node.is_root():
                assert len(node_times) == 1, "pages of one node accessed at different times"
                time_pairs.add((node_times.pop(), node.timestamp))
            stack.extend((child, prefix) for child in node.children.values())
        # A strictly monotone one-to-one map: sorting by either time gives the same order.
        by_logical = sorted(time_pairs)
        assert (
            len({lt for lt, _ in time_pairs})
            == len({ts for _, ts in time_pairs})
            == len(time_pairs)
        )
        assert [ts for _, ts in by_logical] == sorted(ts for _, ts in time_pairs)


def _run_operations(page_size: int, ops: list[tuple]) -> None:
    cache = _cache(page_size)
    ref = _Reference(page_size)
    for op in ops:
        kind = op[0]
        if kind == "insert":
            _, seq, lock = op
            insert_len = len(seq) - len(seq) % page_size
            expected_cached = ref.match_len(seq[:insert_len])
            # The engine allocates slots for the whole sequence; the tree keeps only the new ones.
            slots = list(range(ref.next_slot, ref.next_slot + len(seq)))
            ref.next_slot += len(seq)
            result = cache.insert_prefix(torch.tensor(seq, dtype=torch.int32), t(*slots))
            assert result.cached_len == expected_cached
            assert result.handle.cached_len == insert_len
            for end in range(expected_cached + page_size, insert_len + 1, page_size):
                ref.cached[tuple(seq[:end])] = tuple(slots[end - page_size : end])
            ref.touch(seq, 0, expected_cached)
            ref.touch(seq, expected_cached, insert_len)
            ref.slots_taken_in.update(slots[expected_cached:insert_len])
            assert result.handle.get_matched_indices().tolist() == ref.indices_of(seq, insert_len)
            if lock:
                assert isinstance(result.handle, RadixCacheHandle)
                cache.lock_handle(result.handle)
                ref.locked.append((result.handle, tuple(seq[:insert_len])))
        elif kind == "match":
            _, seq, lock = op
            expected_len = ref.match_len(seq)
            ref.touch(seq, 0, expected_len)
            handle = cache.match_prefix(torch.tensor(seq, dtype=torch.int32)).cuda_handle
            assert handle.cached_len == expected_len
            assert handle.get_matched_indices().tolist() == ref.indices_of(seq, expected_len)
            if lock:
                assert isinstance(handle, RadixCacheHandle)
                cache.lock_handle(handle)
                ref.locked.append((handle, tuple(seq[:expected_len])))
        elif kind == "unlock":
            if ref.locked:
                handle, _ = ref.locked.pop(op[1] % len(ref.locked))
                cache.lock_handle(handle, unlock=True)
        else:
            size = cache.evictable_size * op[1] // 100
            expected = _expected_seed_eviction(cache, size)
            protected_slots = ref.cached_slots(ref.protected_prefixes())
            freed = cache.evict(size).tolist()
            assert freed == expected  # exactly the seed's LRU order
            assert len(freed) >= size
            freed_set = set(freed)
            assert len(freed_set) == len(freed)
            assert not freed_set & protected_slots, "evicted a locked token"
            assert not freed_set & ref.slots_freed, "freed a slot twice"
            ref.cached = {p: s for p, s in ref.cached.items() if not freed_set & set(s)}
            ref.last_access = {p: ref.last_access[p] for p in ref.cached}
            ref.slots_freed |= freed_set
            assert all(len(p) == page_size or p[:-page_size] in ref.cached for p in ref.cached)
        ref.check(cache)

    # Unlocking everything and evicting it all must return every slot the tree took in.
    for handle, _ in ref.locked:
        cache.lock_handle(handle, unlock=True)
    ref.locked.clear()
    freed = cache.evict(cache.evictable_size).tolist()
    assert len(set(freed)) == len(freed) and not set(freed) & ref.slots_freed
    assert set(freed) | ref.slots_freed == ref.slots_taken_in
    assert cache.size_info == (0, 0) and cache.num_nodes == 0 and not cache.root_node.children
    cache.check_integrity()


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("min_heap_rebuild", [0, 64], ids=["eager-rebuild", "default-rebuild"])
def test_random_operations_match_reference(
    page_size: int, min_heap_rebuild: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A zero floor makes the stale-entry heap rebuild fire even on the small trees drawn here.
    monkeypatch.setattr(radix_cache, "_HEAP_MIN_REBUILD_SIZE", min_heap_rebuild)

    @settings(
        max_examples=300,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(ops=_operations(page_size))
    def run(ops: list[tuple]) -> None:
        try:
            _run_operations(page_size, ops)
        finally:
            reset_global_ctx()

    run()


def test_lock_unlock_churn_keeps_heap_bounded() -> None:
    cache = _cache()
    handles = [cache.insert_prefix(t(i, i + 1), t(i, i + 1)).handle for i in range(0, 8, 2)]
    for _ in range(500):
        for handle in handles:
            cache.lock_handle(handle)
            cache.lock_handle(handle, unlock=True)
    assert len(cache._leaf_heap) <= 4 * len(cache.evictable_leaves) + 64
    cache.check_integrity()
    assert cache.evict(8).tolist() == list(range(8))
