"""What the C kernels do with what they cannot compute, in every form this machine runs: a
failed allocation is a MemoryError naming the kernel (or, on a path that needs no memory, the
right result), never an unwritten output; a position outside the rotary tables and a shape past
a kernel's buffers are ValueErrors naming the value, with nothing written; a kernel whose
instructions a build lacks is a RuntimeError or does not apply. The C refuses such arguments on
its own too, before reading anything."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from test_kernel_attention import paged_table
from test_kernel_variants import ONLY_WHERE_BUILT, RUNNABLE, on_two_threads

from minisgl.kernel import abi
from minisgl.kernel.cpu import CpuKernels
from minisgl.layers.linear import interleave_gate_up

pytestmark = ONLY_WHERE_BUILT


@pytest.fixture(scope="module", params=RUNNABLE)
def named(request: pytest.FixtureRequest) -> Iterator[tuple[str, CpuKernels]]:
    for kernels in on_two_threads(request.param):
        yield request.param, kernels


@contextmanager
def failing_allocations(kernels: CpuKernels) -> Iterator[None]:
    kernels.lib.minisgl_fail_allocations(1 << 20)  # every allocation until the reset
    try:
        yield
    finally:
        kernels.lib.minisgl_fail_allocations(0)


def _attention_case(dtype: torch.dtype, heads: int, kv_lens: list[int], head_dim: int = 64):
    gen = torch.Generator().manual_seed(len(kv_lens) * 100 + heads)
    table, rows, slots = paged_table(kv_lens, 4, gen)
    caches = [torch.randn(slots, 2, head_dim, generator=gen).to(dtype) for _ in range(2)]
    q = torch.randn(len(kv_lens), heads, head_dim, generator=gen).to(dtype)
    return q, caches, table, rows, torch.tensor(kv_lens)


def _allocating_calls(kernels: CpuKernels) -> dict[str, Callable[[], object]]:
    """A call of each kernel that allocates on some build, with inputs that make it do so (20
    rows, past the packed GEMV's, and k of 100: x padded to whole steps in a copy; one request:
    split by position)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(20, 100, generator=gen).bfloat16()
    w = torch.randn(37, 100, generator=gen).bfloat16()
    gate_up = torch.randn(64, 100, generator=gen).bfloat16()
    packed, gated = kernels.pack_weight(w), kernels.pack_weight(interleave_gate_up(gate_up))
    q, (k_cache, v_cache), table, rows, lens = _attention_case(torch.bfloat16, 8, [65])
    prefill_q = torch.randn(9, 8, 64, generator=gen).bfloat16()
    prefill = (torch.tensor([3, 0]), torch.tensor([4, 5]), 0.125, None)
    logits = torch.randn(3, 500, generator=gen)
    return {
        "packed_linear": lambda: kernels.packed_linear(x, packed, 37, None),
        "packed_gated_silu": lambda: kernels.packed_gated_silu(x, gated, 32, None),
        "decode_attention": lambda: kernels.decode_attention(
            q, k_cache, v_cache, table, rows, lens, 0.125, None
        ),
        "top_candidates": lambda: kernels.top_candidates(logits, 5),
        "shared_prefix_attention": lambda: kernels.shared_prefix_attention(
            prefill_q, k_cache, v_cache, table[rows[0], :40].long(), 0.125
        ),
        "prefill_attention": lambda: kernels.prefill_attention(
            prefill_q, k_cache, v_cache, table, torch.cat([rows, rows]), *prefill
        ),
    }


def _same(a: object, b: object) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    return a is None and b is None


def test_a_failed_allocation_raises_and_never_returns_garbage(named):
    name, kernels = named
    raised = set()
    for kernel, call in _allocating_calls(kernels).items():
        try:
            expected = call()
        except RuntimeError as unsupported:  # a packed matmul without bf16 dots or AVX2
            assert kernel in str(unsupported) and not kernels.has_packed_matmul
            with failing_allocations(kernels), pytest.raises(RuntimeError, match=kernel):
                call()
            continue
        with failing_allocations(kernels):
            try:
                got = call()
                assert _same(got, expected), f"{kernel}: another result without its memory"
            except MemoryError as error:
                assert kernel in str(error)
                raised.add(kernel)
        assert _same(call(), expected)  # and it works again once memory is back
    # Decode attention allocates its runs of rows (the portable kernels) or, on AVX-512, the
    # per-thread states of a short batch split by position.
    expected_raises = {"top_candidates", "decode_attention"}
    if kernels.has_packed_matmul:
        expected_raises |= {"packed_linear", "packed_gated_silu"}
    if kernels.has_avx512_bf16:
        expected_raises |= {"shared_prefix_attention", "prefill_attention"}
    assert raised == expected_raises


def test_forty_query_heads_on_one_kv_head_in_the_portable_build():
    """The reported crash: the SSE2-only build, 40 query heads on 1 kv head (its per-group
    buffers held 32), float32, two requests. Now sliced 32 + 8 heads, equal to the reference."""
    for kernels in on_two_threads("x86-64"):
        gen = torch.Generator().manual_seed(0)
        k_cache, v_cache = (torch.randn(100, 1, 64, generator=gen) for _ in range(2))
        table = torch.arange(100, dtype=torch.int32)[None].repeat(2, 1)
        q = torch.randn(2, 40, 64, generator=gen)
        lens = torch.tensor([50, 99])
        rows = torch.arange(2)
        out = kernels.decode_attention(q, k_cache, v_cache, table, rows, lens, 1 / 8, None)
        for b, n in enumerate(lens.tolist()):
            scores = q[b].double() @ k_cache[:n, 0].double().T / 8
            want = scores.softmax(-1) @ v_cache[:n, 0].double()
            torch.testing.assert_close(out[b].double(), want, atol=1e-5, rtol=0)


def _rope_tables(max_pos: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.rand(max_pos, dim // 2, generator=torch.Generator().manual_seed(2))
    return torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)


@pytest.mark.parametrize("bad", [50, -1])
def test_a_position_outside_the_rotary_tables_raises_and_writes_nothing(named, bad):
    _, kernels = named
    cos, sin = _rope_tables(50, 64)
    x = torch.randn(3, 2, 64)
    before = x.clone()
    with pytest.raises(ValueError, match=f"position {bad} is outside the rotary tables' 50"):
        kernels.rotary_(x, torch.tensor([0, bad, 7]), cos, sin)
    assert torch.equal(x, before)
    # The attention blocks check before they store the new keys and values.
    for dtype, phase in [(torch.float32, "decode"), (torch.bfloat16, "decode")] + [
        (torch.bfloat16, "prefill")
    ]:
        _, caches, table, rows, lens = _attention_case(dtype, 4, [5, 9])
        pools = [c.clone() for c in caches]
        qkv = torch.randn(2, 8 * 64).to(dtype)
        inputs = (qkv, None, *pools, torch.tensor([1, 2]), torch.tensor([4, bad]), (cos, sin))
        if phase == "prefill" and not kernels.has_avx512_bf16:
            # Not applicable: the caller's PyTorch path runs instead.
            assert _attention_block(kernels, phase, inputs, table, rows, lens) is None
        else:
            with pytest.raises(ValueError, match=f"position {bad} is outside"):
                _attention_block(kernels, phase, inputs, table, rows, lens)
        assert all(torch.equal(p, c) for p, c in zip(pools, caches))


def _attention_block(kernels, phase, inputs, table, rows, lens) -> torch.Tensor | None:
    """A decode block over the requests' lens, or a prefill block of their last tokens."""
    if phase == "decode":
        return kernels.decode_attention_block(*inputs, table, (rows, lens), 4, None)
    prefill = (rows, lens - 1, torch.ones(len(lens), dtype=torch.int64))
    return kernels.prefill_attention_block(*inputs, table, prefill, 4, None)


def test_shapes_a_kernel_cannot_take_raise_value_errors_naming_them(named):
    _, kernels = named
    q, (k_cache, v_cache), table, rows, lens = _attention_case(torch.float32, 4, [9, 3])
    attention = (table, rows, lens, 0.1, None)
    wide = _attention_case(torch.float32, 4, [9], head_dim=288)
    with pytest.raises(ValueError, match="head_dim 288 is outside the kernel's 1..256"):
        kernels.decode_attention(wide[0], *wide[1], *wide[2:], 0.1, None)
    with pytest.raises(ValueError, match="num_heads 3 is not a multiple of num_kv_heads 2"):
        kernels.decode_attention(q[:, :3].contiguous(), k_cache, v_cache, *attention)
    with pytest.raises(ValueError, match="q .* is not contiguous"):
        strided = q.transpose(0, 1)[:2].transpose(0, 1)
        kernels.decode_attention(strided, k_cache, v_cache, *attention)
    logits = torch.randn(2, 10)
    for k in (0, 11):
        with pytest.raises(ValueError, match=f"k {k} is outside 1..10"):
            kernels.top_candidates(logits, k)
    with pytest.raises(ValueError, match="argmax: rows of 0 columns"):
        kernels.argmax(logits[:, :0])
    with pytest.raises(ValueError, match="sample_rows: rows of 0 columns"):
        kernels.sample_rows(logits[:, :0], torch.rand(2, dtype=torch.float64))
    x, w = torch.randn(3, 40).bfloat16(), torch.randn(8, 40).bfloat16()
    with pytest.raises(ValueError, match="gemv_bf16: weight"):
        kernels.gemv_bf16(x[:, :32].contiguous(), w, None)
    with pytest.raises(ValueError, match="packed weight of"):
        kernels.packed_linear(x, kernels.pack_weight(w), 40, None)
    with pytest.raises(ValueError, match="add_rms_norm: x .* is not contiguous"):
        kernels.add_rms_norm(x.T, None, torch.ones(3).bfloat16(), 1e-6)
    cos, sin = _rope_tables(50, 32)
    with pytest.raises(ValueError, match="rotary tables"):
        kernels.rotary_(torch.randn(2, 1, 64), torch.tensor([1, 2]), cos, sin)


def test_the_c_kernels_refuse_what_their_buffers_cannot_hold(named):
    """Called directly with NULL for every tensor: a kernel that read anything would crash, so
    each must refuse its arguments first (the wrappers' checks are not the only guard)."""
    _, kernels = named
    lib, nulls = kernels.lib, [None] * 5 + [0] + [None] * 5  # table_stride 0
    assert lib.minisgl_decode_attention(*nulls, 1, 4, 4, 512, 1.0, 0, 0, 1) == abi.ERR_SHAPE
    assert lib.minisgl_decode_attention(*nulls, 1, 6, 4, 64, 1.0, 0, 0, 1) == abi.ERR_SHAPE
    assert lib.minisgl_decode_attention(*nulls, 0, 8, 4, 64, 1.0, 0, 0, 1) == abi.OK  # no reqs
    assert lib.minisgl_top_candidates(None, 1, 10, 0, None, None, 1) == abi.ERR_SHAPE
    positions = torch.tensor([3, 9])
    status = lib.minisgl_rotary(None, 2, 64, 1, 64, positions.data_ptr(), None, None, 9, 0, 1)
    assert status == abi.ERR_POSITION
    blocked = [None] * 4 + [8]  # q, caches, slots, prefix_len
    blocked_status = abi.ERR_SHAPE if kernels.has_avx512_bf16 else abi.ERR_UNSUPPORTED
    status = lib.minisgl_shared_prefix_attention(*blocked, None, None, 1, 4, 4, 48, 1.0, 0, 1)
    assert status == blocked_status
    status = lib.minisgl_prefill_attention(*nulls[:9], 1, 4, 4, 48, 1.0, 0, 0, 1)
    assert status == blocked_status
    if not kernels.has_packed_matmul:  # refused before it reads anything
        status = lib.minisgl_packed_linear(None, None, None, None, 1, 32, 64, 0, 0, 1)
        assert status == abi.ERR_UNSUPPORTED
