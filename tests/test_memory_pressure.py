"""Memory pressure: admission, chunking and decode count pages by one rule, and the limits a
request can reach are checked once, at submission (issue reproductions kept as tests)."""

from __future__ import annotations

import random

import pytest
from helpers import assert_all_pages_free, build_llm, greedy, hf_greedy

from minisgl.core import RequestError, SamplingParams
from minisgl.scheduler.budget import OUTPUT_ESTIMATE_CLIP


def _prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(count)]


def _drain(llm, uids: list[int], outs: dict[int, list] | None = None) -> dict[int, list]:
    """Step until idle; every request's outputs (added to `outs` when given)."""
    outs = {} if outs is None else outs
    for uid in uids:
        outs.setdefault(uid, [])
    while llm.has_work:
        for out in llm.step():
            outs[out.uid].append(out)
    return outs


@pytest.mark.parametrize("overlap", [False, True])
def test_chunked_prompt_beside_decodes_at_the_ratio_floor(overlap: bool) -> None:
    """Six decoding requests and a 100-token prompt chunked by 8 in 200 pages, with the
    reservation ratio at its floor (as after warm-up traffic): once ran out of KV pages."""
    llm = build_llm("qwen3", num_page_override=200, max_prefill_length=8, overlap_schedule=overlap)
    llm.generate(_prompts(4, 6, seed=1), greedy(2))  # warm-up traffic
    llm.budget.new_token_ratio = 0.1
    decoders = _prompts(6, 8, seed=2)
    long_prompt = _prompts(1, 100, seed=3)[0]
    uids = [llm.add_request(p, greedy(24)) for p in decoders]
    outs: dict[int, list] = {uid: [] for uid in uids}
    for _ in range(8):  # they are decoding when the long prompt arrives
        for out in llm.step():
            outs[out.uid].append(out)
    uids.append(llm.add_request(long_prompt, greedy(24)))
    _drain(llm, uids, outs)
    expected = hf_greedy("qwen3", decoders + [long_prompt], 24)
    for uid, want in zip(uids, expected):
        assert [o.token for o in outs[uid]] == want
        assert outs[uid][-1].finish_reason == "length"
    assert_all_pages_free(llm)
    llm.shutdown()


def test_request_that_fills_the_pool_exactly_is_admitted_at_ratio_one() -> None:
    """page_size 16, 4 pages: a 17-token prompt with max_tokens 47 needs all 64 slots; rounding
    prompt and output pages up separately once asked for 5 pages and never admitted it."""
    llm = build_llm("qwen3", page_size=16, num_page_override=4, overlap_schedule=False)
    llm.budget.new_token_ratio = 1.0  # as after retractions
    prompt = _prompts(1, 17, seed=4)[0]
    out = llm.generate([prompt], greedy(47))[0]
    assert out["token_ids"] == hf_greedy("qwen3", [prompt], 47)[0]
    assert_all_pages_free(llm)
    llm.shutdown()


# Under Qwen3-0.6B's 40,960-token context, over the clipped estimate of several requests.
POOL = 16384


@pytest.fixture(scope="module")
def long_context_llm():
    """40,960 positions of context over a smaller pool: max_model_len is the pool."""
    llm = build_llm(
        "qwen3-long", num_page_override=POOL, max_seq_len_override=None, max_running_req=8
    )
    yield llm
    llm.shutdown()


def test_max_model_len_is_the_smallest_limit(long_context_llm) -> None:
    assert long_context_llm.engine.model_config.max_position_embeddings == 40960
    assert long_context_llm.max_model_len == POOL


def _first_new_token(tokens: list[int], start: int) -> int | None:
    """Index of the first token from `start` on that did not occur before it."""
    return next((i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i]), None)


def test_requests_without_max_tokens_run_side_by_side(long_context_llm) -> None:
    llm = long_context_llm
    # No max_tokens: each may run to the end of the context; a stop token that HF's greedy
    # run reaches a few tokens in ends it (prompts where the tiny model has one).
    candidates = _prompts(12, 12, seed=5)
    runs = hf_greedy("qwen3-long", candidates, 16)
    picked = [
        (p, run, end) for p, run in zip(candidates, runs) if (end := _first_new_token(run, 2))
    ]
    prompts, free_run, ends = zip(*picked[:4])
    assert len(prompts) == 4
    params = [
        SamplingParams(max_tokens=None, stop_token_ids=[want[end]], ignore_eos=True)
        for want, end in zip(free_run, ends)
    ]
    uids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    outs = {uid: [] for uid in uids}
    for out in llm.step():  # one prefill: their clipped estimates fit the pool side by side
        outs[out.uid].append(out)
    assert len(llm.running) == 4 and not llm.waiting
    _drain(llm, uids, outs)
    for uid, want, end in zip(uids, free_run, ends):
        assert [o.token for o in outs[uid]] == want[: end + 1]
        assert outs[uid][-1].finish_reason == "stop"
    assert_all_pages_free(llm)


def test_estimate_of_an_unbounded_request_is_clipped(long_context_llm) -> None:
    llm = long_context_llm
    req_uid = llm.add_request(_prompts(1, 10, seed=6)[0], SamplingParams(max_tokens=None))
    req = llm.waiting[-1]
    assert req.uid == req_uid and req.max_device_len == llm.max_model_len
    llm.budget.new_token_ratio = 1.0
    pages = llm.budget.pages_to_claim(req, 0)
    assert pages == min(llm.max_model_len, 10 + OUTPUT_ESTIMATE_CLIP)
    llm.abort_request(req_uid)
    llm.step()


def test_max_tokens_past_the_context(long_context_llm) -> None:
    llm = long_context_llm
    prompt = _prompts(1, 40, seed=7)[0]
    with pytest.raises(RequestError, match=f"{POOL}.* 40 .*{POOL + 1}") as info:
        llm.add_request(prompt, greedy(POOL - 39), clip_to_context=False)
    assert info.value.param == "max_tokens" and info.value.code == "context_length_exceeded"
    with pytest.raises(RequestError, match=f"{POOL}") as info:
        llm.add_request(_prompts(1, POOL, seed=8)[0], greedy(1))
    assert info.value.param == "prompt"
    assert not llm.has_work  # refused submissions leave nothing behind
    # The offline API cuts max_tokens to what the context leaves (as vLLM's).
    uid = llm.add_request(_prompts(1, POOL - 8, seed=9)[0], greedy(100))
    outs = _drain(llm, [uid])
    assert len(outs[uid]) == 8 and outs[uid][-1].finish_reason == "length"
    assert_all_pages_free(llm)
