"""Projections on the CPU without the C kernels: float32 (and any dtype the kernels do not take)
multiplies through oneDNN's packed copy of the weight instead of F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minisgl.layers.embedding import LMHead, VocabEmbedding
from minisgl.layers.linear import Linear, onednn_pack

needs_onednn = pytest.mark.skipif(
    onednn_pack(torch.zeros(8, 8)) is None, reason="oneDNN cannot pack float32 here"
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
def test_float32_tied_head_keeps_the_embedding_for_lookups():
    gen = torch.Generator().manual_seed(1)
    embed = VocabEmbedding(300, 64)
    embed.weight.data = torch.randn(300, 64, generator=gen)
    head = LMHead(300, 64, tied=embed)
    head.prepare_for_cpu(None)
    assert head.cpu_projection is not None and embed.weight.shape == (300, 64)
    ids = torch.tensor([0, 7, 299])
    hidden = embed(ids)
    logits = head(hidden, reuse_output=True)
    assert logits.dtype == torch.float32 and logits.shape == (3, 300)
    torch.testing.assert_close(logits, hidden @ embed.weight.T, atol=1e-4, rtol=1e-5)
    assert logits.argmax(-1).tolist() == [0, 7, 299]
