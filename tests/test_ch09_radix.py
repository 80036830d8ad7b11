"""The seed chapter's two tests, unchanged except for the model fixture (a tiny random Qwen3)."""

from __future__ import annotations

import pytest
import torch
from helpers import PROMPTS, QWEN3, build_llm, greedy, hf_greedy

from minisgl.core import Context, reset_global_ctx, set_global_ctx
from minisgl.env import ENV
from minisgl.kvcache.radix_cache import RadixPrefixCache


@pytest.fixture(autouse=True)
def _restore_env():
    before = ENV.DISABLE_OVERLAP_SCHEDULING.value
    yield
    ENV.DISABLE_OVERLAP_SCHEDULING.value = before
    reset_global_ctx()


def t(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int32)


def _cache() -> RadixPrefixCache:
    set_global_ctx(Context(page_size=1))
    return RadixPrefixCache(torch.device("cpu"))


def test_lock_protects_from_eviction_and_lru_order():
    c = _cache()
    c.insert_prefix(t(1, 2, 3), t(10, 11, 12))
    c.insert_prefix(t(7, 8), t(20, 21))
    c.insert_prefix(t(4, 5), t(30, 31))
    handle = c.match_prefix(t(7, 8)).cuda_handle  # 刚访问过 [7, 8]
    c.lock_handle(handle)
    assert c.size_info == (5, 2)
    evicted = c.evict(3)  # 锁住的 [7, 8] 不能淘汰；另外两个里 [1, 2, 3] 最久没用
    assert evicted.tolist() == [10, 11, 12]
    c.lock_handle(handle, unlock=True)
    assert c.evict(2).tolist() == [30, 31]  # 解锁后，[4, 5] 比 [7, 8] 更久没用
    c.check_integrity()


def test_shared_prefixes_are_reused_and_outputs_unchanged():
    ENV.DISABLE_OVERLAP_SCHEDULING.value = True
    llm = build_llm(QWEN3, cache_type="radix")
    computed = []
    orig = llm._forward

    def spy(fi):
        if fi.batch.is_prefill:
            computed.append(sum(r.extend_len for r in fi.batch.reqs))
        return orig(fi)

    llm._forward = spy
    first = llm.generate(PROMPTS, greedy(6))
    cold = sum(computed)
    computed.clear()
    second = llm.generate(PROMPTS, greedy(6))  # 同样的提示词再来一遍：几乎全部命中
    assert (
        [o["token_ids"] for o in first]
        == [o["token_ids"] for o in second]
        == hf_greedy(QWEN3, PROMPTS, 6)
    )
    assert sum(computed) == len(PROMPTS)  # 每个请求只需重算最后 1 个 token
    assert cold > 5 * len(PROMPTS)
    llm.cache_manager.check_integrity()
    llm.shutdown()
