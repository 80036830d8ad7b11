"""Projections on the CPU, each holding one copy of its weight: float32 (and any dtype the C
kernels do not take) through oneDNN's packed copy instead of F.linear, bf16 with avx512_bf16
through the C kernels' tile copy at every row count; a tied embedding reads its rows from the
head's copy."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from minisgl.kernel.cpu import cpu_kernels
from minisgl.layers.embedding import LMHead, VocabEmbedding
from minisgl.layers.linear import Linear, c_matmuls_take, onednn_pack

KERNELS = cpu_kernels()
needs_onednn = pytest.mark.skipif(
    onednn_pack(torch.zeros(8, 8)) is None, reason="oneDNN cannot pack float32 here"
)
needs_tiles = pytest.mark.skipif(
    KERNELS is None or not c_matmuls_take(torch.bfloat16, KERNELS),
    reason="the C matmuls take no bf16 weight on this CPU",
)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_linear_runs_on_the_onednn_packed_weight(rows, bias):
    gen = torch.Generator().manual_seed(0)
    linear = Linear(96, 40, bias=bias)
    linear.weight.data = torch.randn(40, 96, generator=gen)
    if bias:
        linear.bias.data = torch.randn(40, generator=gen)
    weight = linear.weight.data.clone()
    linear.prepare_for_cpu(None)
    assert linear.cpu_projection is not None and linear.cpu_projection.packed is not None
    assert linear.weight.numel() == 0  # the packed copy replaces the weight
    x = torch.randn(rows, 96, generator=gen)
    want = F.linear(x, weight, linear.bias)
    torch.testing.assert_close(linear(x), want, atol=1e-5, rtol=1e-5)
    # Leading dims other than one row dimension go through the same copy.
    x3 = x.view(1, rows, 96)
    torch.testing.assert_close(linear(x3), want.view(1, rows, 40), atol=1e-5, rtol=1e-5)


@needs_onednn
def test_float32_tied_head_multiplies_the_embeddings_own_weight():
    """Tied without the C kernels: no packed copy beside the weight the lookups read; oneDNN
    multiplies that weight as it lies."""
    gen = torch.Generator().manual_seed(1)
    embed = VocabEmbedding(300, 64)
    embed.weight.data = torch.randn(300, 64, generator=gen)
    weight = embed.weight.data
    head = LMHead(300, 64, tied=embed)
    head.prepare_for_cpu(None)
    assert head.cpu_projection is None and embed.weight.data_ptr() == weight.data_ptr()
    ids = torch.tensor([0, 7, 299])
    hidden = embed(ids)
    logits = head(hidden, reuse_output=True)
    assert logits.dtype == torch.float32 and logits.shape == (3, 300)
    torch.testing.assert_close(logits, hidden @ weight.T, atol=1e-4, rtol=1e-5)
    assert logits.argmax(-1).tolist() == [0, 7, 299]


@pytest.fixture
def bf16_only_in_float32(monkeypatch):
    """A CPU where neither the C matmuls nor oneDNN take bf16 (AVX2 only): oneDNN packs
    float32 only."""
    from minisgl.layers import linear as linear_mod

    monkeypatch.setattr(linear_mod, "onednn_packs", lambda dtype: dtype == torch.float32)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 64])
def test_half_weights_multiply_in_float32_where_nothing_packs_them(
    bf16_only_in_float32, dtype, rows
):
    """There, a bf16/fp16 weight is held once as oneDNN's float32 copy (F.linear on it runs
    PyTorch's ~7x slower reference loop): the float32 product of the same values, back in the
    input's dtype."""
    gen = torch.Generator().manual_seed(2)
    linear = Linear(96, 40, bias=True)
    linear.weight.data = torch.randn(40, 96, generator=gen).to(dtype)
    linear.bias.data = torch.randn(40, generator=gen).to(dtype)
    weight, bias = linear.weight.data.float(), linear.bias.data.float()
    linear.prepare_for_cpu(None)
    assert linear.cpu_projection is not None and linear.cpu_projection.in_float32
    assert linear.weight.numel() == 0
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    out = linear(x)
    assert out.dtype == dtype
    want = F.linear(x.float(), weight, bias)
    torch.testing.assert_close(out.float(), want, atol=1e-2, rtol=1e-2)


@needs_onednn
def test_tied_bf16_head_multiplies_in_float32_where_nothing_packs_bf16(bf16_only_in_float32):
    """A tied bf16 head there: float32 logits from a float32 copy, the embedding's own bf16
    weight left for the lookups."""
    gen = torch.Generator().manual_seed(3)
    embed = VocabEmbedding(300, 64)
    embed.weight.data = torch.randn(300, 64, generator=gen).to(torch.bfloat16)
    weight = embed.weight.data
    head = LMHead(300, 64, tied=embed)
    head.prepare_for_cpu(None)
    assert head.cpu_projection is not None and head.cpu_projection.in_float32
    assert embed.weight.data_ptr() == weight.data_ptr()
    hidden = embed(torch.tensor([0, 7, 299]))
    logits = head(hidden, reuse_output=True)
    assert logits.dtype == torch.float32 and logits.shape == (3, 300)
    torch.testing.assert_close(logits, hidden.float() @ weight.float().T, atol=1e-4, rtol=1e-5)
    assert logits.argmax(-1).tolist() == [0, 7, 299]


def _kernel_paths() -> list:
    """The C kernels as the engine runs them, and (where there are AMX tiles) without the tiles,
    so that vdpbf16ps takes every row count there too."""
    if KERNELS is None or not c_matmuls_take(torch.bfloat16, KERNELS):
        return []
    if not KERNELS.has_avx512_bf16:
        return [pytest.param(KERNELS, id="avx2-fma")]
    paths = [pytest.param(KERNELS, id="amx" if KERNELS.has_amx else "vdpbf16ps")]
    if KERNELS.has_amx:
        vector = copy.copy(KERNELS)
        vector.has_amx = False
        paths.append(pytest.param(vector, id="vdpbf16ps"))
    return paths


@needs_tiles
@pytest.mark.parametrize("kernels", _kernel_paths())
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 64])
@pytest.mark.parametrize("shape", [(64, 96), (37, 101), (96, 1100)])  # k padded; odd k
@pytest.mark.parametrize("gated", [False, True])
def test_bf16_linear_keeps_only_its_tile_copy(kernels, rows, shape, gated):
    """With avx512_bf16 every row count reads the tile copy, which replaces the weight: up to
    the GEMV's rows a GEMV on that copy, above the packed matmul (AMX tiles or vdpbf16ps)."""
    out_features, in_features = shape
    gated = gated and out_features % 32 == 0
    gen = torch.Generator().manual_seed(3)
    linear = Linear(in_features, out_features, bias=True, gated=gated)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    linear.bias.data = torch.randn(out_features, generator=gen).bfloat16()
    linear.weight.data = weight.clone()
    linear.prepare_for_cpu(kernels)
    assert linear.weight.numel() == 0 and linear.cpu_projection.tiles is not None
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    want = x.float() @ weight.float().T + linear.bias.float()
    out = linear(x)
    # Only the final rounding to bf16 and float32 summation order differ.
    torch.testing.assert_close(out.float(), want, atol=1e-3 * in_features**0.5, rtol=2**-8)
    assert torch.equal(linear(x.view(1, rows, in_features)), out.view(1, rows, out_features))
    if gated:  # SiLU in the matmul's epilogue at every row count: the same products
        assert torch.equal(linear.silu_and_mul(x), kernels.silu_and_mul(out))


@needs_tiles
@pytest.mark.parametrize("kernels", _kernel_paths())
@pytest.mark.parametrize("shape", [(64, 96), (96, 1100)])
@pytest.mark.parametrize("gated", [False, True])
def test_bf16_rows_are_the_same_bits_at_every_row_count_between_bounds(kernels, shape, gated):
    """A row's result does not depend on how many rows share the call, except across a bound
    path_changes names (the GEMV's last row count on the AMX tiles): a speculative verify step's
    rows then equal the rows decoded one by one (greedy, and seeded sampling, token for token)."""
    out_features, in_features = shape
    gen = torch.Generator().manual_seed(5)
    linear = Linear(in_features, out_features, bias=True, gated=gated)
    linear.weight.data = torch.randn(out_features, in_features, generator=gen).bfloat16()
    linear.bias.data = torch.randn(out_features, generator=gen).bfloat16()
    linear.prepare_for_cpu(kernels)
    projection = linear.cpu_projection
    most = 24
    bounds = projection.path_changes(most)
    assert bounds == ([projection.gemv_max_rows] if kernels.has_amx else []), bounds
    x = torch.randn(most, in_features, generator=gen).bfloat16()
    alone = torch.cat([linear(x[i : i + 1]) for i in range(most)])
    every = linear(x)  # past a bound: what the most rows give
    for rows in range(1, most + 1):
        want = alone if not bounds or rows <= bounds[0] else every
        assert torch.equal(linear(x[:rows]), want[:rows]), rows


@needs_tiles
def test_bf16_tied_embedding_reads_rows_from_the_heads_tile_copy():
    gen = torch.Generator().manual_seed(4)
    embed = VocabEmbedding(300, 72)  # k padded to whole tiles in the copy
    weight = torch.randn(300, 72, generator=gen).bfloat16()
    embed.weight.data = weight.clone()
    head = LMHead(300, 72, tied=embed)
    head.prepare_for_cpu(KERNELS)
    assert embed.weight.numel() == 0 and embed.rows_from is head.cpu_projection
    ids = torch.tensor([[0, 31, 32], [299, 17, 16]])
    assert torch.equal(embed(ids), weight[ids])
    with pytest.raises(IndexError, match="300"):
        embed(torch.tensor([300]))
    hidden = torch.randn(5, 72, generator=gen).bfloat16()
    torch.testing.assert_close(
        head(hidden), hidden.float() @ weight.float().T, atol=1e-3, rtol=1e-4
    )
