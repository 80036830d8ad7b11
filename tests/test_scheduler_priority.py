"""Request priority and eviction policies on a real engine with a tiny KV pool: who is admitted,
who is retracted, which prefixes stay cached; outputs equal the no-pressure ones, and free +
cached pages == all pages throughout."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
from helpers import assert_all_pages_free, build_llm, greedy

from minisgl.core import SamplingParams
from minisgl.kvcache import EVICTION_POLICIES
from minisgl.llm import LLM
from minisgl.scheduler import SchedulerConfig

torch.set_num_threads(2)

OUT = 40  # output tokens per request (ignore_eos: every request runs its whole length)
POOL = 100  # KV pages (page size 1): about two requests' worth


def _prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(count)]


PROMPTS = _prompts(5, 16, seed=0)  # four low-priority requests, then a high-priority one
PRIORITIES = [0, 0, 0, 0, 5]
# Shared-prefix workload for the eviction policies: three 40-token prefixes, two suffixes each.
PREFIXES = _prompts(3, 40, seed=1)
SHARED = [p + s for p in PREFIXES for s in _prompts(2, 6, seed=p[0])]


@pytest.fixture(scope="module")
def unpressured() -> Iterator[dict[str, list[list[int]]]]:
    """Every prompt's greedy tokens from an engine whose pool holds them all at once."""
    llm = build_llm("qwen3", overlap_schedule=False)
    outs = {
        "priority": [o["token_ids"] for o in llm.generate(PROMPTS, greedy(OUT, ignore_eos=True))],
        "shared": [o["token_ids"] for o in llm.generate(SHARED, greedy(8))],
    }
    llm.shutdown()
    yield outs


def _run(llm: LLM, priorities: list[int]) -> tuple[dict[int, list[int]], dict[int, int], list]:
    """Submit PROMPTS at once; (tokens per uid, step each finished at, retracted uids)."""
    retracted: list[int] = []
    retract = llm._retract

    def spy(req) -> None:
        retracted.append(req.uid)
        retract(req)

    llm._retract = spy  # type: ignore[method-assign]
    uids = [
        llm.add_request(p, greedy(OUT, ignore_eos=True, priority=pr))
        for p, pr in zip(PROMPTS, priorities)
    ]
    tokens: dict[int, list[int]] = {uid: [] for uid in uids}
    finished: dict[int, int] = {}
    step = 0
    while llm.has_work:
        step += 1
        for out in llm.step():
            if out.token is not None:
                tokens[out.uid].append(out.token)
            if out.finish_reason is not None:
                finished[out.uid] = step
    assert_all_pages_free(llm)
    return tokens, finished, retracted


def test_priority_policy_admits_the_high_priority_request_first(unpressured) -> None:
    """Two requests fit at a time: the last submitted, of priority 5, goes first."""
    llm = build_llm("qwen3", num_page_override=POOL, schedule_policy="priority")
    admitted: list[int] = []
    admit = llm._admit

    def spy(req, handle) -> None:
        admitted.append(req.uid)
        admit(req, handle)

    llm._admit = spy  # type: ignore[method-assign]
    tokens, finished, _ = _run(llm, PRIORITIES)
    high = list(tokens)[-1]
    assert admitted[0] == high
    assert all(finished[high] < finished[uid] for uid in tokens if uid != high)
    assert list(tokens.values()) == unpressured["priority"]
    llm.shutdown()


@pytest.mark.parametrize("overlap", [False, True])
def test_retraction_takes_low_priority_requests_first(unpressured, overlap: bool) -> None:
    """All five are admitted (optimistic reservation) and decode runs out of pages: the high-
    priority request, admitted last, would be the first retracted by admission order alone."""
    llm = build_llm("qwen3", num_page_override=POOL, overlap_schedule=overlap)
    llm.budget.new_token_ratio = 0.1
    tokens, finished, retracted = _run(llm, PRIORITIES)
    high = list(tokens)[-1]
    assert retracted and high not in retracted
    assert all(finished[high] <= finished[uid] for uid in tokens)
    assert list(tokens.values()) == unpressured["priority"]
    llm.shutdown()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_high_priority_arrival_preempts_low_priority_running_requests(
    unpressured, overlap: bool
) -> None:
    """Four low-priority requests are running (two fit) when the priority-5 one arrives: it is
    admitted at the next step by retracting low-priority ones, and finishes first; outputs equal
    the no-pressure ones."""
    llm = build_llm(
        "qwen3", num_page_override=POOL, schedule_policy="priority", overlap_schedule=overlap
    )
    retracted: list[int] = []
    retract = llm._retract

    def spy(req) -> None:
        retracted.append(req.uid)
        retract(req)

    llm._retract = spy  # type: ignore[method-assign]
    params = [greedy(OUT, ignore_eos=True, priority=pr) for pr in PRIORITIES]
    uids = [llm.add_request(p, sp) for p, sp in zip(PROMPTS[:4], params[:4])]
    tokens: dict[int, list[int]] = {uid: [] for uid in uids}
    finished: dict[int, int] = {}
    step = 0

    def run_step() -> None:
        nonlocal step
        step += 1
        for out in llm.step():
            if out.token is not None:
                tokens[out.uid].append(out.token)
            if out.finish_reason is not None:
                finished[out.uid] = step

    for _ in range(6):  # the low-priority requests fill the pool and decode
        run_step()
    high = llm.add_request(PROMPTS[4], params[4])
    tokens[high] = []
    arrival = step
    for _ in range(3):  # admitted at once (with overlap its first token shows a step later)
        run_step()
    assert tokens[high], "the high-priority request waited for the pool"
    assert retracted and high not in retracted
    while llm.has_work:
        run_step()
    assert finished[high] - arrival <= OUT + 4
    assert all(finished[high] < finished[uid] for uid in set(retracted))
    assert [tokens[uid] for uid in uids + [high]] == unpressured["priority"]
    assert_all_pages_free(llm)
    llm.shutdown()


def test_equal_priorities_retract_the_most_recently_admitted() -> None:
    llm = build_llm("qwen3", num_page_override=POOL, overlap_schedule=False)
    llm.budget.new_token_ratio = 0.1
    tokens, _, retracted = _run(llm, [0] * len(PROMPTS))
    assert retracted[0] == list(tokens)[-1]
    llm.shutdown()


@pytest.mark.parametrize("policy", EVICTION_POLICIES.names())
def test_every_eviction_policy_under_pressure(unpressured, policy: str) -> None:
    """Three rounds over a pool smaller than the distinct prefixes: prefixes are evicted and
    hit again; outputs never change and no page leaks."""
    llm = build_llm("qwen3", num_page_override=POOL, radix_eviction_policy=policy)
    assert llm.cache_manager.prefix_cache.eviction_policy.name == policy  # type: ignore[attr-defined]
    cached = 0
    for _ in range(3):
        outs = llm.generate(SHARED, greedy(8))
        assert [o["token_ids"] for o in outs] == unpressured["shared"]
        cached += sum(o["cached_tokens"] for o in outs)
        assert_all_pages_free(llm)
        size = llm.cache_manager.prefix_cache.size_info
        assert size.protected_size == 0 and size.evictable_size <= POOL
    assert cached > 0
    llm.shutdown()


@pytest.mark.parametrize("policy", ["lru", "priority"])
def test_priority_eviction_keeps_the_high_priority_prefix(policy: str) -> None:
    """A priority-3 prompt is cached first, then low-priority prompts overflow the pool: LRU
    evicts the oldest (the high-priority prefix), the priority policy keeps it."""
    llm = build_llm("qwen3", num_page_override=POOL, radix_eviction_policy=policy)
    high, *lows = _prompts(4, 40, seed=2)
    llm.generate([high], greedy(4, priority=3))
    for low in lows:
        llm.generate([low], greedy(4))
    assert_all_pages_free(llm)
    hit = llm.cache_manager.prefix_cache.match_prefix(torch.tensor(high)).cuda_handle.cached_len
    assert hit == (len(high) if policy == "priority" else 0)
    llm.shutdown()


def test_priority_is_an_integer() -> None:
    assert SamplingParams().priority == 0 and SamplingParams(priority=-(2**63)).priority < 0
    for bad in (1.5, "1", True, 2**63):
        with pytest.raises(ValueError, match="invalid sampling parameter priority="):
            SamplingParams(priority=bad)  # type: ignore[arg-type]


def test_unknown_policies_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="radix_eviction_policy 'lfru'"):
        SchedulerConfig(model_path="unused", radix_eviction_policy="lfru")
    with pytest.raises(ValueError, match="schedule_policy 'prio'"):
        SchedulerConfig(model_path="unused", schedule_policy="prio")
