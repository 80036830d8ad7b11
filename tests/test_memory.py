"""Huge-page advice for the CPU KV pool."""

from __future__ import annotations

import os

import torch

from minisgl.kvcache.mha_pool import MHAKVCache
from minisgl.utils.memory import HUGE_PAGE_BYTES, advise_huge_pages

THP = os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")


def test_only_whole_huge_pages_are_advised():
    assert not advise_huge_pages(torch.empty(1024))  # no whole 2 MB page inside
    assert advise_huge_pages(torch.empty(4 * HUGE_PAGE_BYTES, dtype=torch.uint8)) == THP


def test_kv_pool_starts_zeroed_and_stores_rows():
    pool = MHAKVCache(2, 70_000, 2, 16, torch.bfloat16, torch.device("cpu"))
    assert pool.k_cache(1).abs().sum() == 0 and pool.v_cache(0).abs().sum() == 0
    k = torch.randn(3, 2, 16).bfloat16()
    slots = torch.tensor([5, 69_999, 12])
    pool.store_kv(k, -k, slots, layer_id=1)
    assert torch.equal(pool.k_cache(1)[slots], k) and torch.equal(pool.v_cache(1)[slots], -k)
