"""Scheduling: chunked prefill, overlap hazards, retraction, aborts, policies."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import (
    MIXED_PROMPTS,
    assert_all_pages_free,
    build_llm,
    greedy,
    hf_encode,
    hf_greedy,
    spy_prefill_tokens,
)

from minisgl.core import SamplingParams


def _random_prompts(count: int, low: int, high: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(100, 40000) for _ in range(rng.randint(low, high))] for _ in range(count)
    ]


def _run_collecting(llm, prompts, params):
    """Drive step() by hand; return every TokenOutput per uid, in order."""
    uids = [llm.add_request(hf_encode("qwen3", p), sp) for p, sp in zip(prompts, params)]
    seen: dict[int, list] = {uid: [] for uid in uids}
    while llm.has_work:
        for out in llm.step():
            seen[out.uid].append(out)
    return uids, seen


@pytest.mark.parametrize("arch", ["qwen3", "smollm2"])
def test_chunked_prefill_budget_16_computes_each_token_once(arch: str) -> None:
    prompts = MIXED_PROMPTS + _random_prompts(2, 150, 200, seed=1)
    llm = build_llm(arch, max_prefill_length=16, cache_type="naive", overlap_schedule=False)
    computed = spy_prefill_tokens(llm)
    outputs = llm.generate(prompts, greedy(5))
    assert max(computed) <= 16
    assert sum(computed) == sum(o["prompt_tokens"] for o in outputs)
    assert [o["token_ids"] for o in outputs] == hf_greedy(arch, prompts, 5)
    assert_all_pages_free(llm)
    llm.shutdown()


def test_decode_is_not_starved_by_a_long_chunked_prompt() -> None:
    llm = build_llm("qwen3", max_prefill_length=8, cache_type="naive")
    short = llm.add_request([5, 6, 7], greedy(20))
    llm.step()  # prefill the short request
    llm.add_request(list(range(1000, 1200)), greedy(2))  # 25 chunks of 8
    tokens_of_short = 0
    for _ in range(20):
        tokens_of_short += sum(o.uid == short and o.token is not None for o in llm.step())
    assert tokens_of_short >= 8, "decode must progress while the long prompt is chunked"
    while llm.has_work:
        llm.step()
    assert_all_pages_free(llm)
    llm.shutdown()


def test_waiting_prompts_are_prefilled_before_running_requests_decode() -> None:
    llm = build_llm("qwen3", max_prefill_length=8, cache_type="naive", overlap_schedule=False)
    running = llm.add_request([5, 6, 7], greedy(20))
    llm.step()  # prefill it: it is running now
    later = [llm.add_request(list(range(300 + 8 * i, 308 + 8 * i)), greedy(2)) for i in range(3)]
    for uid in later:  # one whole 8-token prompt per step, with no decode step between them
        assert [o.uid for o in llm.step() if o.token is not None] == [uid]
    assert {o.uid for o in llm.step() if o.token is not None} == {running, *later}
    while llm.has_work:
        llm.step()
    assert_all_pages_free(llm)
    llm.shutdown()


@pytest.mark.parametrize(
    "config",
    [
        dict(page_size=1, cache_type="naive"),
        dict(page_size=4, cache_type="radix"),
        dict(page_size=16, cache_type="radix", max_prefill_length=32),
    ],
)
def test_overlap_on_off_and_hf_agree(config) -> None:
    prompts = MIXED_PROMPTS
    lens = [1, 2, 3, 9, 4, 12, 6, 8]
    expected = hf_greedy("qwen3", prompts, lens)
    for overlap in (False, True):
        llm = build_llm("qwen3", max_running_req=3, overlap_schedule=overlap, **config)
        for _ in range(2):  # the second round hits the radix cache
            outputs = llm.generate(prompts, [greedy(n) for n in lens])
            assert [o["token_ids"] for o in outputs] == expected, f"overlap={overlap}"
            assert_all_pages_free(llm)
        llm.shutdown()


def test_hazard_late_finish_flag_sends_no_extra_token() -> None:
    llm = build_llm("qwen3", overlap_schedule=True)
    lens = [1, 2, 3, 5]
    prompts = MIXED_PROMPTS[:4]
    uids, seen = _run_collecting(llm, prompts, [greedy(n) for n in lens])
    for uid, n, want in zip(uids, lens, hf_greedy("qwen3", prompts, lens)):
        outs = seen[uid]
        assert [o.token for o in outs] == want and len(outs) == n
        assert [o.finish_reason for o in outs] == [None] * (n - 1) + ["length"]
    assert_all_pages_free(llm)
    llm.shutdown()


def test_hazard_no_token_after_eos() -> None:
    llm = build_llm("qwen3", overlap_schedule=True)
    free = llm.generate(["Hello there"], greedy(8))[0]["token_ids"]
    stop = free[2]
    llm.eos_ids = llm.eos_ids | {stop}
    ids = llm.tokenizer("Hello there").input_ids
    uids, seen = _run_collecting(llm, [ids, ids[:1]], [greedy(8), greedy(8, ignore_eos=True)])
    outs = seen[uids[0]]
    assert [o.token for o in outs] == free[: free.index(stop) + 1]
    assert outs[-1].finish_reason == "stop"
    assert len(seen[uids[1]]) == 8  # ignore_eos keeps going in the same batches
    assert_all_pages_free(llm)
    llm.shutdown()


def test_hazard_table_row_not_reused_while_in_flight() -> None:
    llm = build_llm("qwen3", max_running_req=2, overlap_schedule=True)
    # Short requests that finish on a stop token (known only one step late, so their row is
    # still in the next, already launched step); long prompts then take their rows.
    short = [[11, 12], [13]]
    stops = [hf_greedy("qwen3", [p], 3)[0][1] for p in short]
    prompts = short + _random_prompts(4, 40, 60, seed=3)
    params = [greedy(8, stop_token_ids=[stop]) for stop in stops] + [
        greedy(n) for n in (4, 3, 5, 2)
    ]
    allocate = llm.table_manager.allocate
    reuses_checked = 0

    def checked_allocate() -> int:
        nonlocal reuses_checked
        row = allocate()
        in_flight = llm._in_flight
        if in_flight is not None:
            reuses_checked += 1
            assert row not in [r.table_idx for r in in_flight.batch.reqs], "row still in flight"
        return row

    llm.table_manager.allocate = checked_allocate
    outputs = llm.generate(prompts, params)
    assert reuses_checked > 0
    expected = [
        want[: want.index(stop) + 1] for want, stop in zip(hf_greedy("qwen3", short, 3), stops)
    ]
    expected += hf_greedy("qwen3", prompts[2:], [4, 3, 5, 2])
    assert [o["token_ids"] for o in outputs] == expected
    assert_all_pages_free(llm)
    llm.shutdown()


@pytest.mark.parametrize("overlap", [False, True])
def test_hazard_abort_during_in_flight_prefill_frees_once(overlap: bool) -> None:
    llm = build_llm("qwen3", page_size=4, overlap_schedule=overlap)
    prompts = _random_prompts(3, 20, 40, seed=4)
    uids = [llm.add_request(p, greedy(6)) for p in prompts]
    outs: dict[int, list] = {uid: [] for uid in uids}
    for out in llm.step():  # the prefill is launched (and, with overlap, still in flight)
        outs[out.uid].append(out)
    assert llm.abort_request(uids[1])
    assert not llm.abort_request(uids[1])
    while llm.has_work:
        for out in llm.step():
            outs[out.uid].append(out)
    assert outs[uids[1]][-1].finish_reason == "abort"
    assert len(outs[uids[1]]) <= 2 and outs[uids[1]][-1].token is None
    expected = hf_greedy("qwen3", [prompts[0], prompts[2]], 6)
    assert [o.token for o in outs[uids[0]]] == expected[0]
    assert [o.token for o in outs[uids[2]]] == expected[1]
    assert_all_pages_free(llm)
    llm.shutdown()


@pytest.mark.parametrize("overlap", [False, True])
def test_retraction_when_kv_runs_out(overlap: bool) -> None:
    llm = build_llm("qwen3", num_page_override=128, max_running_req=32, overlap_schedule=overlap)
    prompts = _random_prompts(32, 20, 60, seed=5)
    outputs = llm.generate(prompts, greedy(40))
    assert llm.stats.retractions > 0
    assert all(o["finish_reason"] == "length" for o in outputs)
    assert [o["token_ids"] for o in outputs] == hf_greedy("qwen3", prompts, 40)
    assert_all_pages_free(llm)
    llm.shutdown()


def test_abort_random_requests_at_random_moments() -> None:
    rng = random.Random(6)
    llm = build_llm("qwen3", page_size=4, max_running_req=12, num_page_override=160)
    prompts = _random_prompts(50, 5, 40, seed=7)
    lens = [rng.randint(1, 12) for _ in prompts]
    uids = [llm.add_request(p, greedy(n)) for p, n in zip(prompts, lens)]
    victims = set(rng.sample(uids, 10))
    abort_at = {uid: rng.randint(0, 30) for uid in victims}
    tokens: dict[int, list[int]] = {uid: [] for uid in uids}
    finished: dict[int, str] = {}
    step = 0
    while llm.has_work:
        for uid, at in abort_at.items():
            if at == step and uid not in finished:
                assert llm.abort_request(uid)
        for out in llm.step():
            if out.token is not None:
                tokens[out.uid].append(out.token)
            if out.finish_reason is not None:
                assert out.uid not in finished, "a request finished twice"
                finished[out.uid] = out.finish_reason
        step += 1
    assert set(finished) == set(uids)
    keep = [i for i, uid in enumerate(uids) if finished[uid] != "abort"]
    assert len(keep) >= 40
    expected = hf_greedy("qwen3", [prompts[i] for i in keep], [lens[i] for i in keep])
    assert [tokens[uids[i]] for i in keep] == expected
    assert_all_pages_free(llm)
    llm.shutdown()


def _hit_rate(policy: str) -> float:
    rng = random.Random(8)
    groups = [[rng.randrange(100, 40000) for _ in range(64)] for _ in range(8)]
    prompts = [g + [rng.randrange(100, 40000) for _ in range(8)] for g in groups for _ in range(8)]
    rng.shuffle(prompts)
    llm = build_llm(
        "qwen3",
        max_running_req=4,
        num_page_override=400,
        schedule_policy=policy,
        overlap_schedule=False,
    )
    llm.generate(prompts, SamplingParams(max_tokens=2))
    rate = llm.stats.hit_rate
    llm.shutdown()
    return rate


def test_lpm_beats_fcfs_on_shuffled_prefix_groups() -> None:
    assert _hit_rate("lpm") > _hit_rate("fcfs")


@pytest.mark.parametrize("page_size", [1, 4])
def test_freed_pages_come_back_lowest_first_as_runs(page_size: int) -> None:
    """Pages freed out of order are handed out in slot order, so a new prompt's KV is one run."""
    from minisgl.core import Req
    from minisgl.kvcache import create_prefix_cache
    from minisgl.scheduler.cache import CacheManager

    page_table = torch.zeros(5, 64, dtype=torch.int32)
    cache = CacheManager(32, page_size, page_table, create_prefix_cache("naive", "cpu"))
    length = 8 * page_size  # four of them fill the pool

    def release(req: Req) -> None:
        req.device_len = len(req.input_ids)
        req.cache_handle = cache.match_req(req)
        cache.release_uncached(req)

    reqs = [Req(i, torch.arange(length), SamplingParams(), length, 64, i) for i in range(4)]
    cache.allocate(reqs, [length] * 4)
    for i in (3, 0, 2, 1):
        release(reqs[i])
    big = Req(4, torch.arange(2 * length), SamplingParams(), 2 * length, 64, 4)
    cache.allocate([big], [2 * length])
    assert torch.equal(page_table[4, : 2 * length], torch.arange(2 * length, dtype=torch.int32))
    release(big)
    cache.check_integrity()


@pytest.mark.parametrize("num_pages", [64, 5000])
def test_free_pages_hand_out_the_lowest_whatever_was_freed_when(num_pages: int) -> None:
    """Random takes and frees (a few pages, as rejected drafts; many, as evictions) against a set:
    every take is the lowest free pages, ascending, whether they waited on the side list or not."""
    from minisgl.scheduler.free_pages import FreePages

    page_size = 4
    free_pages = FreePages(num_pages, page_size, torch.device("cpu"))
    reference = set(range(0, num_pages * page_size, page_size))
    held: list[int] = []
    rng = random.Random(num_pages)
    for _ in range(400):
        if held and rng.random() < 0.5:
            rng.shuffle(held)
            count = rng.choice([1, 2, 3, len(held)])
            freed, held = held[:count], held[count:]
            free_pages.add(torch.tensor(freed, dtype=torch.int32))
            reference |= set(freed)
        elif reference:
            count = rng.randint(1, min(len(reference), rng.choice([3, 40, num_pages])))
            taken = free_pages.take(count).tolist()
            assert taken == sorted(reference)[:count]
            reference -= set(taken)
            held += taken
        assert len(free_pages) == len(reference)
        assert sorted(free_pages.all().tolist()) == sorted(reference)


@pytest.mark.parametrize("overlap", [False, True])
def test_non_finite_logits_fail_that_request_alone(overlap: bool) -> None:
    from minisgl.core import get_global_ctx

    llm = build_llm("qwen3", page_size=4, overlap_schedule=overlap)
    prompts = _random_prompts(3, 10, 30, seed=9)
    uids = [llm.add_request(p, greedy(8)) for p in prompts]
    victim = uids[1]
    model = llm.engine.model
    steps = {"victim": 0}

    def poisoned(*args, **kwargs):
        logits = model(*args, **kwargs)
        sampled = [r for r in get_global_ctx().batch.reqs if not r.is_chunked]
        for row, req in enumerate(sampled):
            if req.uid == victim:
                steps["victim"] += 1
                if steps["victim"] == 3:  # its third token's logits go bad
                    logits[row] = float("nan")
        return logits

    llm.engine.model = poisoned
    outs = {uid: [] for uid in uids}
    while llm.has_work:
        for out in llm.step():
            outs[out.uid].append(out)
    last = outs[victim][-1]
    assert last.finish_reason == "error" and "not finite" in (last.error or "")
    assert [o.token for o in outs[victim][:-1]] == hf_greedy("qwen3", [prompts[1]], 2)[0]
    others = [prompts[0], prompts[2]]
    assert [[o.token for o in outs[u]] for u in (uids[0], uids[2])] == hf_greedy("qwen3", others, 8)
    assert_all_pages_free(llm)
    llm.engine.model = model
    llm.shutdown()
