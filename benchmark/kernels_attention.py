"""cpu_kernels.py's attention cases: decode attention over the page table, cascade attention's
shared prefix and causal prefill, each against the PyTorch path it replaces."""

from __future__ import annotations

import argparse
import math

import paths  # noqa: F401  (before minisgl: a checkout without `pip install -e .`)
import torch
import torch.nn.functional as F
from timing import Comparison, median_seconds

from minisgl.kernel.cpu import CpuKernels

BF16 = torch.bfloat16


def attention_case(
    kernels: CpuKernels, args: argparse.Namespace, batch: int, context: int
) -> Comparison:
    """Decode attention of `batch` requests x `context` positions over every layer."""
    slots = batch * context
    shape = (slots, args.kv_heads, args.head_dim)
    k_caches = [torch.randn(shape, dtype=BF16) for _ in range(args.layers)]
    v_caches = [torch.randn(shape, dtype=BF16) for _ in range(args.layers)]
    table = torch.randperm(slots, dtype=torch.int32).view(batch, context)
    table_rows, kv_lens = torch.arange(batch), torch.full((batch,), context)
    q = torch.randn(batch, args.heads, args.head_dim, dtype=BF16)
    scale = 1 / math.sqrt(args.head_dim)
    indices = table.flatten().long()
    mask = torch.ones(batch, 1, 1, context, dtype=torch.bool)
    padded = (batch, context, args.kv_heads, args.head_dim)

    def kernel() -> None:
        for k_cache, v_cache in zip(k_caches, v_caches):
            kernels.decode_attention(q, k_cache, v_cache, table, table_rows, kv_lens, scale, None)

    def baseline() -> None:
        for k_cache, v_cache in zip(k_caches, v_caches):
            keys = k_cache.index_select(0, indices).view(padded).transpose(1, 2)
            values = v_cache.index_select(0, indices).view(padded).transpose(1, 2)
            F.scaled_dot_product_attention(
                q.unsqueeze(2), keys, values, attn_mask=mask, enable_gqa=True
            )

    label = f"decode attention, batch {batch} x {context} positions, {args.layers} layers"
    return label, "gather + SDPA", median_seconds(baseline, 3), median_seconds(kernel, 3)


def shared_prefix_case(
    kernels: CpuKernels, args: argparse.Namespace, tokens: int, prefix_len: int
) -> Comparison:
    """Cascade attention's shared half: `tokens` queries over one `prefix_len`-position prefix,
    every layer (AMX tiles vs SDPA's flash kernel, as attention/cpu_backend.py calls it)."""
    shape = (prefix_len + 64, args.kv_heads, args.head_dim)
    k_caches = [torch.randn(shape, dtype=BF16) for _ in range(args.layers)]
    v_caches = [torch.randn(shape, dtype=BF16) for _ in range(args.layers)]
    slots = torch.arange(32, 32 + prefix_len)
    q = torch.randn(tokens, args.heads, args.head_dim, dtype=BF16)
    scale = 1 / math.sqrt(args.head_dim)
    group = args.heads // args.kv_heads

    def kernel() -> None:
        for k_cache, v_cache in zip(k_caches, v_caches):
            kernels.shared_prefix_attention(q, k_cache, v_cache, slots, scale)

    def baseline() -> None:
        queries = q.view(tokens, args.kv_heads, group, args.head_dim).permute(1, 2, 0, 3)
        queries = queries.reshape(1, args.kv_heads, group * tokens, args.head_dim)
        for k_cache, v_cache in zip(k_caches, v_caches):
            keys = k_cache.index_select(0, slots).transpose(0, 1)[None]
            values = v_cache.index_select(0, slots).transpose(0, 1)[None]
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                queries, keys, values, scale=scale
            )

    label = (
        f"shared-prefix attention, {tokens} queries x {prefix_len} positions, {args.layers} layers"
    )
    return label, "SDPA flash", median_seconds(baseline, 3), median_seconds(kernel, 3)


def prefill_attention_case(
    kernels: CpuKernels, args: argparse.Namespace, requests: int, tokens: int
) -> Comparison:
    """Causal prefill of `requests` fresh prompts of `tokens` tokens, every layer: the AMX tiles
    over the pool vs SDPA's causal path on the new q/k/v (as the torch backend runs it)."""
    slots = requests * tokens
    shape = (slots, args.kv_heads, args.head_dim)
    k_caches = [torch.randn(shape, dtype=BF16) for _ in range(args.layers)]
    v_caches = [torch.randn(shape, dtype=BF16) for _ in range(args.layers)]
    table = torch.arange(slots, dtype=torch.int32).view(requests, tokens)
    q = torch.randn(slots, args.heads, args.head_dim, dtype=BF16)
    rows, cached = torch.arange(requests), torch.zeros(requests, dtype=torch.int64)
    extend = torch.full((requests,), tokens)
    scale = 1 / math.sqrt(args.head_dim)

    def kernel() -> None:
        for k_cache, v_cache in zip(k_caches, v_caches):
            kernels.prefill_attention(q, k_cache, v_cache, table, rows, cached, extend, scale, None)

    def heads_first(x: torch.Tensor) -> torch.Tensor:
        return x.view(requests, tokens, *x.shape[1:]).transpose(1, 2)

    def baseline() -> None:
        for k_cache, v_cache in zip(k_caches, v_caches):
            F.scaled_dot_product_attention(
                heads_first(q),
                heads_first(k_cache),
                heads_first(v_cache),
                is_causal=True,
                enable_gqa=True,
            )

    label = f"prefill attention, {requests} x {tokens} tokens, {args.layers} layers"
    return label, "SDPA causal", median_seconds(baseline, 3), median_seconds(kernel, 3)
