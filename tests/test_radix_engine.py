"""The radix cache inside the engine: reuse, page alignment, multi-turn and duplicate pages."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    MIXED_PROMPTS,
    PROMPTS,
    assert_all_pages_free,
    build_llm,
    greedy,
    hf_encode,
    hf_greedy,
    spy_prefill_tokens,
)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_radix_generation_matches_hf(page_size: int) -> None:
    llm = build_llm("qwen3", page_size=page_size, max_running_req=4)
    prompts = PROMPTS + MIXED_PROMPTS
    expected = hf_greedy("qwen3", prompts, 8)
    for _ in range(2):  # cold, then warm (hits on every prompt)
        outputs = llm.generate(prompts, greedy(8))
        assert [o["token_ids"] for o in outputs] == expected
        assert_all_pages_free(llm)
    assert all(o["cached_tokens"] % page_size == 0 for o in outputs)
    assert sum(o["cached_tokens"] for o in outputs) > 0
    llm.shutdown()


def test_page_size_16_caches_whole_pages_only() -> None:
    llm = build_llm("qwen3", page_size=16)
    prompt = list(range(1000, 1030))  # 30 tokens
    llm.generate([prompt], greedy(1))
    cache = llm.cache_manager.prefix_cache
    assert cache.size_info.total_size == 16  # 30 tokens of KV -> one whole page
    handle = cache.match_prefix(torch.tensor(prompt[:29], dtype=torch.int32)).cuda_handle
    assert handle.cached_len == 16
    out = llm.generate([prompt + [5, 6]], greedy(1))[0]
    assert out["cached_tokens"] == 16
    assert_all_pages_free(llm)
    llm.shutdown()


@pytest.mark.parametrize("page_size", [1, 4])
def test_multi_turn_recomputes_only_new_tokens(page_size: int) -> None:
    llm = build_llm("smollm2", page_size=page_size, overlap_schedule=False)
    computed = spy_prefill_tokens(llm)
    turn1 = hf_encode("smollm2", "User: What is the capital of France?\nAssistant:")
    answer = llm.generate([turn1], greedy(12))[0]["token_ids"]
    question = hf_encode("smollm2", "\nUser: And of Italy?\nAssistant:")
    turn2 = turn1 + answer + question
    computed.clear()
    out = llm.generate([turn2], greedy(8))[0]
    # Turn one's KV (prompt + all but the last answer token) is cached, page-aligned.
    reusable = len(turn1) + len(answer) - 1
    cached = reusable - reusable % page_size
    assert out["cached_tokens"] == cached
    assert sum(computed) == len(turn2) - cached
    if page_size == 1:
        assert sum(computed) == len(question) + 1
    assert out["token_ids"] == hf_greedy("smollm2", [turn2], 8)[0]
    assert_all_pages_free(llm)
    llm.shutdown()


@pytest.mark.parametrize("page_size", [1, 4])
def test_same_prefix_in_one_batch_frees_duplicate_pages(page_size: int) -> None:
    # A small pool so freed duplicate pages are soon handed to other requests: if a request
    # kept reading its freed copy, its output would diverge from HF.
    llm = build_llm(
        "qwen3", page_size=page_size, num_page_override=320 // page_size, overlap_schedule=False
    )
    shared = list(range(2000, 2040))
    prompts = [shared + [7, 8, 9], shared + [10, 11], shared + [12], list(range(3000, 3030))]
    lens = [30, 25, 28, 40]
    outputs = llm.generate(prompts, [greedy(n) for n in lens])
    assert [o["token_ids"] for o in outputs] == hf_greedy("qwen3", prompts, lens)
    cache = llm.cache_manager.prefix_cache
    # The shared prefix is stored once: the tree holds the union of the page-aligned prefixes.
    pages = set()
    for prompt, out in zip(prompts, outputs):
        seq = prompt + out["token_ids"][:-1]
        for end in range(page_size, len(seq) - len(seq) % page_size + 1, page_size):
            pages.add(tuple(seq[:end]))
    assert cache.size_info.total_size == len(pages) * page_size
    assert_all_pages_free(llm)
    llm.shutdown()


def test_hit_accounting() -> None:
    llm = build_llm("qwen3")
    prompt = list(range(500, 540))
    first = llm.generate([prompt], greedy(2))[0]
    second = llm.generate([prompt], greedy(2))[0]
    assert first["cached_tokens"] == 0
    assert second["cached_tokens"] == len(prompt) - 1
    assert llm.stats.prompt_tokens == 2 * len(prompt)
    assert llm.stats.cached_tokens == len(prompt) - 1
    assert llm.stats.hit_rate == pytest.approx((len(prompt) - 1) / (2 * len(prompt)))
    llm.shutdown()


@pytest.mark.parametrize("min_dup", [0.0, 0.5])
def test_attention_over_shared_prefix_reads_each_slot_once(min_dup: float, monkeypatch) -> None:
    from minisgl.attention import TorchAttnBackend

    monkeypatch.setattr(TorchAttnBackend, "shared_kv_min_dup", min_dup)
    calls = []
    shared_attention = TorchAttnBackend._shared_attention

    def counting(self, *args):
        calls.append(1)
        return shared_attention(self, *args)

    monkeypatch.setattr(TorchAttnBackend, "_shared_attention", counting)
    from minisgl.attention.cpu_backend import CpuAttnBackend

    llm = build_llm("qwen3", page_size=4)
    shared = list(range(3000, 3064))
    llm.generate([shared + [7]], greedy(1))  # cache the shared prefix first
    # Extends longer than the paged kernel's (which takes short ones on a CPU without the
    # blocked kernel), so that the prefill reaches SDPA.
    extend = CpuAttnBackend.paged_max_extend + 2
    prompts = [shared + [100 + i + 20 * j for j in range(extend)] for i in range(8)]
    prompts.append([11, 12, 13])
    outputs = llm.generate(prompts, greedy(8))
    assert calls, "the shared-slot attention path was not taken"
    assert [o["token_ids"] for o in outputs] == hf_greedy("qwen3", prompts, 8)
    assert_all_pages_free(llm)
    llm.shutdown()
