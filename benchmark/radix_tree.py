"""Per-call cost of radix-cache match / insert / evict as the tree grows.

Also times the seed's evict, which walks the whole tree to collect unlocked leaves on every call,
as a baseline: with the incrementally kept evictable-leaf heap, evict should stay roughly flat as
the tree grows while the full-walk evict grows with it.

Run from the repo root: `python benchmark/radix_tree.py`.
"""

from __future__ import annotations

import argparse
import heapq
import random
import time
from collections.abc import Callable

import paths  # noqa: F401  (before minisgl: a checkout without `pip install -e .`)
import torch

from minisgl.core import Context, reset_global_ctx, set_global_ctx
from minisgl.kvcache.radix_cache import RadixPrefixCache, RadixTreeNode

VOCAB_SIZE = 32000
TREE_SIZES = (1_000, 10_000, 100_000)
PAGE_SIZES = (1, 16)
TIMED_CALLS = 1000
FULL_WALK_CALLS = {1_000: 200, 10_000: 40, 100_000: 10}


class _SequenceSource:
    """Random prompts that branch off earlier ones, like conversations sharing history."""

    def __init__(self, page_size: int, seed: int) -> None:
        self.page_size = page_size
        self.rng = random.Random(seed)
        self.sequences: list[list[int]] = []

    def fresh(self) -> list[int]:
        """A new sequence: a page-aligned prefix of an earlier one plus 1-8 random new pages."""
        prefix: list[int] = []
        if self.sequences and self.rng.random() < 0.9:
            base = self.rng.choice(self.sequences)
            num_pages = len(base) // self.page_size
            prefix = base[: self.rng.randint(0, num_pages) * self.page_size]
        new_len = self.rng.randint(1, 8) * self.page_size
        seq = prefix + [self.rng.randrange(VOCAB_SIZE) for _ in range(new_len)]
        self.sequences.append(seq)
        return seq


class _SlotAllocator:
    """Hands out never-reused KV slot indices, as a page allocator would."""

    def __init__(self) -> None:
        self.next_slot = 0

    def take(self, n: int) -> torch.Tensor:
        """The next `n` slots."""
        slots = torch.arange(self.next_slot, self.next_slot + n, dtype=torch.int32)
        self.next_slot += n
        return slots


def _build_tree(
    page_size: int, num_nodes: int, source: _SequenceSource, slots: _SlotAllocator
) -> RadixPrefixCache:
    set_global_ctx(Context(page_size=page_size))
    cache = RadixPrefixCache(torch.device("cpu"))
    while cache.num_nodes < num_nodes:
        seq = source.fresh()
        cache.insert_prefix(torch.tensor(seq, dtype=torch.int32), slots.take(len(seq)))
    return cache


def _full_walk_evict(cache: RadixPrefixCache, size: int) -> torch.Tensor:
    """The seed's evict: gather every unlocked leaf by walking the whole tree, then pop by LRU."""
    leaves: list[RadixTreeNode] = []
    stack = [cache.root_node]
    while stack:
        node = stack.pop()
        if node.is_leaf():
            if node.ref_count == 0 and not node.is_root():
                leaves.append(node)
        else:
            stack.extend(node.children.values())
    heapq.heapify(leaves)
    evicted: list[torch.Tensor] = []
    evicted_size = 0
    while evicted_size < size:
        node = heapq.heappop(leaves)
        evicted_size += node.length
        evicted.append(node.value)
        parent = node.parent
        # Removing through the cache keeps its counters and leaf set valid for later calls.
        cache._remove_leaf(node)
        if parent in cache.evictable_leaves:
            heapq.heappush(leaves, parent)
    return torch.cat(evicted)


def _micros_per_call(calls: int, fn: Callable[[int], object], chunks: int = 5) -> float:
    """Mean cost of `fn(i)` for i in range(calls); the best of `chunks` runs, to skip stalls."""
    chunk_means: list[float] = []
    for chunk in range(chunks):
        indices = range(chunk * calls // chunks, (chunk + 1) * calls // chunks)
        start = time.perf_counter_ns()
        for i in indices:
            fn(i)
        chunk_means.append((time.perf_counter_ns() - start) / len(indices) / 1e3)
    return min(chunk_means)


def _bench_one(page_size: int, num_nodes: int) -> tuple[int, float, float, float, float]:
    source = _SequenceSource(page_size, seed=num_nodes + page_size)
    slots = _SlotAllocator()
    cache = _build_tree(page_size, num_nodes, source, slots)
    built_nodes = cache.num_nodes

    # Matches refresh timestamps, leaving stale heap entries for evict to skip, as in serving.
    queries = [
        torch.tensor(source.rng.choice(source.sequences), dtype=torch.int32)
        for _ in range(TIMED_CALLS)
    ]
    match_us = _micros_per_call(TIMED_CALLS, lambda i: cache.match_prefix(queries[i]))

    new_seqs = [source.fresh() for _ in range(TIMED_CALLS)]
    new_inputs = [(torch.tensor(s, dtype=torch.int32), slots.take(len(s))) for s in new_seqs]
    insert_us = _micros_per_call(TIMED_CALLS, lambda i: cache.insert_prefix(*new_inputs[i]))

    # One page per call: the cheapest request, where per-call overhead dominates.
    evict_us = _micros_per_call(TIMED_CALLS, lambda i: cache.evict(page_size))
    full_walk_calls = FULL_WALK_CALLS.get(num_nodes, max(5, 200_000 // num_nodes))
    full_walk_us = _micros_per_call(full_walk_calls, lambda i: _full_walk_evict(cache, page_size))
    cache.check_integrity()
    reset_global_ctx()
    return built_nodes, match_us, insert_us, evict_us, full_walk_us


def main(argv: list[str] | None = None) -> None:
    """Time every tree size at every page size (or the ones given) and print the table."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--tree-sizes", default=",".join(map(str, TREE_SIZES)), help="node counts")
    p.add_argument("--page-sizes", default=",".join(map(str, PAGE_SIZES)), help="KV page sizes")
    args = p.parse_args(argv)
    tree_sizes = [int(x) for x in args.tree_sizes.split(",")]
    torch.set_num_threads(1)
    print("radix prefix cache: microseconds per call, best of 5 chunks (evict frees one page)")
    header = (
        f"{'page':>4} {'nodes':>8} {'match':>8} {'insert':>8} {'evict':>8} "
        f"{'full-walk evict':>16} {'full-walk / evict':>18}"
    )
    print(header)
    for page_size in (int(x) for x in args.page_sizes.split(",")):
        for num_nodes in tree_sizes:
            nodes, match_us, insert_us, evict_us, full_walk_us = _bench_one(page_size, num_nodes)
            print(
                f"{page_size:>4} {nodes:>8} {match_us:>8.1f} {insert_us:>8.1f} {evict_us:>8.1f} "
                f"{full_walk_us:>16.1f} {full_walk_us / evict_us:>17.1f}x"
            )


if __name__ == "__main__":
    main()
