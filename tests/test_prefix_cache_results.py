"""Prefix-cache results are NamedTuples, as in mini-sglang: they unpack like tuples."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from minisgl.core import Context, reset_global_ctx, set_global_ctx
from minisgl.kvcache import InsertResult, MatchResult, create_prefix_cache


@pytest.fixture(autouse=True)
def _clean_global_ctx() -> Iterator[None]:
    set_global_ctx(Context(page_size=1))
    yield
    reset_global_ctx()


def t(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int32)


def test_results_keep_the_seed_field_order() -> None:
    assert MatchResult._fields == ("cuda_handle",)
    assert InsertResult._fields == ("cached_len", "handle")


@pytest.mark.parametrize("cache_type", ["radix", "naive"])
def test_insert_and_match_results_unpack_as_tuples(cache_type: str) -> None:
    cache = create_prefix_cache(cache_type, torch.device("cpu"))
    cached_len, handle = cache.insert_prefix(t(1, 2, 3), t(10, 11, 12))
    assert cached_len == 0
    again_cached_len, again_handle = cache.insert_prefix(t(1, 2, 3, 4), t(0, 0, 0, 13))
    (match_handle,) = cache.match_prefix(t(1, 2, 3, 9))
    result = cache.match_prefix(t(1, 2, 3, 9))
    assert result == (result.cuda_handle,) and result[0] is result.cuda_handle
    if cache_type == "radix":
        assert handle.get_matched_indices().tolist() == [10, 11, 12]
        assert again_cached_len == 3 and again_handle.cached_len == 4
        assert match_handle.get_matched_indices().tolist() == [10, 11, 12]
    else:
        assert (again_cached_len, again_handle.cached_len, match_handle.cached_len) == (0, 0, 0)
    cache.check_integrity()
