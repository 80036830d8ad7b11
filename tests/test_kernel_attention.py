"""Decode attention (paged, any GQA group, head_dim and page size, batches of 0 to 5, cascade
prefix states, the fused attention block) and the blocked bf16 prefill and shared-prefix kernels,
in every form of the C kernels this machine runs, against float64 references with bounds derived
from float32 rounding (see test_kernel_variants.py)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

import pytest
import torch
from test_kernel_variants import (
    DTYPES,
    EXP_ULPS,
    ONLY_WHERE_BUILT,
    RUNNABLE,
    U32,
    UBF16,
    assert_within,
    on_two_threads,
)

from minisgl.kernel.cpu import CpuKernels

pytestmark = ONLY_WHERE_BUILT


@pytest.fixture(scope="module", params=RUNNABLE)
def kernels(request: pytest.FixtureRequest) -> Iterator[CpuKernels]:
    yield from on_two_threads(request.param)


def paged_table(
    kv_lens: list[int], page_size: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A page table as the engine fills it: each request's positions in pages of `page_size`
    consecutive slots, the pages spread over the pool at random; the requests' table rows (out
    of order); the pool's slot count."""
    pages = [math.ceil(n / page_size) for n in kv_lens]
    order = torch.randperm(sum(pages) + 3, generator=gen)
    table = torch.zeros(len(kv_lens) + 2, max(kv_lens, default=1), dtype=torch.int32)
    rows = torch.randperm(len(kv_lens) + 2, generator=gen)[: len(kv_lens)]
    first_page = 0
    for row, n, count in zip(rows.tolist(), kv_lens, pages):
        positions = torch.arange(n)
        page = order[first_page + positions // page_size]
        table[row, :n] = (page * page_size + positions % page_size).to(torch.int32)
        first_page += count
    return table, rows, len(order) * page_size


class AttentionReference(NamedTuple):
    """float64 attention and the bounds on a float32 kernel's error (see _attention_reference)."""

    out: torch.Tensor  # [B, heads, dim]
    bound: torch.Tensor  # [B, heads, dim]
    weighted: torch.Tensor  # sum_j p_j |v_j| [B, heads, dim]: what relative errors of p scale
    lse: torch.Tensor  # log-sum-exp of the scaled scores [B, heads]
    lse_bound: torch.Tensor  # [B, heads]


def _attention_reference(
    q, k_cache, v_cache, table, rows, kv_lens, window, unit_out, lse_seen=None
) -> AttentionReference:
    """Each query (q [B, heads, dim]) over its request's positions, in float64, and the bound on
    a float32 online softmax: scores within (dim + 1) U32 of their products' magnitudes; per key,
    the exp of a rounded argument, exp's own error and every rescaling; the weighted value sums
    and the normaliser in any order; the output rounded to unit_out."""
    num_heads, dim = q.shape[1:]
    kv_heads, scale = k_cache.shape[1], 1 / math.sqrt(dim)
    parts: list[list[torch.Tensor]] = [[], [], [], [], []]
    for b in range(q.shape[0]):
        kv_len = int(kv_lens[b])
        start = max(0, kv_len - window) if window else 0
        slots = table[rows[b], start:kv_len].long()
        keys, values = k_cache[slots].double(), v_cache[slots].double()  # [n, kv_heads, D]
        query = q[b].double().view(kv_heads, -1, dim)  # [kv_heads, group, D]
        scores = torch.einsum("kgd,nkd->kgn", query, keys).flatten(0, 1) * scale  # [H, n]
        magnitudes = torch.einsum("kgd,nkd->kgn", query.abs(), keys.abs()).flatten(0, 1) * scale
        probs = scores.softmax(-1)
        grouped = probs.view(kv_heads, -1, len(slots))
        out = torch.einsum("kgn,nkd->kgd", grouped, values).flatten(0, 1)
        weighted = torch.einsum("kgn,nkd->kgd", grouped, values.abs()).flatten(0, 1)
        n = len(slots)
        rescales = n // 64 + torch.get_num_threads() + 2  # blocks, merged thread ranges
        per_key = 2 * (dim + 1) * U32 * magnitudes.amax(-1)
        per_key = per_key + U32 * (4 * scores.abs().amax(-1) + EXP_ULPS * 2 * rescales + n + dim)
        if lse_seen is not None:  # a prefix state's lse, rounded to float32
            per_key = per_key + U32 * (lse_seen[b].abs() + 2)
        lse = scores.logsumexp(-1)
        parts[0].append(out)
        parts[1].append(
            weighted * (2 * per_key + (2 * n + 1) * U32)[:, None] + unit_out * out.abs()
        )
        parts[2].append(weighted)
        parts[3].append(lse)
        parts[4].append(per_key + U32 * (n + lse.abs() + 2))
    if not parts[0]:
        empty = torch.empty(0, num_heads, dim, dtype=torch.float64)
        return AttentionReference(empty, empty, empty, empty[..., 0], empty[..., 0])
    return AttentionReference(*(torch.stack(part) for part in parts))


# (page size, KV lengths, window): one request crossing a 64-key block, a batch with a window,
# an empty batch, and three requests (split by position below four).
ATTENTION_BATCHES = [
    (1, [65], None),
    (4, [1, 64, 17, 130, 3], 17),
    (16, [], None),
    (16, [70, 2, 129], None),
]


@pytest.mark.parametrize("dtype", DTYPES)
# Groups of 1, 4, 40 (the 40-on-1 head model the portable path once overflowed on), 17 with more
# heads than a task holds, and 80 (more than any task holds: slices of the group); the
# vector path's head_dims (64, 128, 256) and the portable path's others; 3 kv heads (SmolLM2's),
# which do not split over two threads: the portable path splits few requests by positions.
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (40, 1), (136, 8), (80, 1), (9, 3)])
@pytest.mark.parametrize("head_dim", [16, 64, 80, 128, 256])
def test_decode_attention_within_float32_rounding(kernels, dtype, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(heads * 1000 + head_dim)
    for page_size, kv_lens, window in ATTENTION_BATCHES:
        table, rows, slots = paged_table(kv_lens, page_size, gen)
        k_cache = torch.randn(slots, kv_heads, head_dim, generator=gen).to(dtype)
        v_cache = torch.randn(slots, kv_heads, head_dim, generator=gen).to(dtype)
        q = torch.randn(len(kv_lens), heads, head_dim, generator=gen).to(dtype)
        lens = torch.tensor(kv_lens, dtype=torch.int64)
        scale = 1 / math.sqrt(head_dim)
        out = kernels.decode_attention(q, k_cache, v_cache, table, rows, lens, scale, window)
        assert out.shape == q.shape and out.dtype == dtype
        unit = U32 if dtype == torch.float32 else UBF16
        ref = _attention_reference(q, k_cache, v_cache, table, rows, lens, window, unit)
        assert_within(out, ref.out, ref.bound, f"page {page_size}, lens {kv_lens}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 64), (40, 1, 80), (9, 3, 80)])
def test_decode_attention_continues_from_a_prefix_state(kernels, dtype, heads, kv_heads, head_dim):
    """Cascade: the state over positions [0, start) (float64, rounded to float32) merged with
    the kernel's own over the rest equals attention over everything."""
    gen = torch.Generator().manual_seed(7)
    # Five requests: with two threads, a task per request (whole rows) on every path.
    kv_lens, start = [71, 100, 199, 90, 75], 70
    table, rows, slots = paged_table(kv_lens, 4, gen)
    k_cache = torch.randn(slots, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(slots, kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(len(kv_lens), heads, head_dim, generator=gen).to(dtype)
    scale = 1 / math.sqrt(head_dim)
    outs, lses = [], []
    for b in range(len(kv_lens)):
        slots_b = table[rows[b], :start].long()
        keys, values = k_cache[slots_b].double(), v_cache[slots_b].double()
        query = q[b].double().view(kv_heads, -1, head_dim)
        scores = torch.einsum("kgd,nkd->kgn", query, keys) * scale
        outs.append(torch.einsum("kgn,nkd->kgd", scores.softmax(-1), values).flatten(0, 1))
        lses.append(scores.logsumexp(-1).flatten())
    prefix = (
        torch.full((len(kv_lens),), start),
        torch.stack(outs).float(),
        torch.stack(lses).float(),
    )
    lens = torch.tensor(kv_lens)
    out = kernels.decode_attention(q, k_cache, v_cache, table, rows, lens, scale, None, prefix)
    unit = U32 if dtype == torch.float32 else UBF16
    ref = _attention_reference(q, k_cache, v_cache, table, rows, lens, None, unit, prefix[2])
    assert_within(out, ref.out, ref.bound + U32 * ref.weighted, "cascade")  # + prefix_out's
    # One request: its positions split over the threads, the prefix seeding the first part.
    one = kernels.decode_attention(
        q[2:3],
        k_cache,
        v_cache,
        table,
        rows[2:3],
        lens[2:3],
        scale,
        None,
        tuple(part[2:3] for part in prefix),
    )
    bound = (ref.bound + U32 * ref.weighted)[2:3]
    assert_within(one, ref.out[2:3], bound, "cascade, one request")


# (heads, kv_heads, head_dim, dtypes, KV lengths): SmolLM2's heads (the portable path splits
# few requests by parts; the AVX-512 path too) with one part, several, and more than 2,048
# positions (longer parts); kv heads that split evenly over two threads; a group wider than a
# task holds (slices of it; on AVX-512, more heads than a task holds).
INVARIANT_CASES = [
    (9, 3, 64, DTYPES, [3, 130, 300, 2100]),
    (8, 2, 128, [torch.bfloat16], [3, 130, 300]),
    (72, 2, 64, [torch.bfloat16], [3, 130, 300]),
]


def _attend(kernels: CpuKernels, inputs: tuple, picked: slice) -> torch.Tensor:
    """decode_attention of the requests `picked` of inputs = (q, k_cache, v_cache, table, rows,
    kv_lens, scale, window, prefix or None)."""
    q, k_cache, v_cache, table, rows, lens, scale, window, prefix = inputs
    part = None if prefix is None else tuple(t[picked] for t in prefix)
    return kernels.decode_attention(
        q[picked], k_cache, v_cache, table, rows[picked], lens[picked], scale, window, part
    )


@pytest.mark.parametrize("heads,kv_heads,head_dim,dtypes,kv_lens", INVARIANT_CASES)
def test_a_requests_output_is_the_same_bits_in_any_batch_and_on_any_threads(
    kernels, heads, kv_heads, head_dim, dtypes, kv_lens
):
    """A request's attention alone (its positions split over the threads), among others (a task
    a request), on one, two or three threads, with a window or a cascade prefix: the same bits,
    so a speculative verify step's rows give what decoding them one by one gives, whatever the
    batch and however many threads the engine's load leaves it."""
    gen = torch.Generator().manual_seed(heads + head_dim)
    table, rows, slots = paged_table(kv_lens, 4, gen)
    shape = (heads, kv_heads, head_dim)
    _assert_rows_as_alone(kernels, gen, (table, rows, torch.tensor(kv_lens), slots), shape, dtypes)


def _assert_rows_as_alone(kernels, gen, paged, shape, dtypes, leading=1, bounded=False) -> None:
    """Each row of a batch (paged: page table, table rows, KV lengths, slots) the same bits as
    decoded alone, the batch and its first `leading` rows the same on one and three threads,
    with no window, a window of 200 or a cascade prefix of 2 positions; bounded: the batch also
    within float32's bounds of float64."""
    (table, rows, lens, slots), (heads, kv_heads, head_dim) = paged, shape
    scale, start = 1 / math.sqrt(head_dim), 2  # the cascade prefix: positions [0, start)
    prefix = (
        torch.full((len(lens),), start),
        torch.randn(len(lens), heads, head_dim, generator=gen),
        torch.randn(len(lens), heads, generator=gen),
    )
    threads = torch.get_num_threads()
    for dtype in dtypes:
        k_cache, v_cache = (
            torch.randn(slots, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2)
        )
        q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
        for window, seed in ((None, None), (200, None), (None, prefix)):
            inputs = (q, k_cache, v_cache, table, rows, lens, scale, window, seed)
            batch = _attend(kernels, inputs, slice(None))
            for b in range(len(lens)):
                alone = _attend(kernels, inputs, slice(b, b + 1))
                assert torch.equal(alone, batch[b : b + 1]), (dtype, window, seed is not None, b)
            if bounded and seed is None:
                unit = U32 if dtype == torch.float32 else UBF16
                ref = _attention_reference(q, k_cache, v_cache, table, rows, lens, window, unit)
                assert_within(batch, ref.out, ref.bound, f"window {window}")
            try:
                for count in (1, 3):
                    torch.set_num_threads(count)
                    assert torch.equal(_attend(kernels, inputs, slice(None)), batch), count
                    lead = slice(0, leading)
                    assert torch.equal(_attend(kernels, inputs, lead), batch[lead]), count
            finally:
                torch.set_num_threads(threads)


# Verify steps (base KV length, query rows): a request's rows are one page-table row, KV
# lengths one apart, which the portable kernels read as runs: runs longer than a task's heads
# take (16 rows of 9 heads: 14 and 2), rows crossing a 64-key part (62..67), lengths where parts
# grow past 1,024 positions (1,020..1,027: runs split where part lengths differ), a lone row.
VERIFY_RUNS = [(3, 16), (62, 6), (300, 1), (1020, 8), (2100, 3)]


@pytest.mark.parametrize("heads,kv_heads,head_dim,dtypes,kv_lens", INVARIANT_CASES)
def test_a_verify_steps_rows_are_each_the_same_bits_as_alone(
    kernels, heads, kv_heads, head_dim, dtypes, kv_lens
):
    """The rows of speculative verify steps among other requests (the portable kernels read a
    request's positions once for all its rows): each row the same bits as decoded alone, on one,
    two or three threads, with a window or a cascade prefix, and within float32's bounds."""
    gen = torch.Generator().manual_seed(heads + 7)
    bases = [(base, count) for base, count in VERIFY_RUNS if base < max(kv_lens)]
    table, requests, slots = paged_table([base + count for base, count in bases], 4, gen)
    rows = torch.cat([requests[i : i + 1].repeat(count) for i, (_, count) in enumerate(bases)])
    lens = torch.tensor([base + 1 + i for base, count in bases for i in range(count)])
    paged, shape = (table, rows, lens, slots), (heads, kv_heads, head_dim)
    _assert_rows_as_alone(kernels, gen, paged, shape, dtypes, leading=9, bounded=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_block_equals_its_steps(kernels, dtype):
    """The block (q/k norms, rotary, KV store, attention in one call) gives what this build's
    separate kernels give in that order, bit for bit, on 40 query heads over 1 kv head."""
    gen = torch.Generator().manual_seed(8)
    heads, kv_heads, dim, max_pos = 40, 1, 64, 300
    kv_lens = [5, 130]
    table, rows, slots = paged_table(kv_lens, 4, gen)
    pools = [torch.randn(slots, kv_heads, dim, generator=gen).to(dtype) for _ in range(2)]
    qkv = torch.randn(2, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    norms = [(torch.rand(dim, generator=gen) + 0.5).to(dtype) for _ in range(2)]
    angles = torch.rand(max_pos, dim // 2, generator=gen) * 7
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    positions = torch.tensor(kv_lens) - 1
    out_loc = torch.stack([table[rows[b], kv_lens[b] - 1] for b in range(2)]).long()
    lens = torch.tensor(kv_lens)
    k_steps, v_steps = (p.clone() for p in pools)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = (t.contiguous().view(-1, dim) for t in (q, k))
    q = kernels.add_rms_norm(q, None, norms[0], 1e-6)[0].view(2, heads, dim)
    k = kernels.add_rms_norm(k, None, norms[1], 1e-6)[0].view(2, kv_heads, dim)
    kernels.rotary_(q, positions, cos, sin)
    kernels.rotary_(k, positions, cos, sin)
    k_steps[out_loc], v_steps[out_loc] = k, v.view(2, kv_heads, dim)
    want = kernels.decode_attention(
        q, k_steps, v_steps, table, rows, lens, 1 / math.sqrt(dim), None
    )
    out = kernels.decode_attention_block(
        qkv,
        (norms[0], norms[1], 1e-6),
        *pools,
        out_loc,
        positions,
        (cos, sin),
        table,
        (rows, lens),
        heads,
        None,
    )
    assert torch.equal(pools[0], k_steps) and torch.equal(pools[1], v_steps)
    assert torch.equal(out, want.flatten(1))


# ------------------------------------------------------------------- blocked bf16 attention
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 64), (40, 1, 96)])
def test_blocked_attention_within_bounds_or_not_applicable(kernels, heads, kv_heads, head_dim):
    """Prefill and shared-prefix attention: where the build has avx512_bf16, within the bound
    of their float32 scores and probabilities split into two bf16 parts (2^-16 relative each);
    elsewhere they do not apply (None: the caller's PyTorch path)."""
    gen = torch.Generator().manual_seed(9)
    cached, extend = [0, 40, 3], [17, 1, 40]  # a first tile and a second, a decode-like row
    kv_lens = [c + e for c, e in zip(cached, extend)]
    table, rows, slots = paged_table(kv_lens, 16, gen)
    k_cache = torch.randn(slots, kv_heads, head_dim, generator=gen).bfloat16()
    v_cache = torch.randn(slots, kv_heads, head_dim, generator=gen).bfloat16()
    q = torch.randn(sum(extend), heads, head_dim, generator=gen).bfloat16()
    scale = 1 / math.sqrt(head_dim)
    args = (torch.tensor(cached), torch.tensor(extend), scale, None)
    out = kernels.prefill_attention(q, k_cache, v_cache, table, rows, *args)
    shared = kernels.shared_prefix_attention(q, k_cache, v_cache, table[rows[1], :40], scale)
    if not kernels.has_avx512_bf16:
        assert out is None and shared is None
        return
    assert out is not None and shared is not None
    split = 2.0**-16  # a probability as a bf16 part and a bf16 remainder
    # Token j of request b is a decode query over its first cached + j + 1 positions.
    token_rows = torch.cat([rows[b].repeat(extend[b]) for b in range(3)])
    token_lens = torch.cat([torch.arange(c + 1, c + e + 1) for c, e in zip(cached, extend)])
    ref = _attention_reference(q, k_cache, v_cache, table, token_rows, token_lens, None, UBF16)
    assert_within(out, ref.out, ref.bound + split * ref.weighted, "prefill")
    # Every token over the first 40 positions of request 1: float32 out and lse.
    prefix_rows, prefix_lens = torch.full((len(q),), int(rows[1])), torch.full((len(q),), 40)
    ref = _attention_reference(q, k_cache, v_cache, table, prefix_rows, prefix_lens, None, U32)
    assert_within(shared[0], ref.out, ref.bound + split * ref.weighted, "shared prefix")
    assert_within(shared[1], ref.lse, ref.lse_bound, "shared prefix lse")
