"""The C CPU kernels against the PyTorch ops they replace, on SmolLM2-135M's shapes (or any).

Each row times both sides in this process on the same inputs and prints the ratio
(PyTorch time / kernel time). Weights cycle through all layers, so they come from memory as
in a real decode step, not from cache.

Run from the repo root: `python benchmark/kernels.py` (about a minute).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

try:
    import minisgl  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from minisgl.engine.sample import PenaltyArgs, SampleArgs, Sampler
from minisgl.kernel.cpu import CpuKernels, cpu_kernels
from minisgl.layers.linear import interleave_gate_up, onednn_pack

BF16 = torch.bfloat16


def seconds(fn: Callable[[], object], repeat: int) -> float:
    """Median wall time of one call, after a warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


Row = tuple[str, str, float, float]  # label, baseline name, baseline s, kernel s


def gemv_case(
    kernels: CpuKernels, weights: list[torch.Tensor], packed: list[torch.Tensor] | None, rows: int
) -> Row:
    """`rows` input rows through every weight: the C GEMV vs oneDNN (packed) or F.linear."""
    xs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=BF16) for w in weights}

    def gemv() -> None:
        for w in weights:
            kernels.gemv_bf16(xs[w.shape[1]], w, None)

    def baseline() -> None:
        for i, w in enumerate(weights):
            x = xs[w.shape[1]]
            if packed is None:
                F.linear(x, w)
            else:
                torch.ops.mkldnn._linear_pointwise(x, packed[i], None, "none", [], "")

    mbytes = sum(w.numel() * 2 for w in weights) / 1e6
    name = "F.linear" if packed is None else "oneDNN packed"
    return (
        f"GEMV {rows} row(s), {mbytes:.0f} MB of weights",
        name,
        seconds(baseline, 5),
        seconds(gemv, 5),
    )


def packed_case(
    kernels: CpuKernels, weights: list[torch.Tensor], packed: list[torch.Tensor], rows: int
) -> Row:
    """`rows` input rows through every weight: the C packed matmul (AMX tiles or vdpbf16ps) vs
    oneDNN (packed)."""
    xs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=BF16) for w in weights}
    tiles = [kernels.pack_weight(w) for w in weights]

    def kernel() -> None:
        for w, t in zip(weights, tiles):
            kernels.packed_linear(xs[w.shape[1]], t, w.shape[0], None)

    def baseline() -> None:
        for w, p in zip(weights, packed):
            torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")

    mbytes = sum(w.numel() * 2 for w in weights) / 1e6
    products = "AMX" if kernels.has_amx else "vdpbf16ps"
    label = f"packed matmul ({products}) {rows} rows, {mbytes:.0f} MB of weights"
    return label, "oneDNN packed", seconds(baseline, 5), seconds(kernel, 5)


def streamed_case(kernels: CpuKernels, weights: list[torch.Tensor], rows: int) -> Row:
    """`rows` input rows through every weight as the engine multiplies a few rows: vdpbf16ps
    streaming the tile copy (the weight's only copy) vs the C GEMV over the row-major weight
    (what it ran while it kept both)."""
    xs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=BF16) for w in weights}
    tiles = [kernels.pack_weight(w) for w in weights]

    def kernel() -> None:
        for w, t in zip(weights, tiles):
            kernels.packed_linear(xs[w.shape[1]], t, w.shape[0], None, tiles=False)

    def baseline() -> None:
        for w in weights:
            kernels.gemv_bf16(xs[w.shape[1]], w, None)

    mbytes = sum(w.numel() * 2 for w in weights) / 1e6
    label = f"tile copy streamed (vdpbf16ps) {rows} row(s), {mbytes:.0f} MB of weights"
    return label, "C GEMV, row-major", seconds(baseline, 5), seconds(kernel, 5)


def float32_case(weights: list[torch.Tensor], packed: list[torch.Tensor], rows: int) -> Row:
    """float32 projections, `rows` input rows through every weight: oneDNN's packed copy (what
    layers/linear.py runs for float32) vs F.linear (MKL's sgemm, a generic path on AMD)."""
    xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}

    def onednn() -> None:
        for w, p in zip(weights, packed):
            torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")

    def baseline() -> None:
        for w in weights:
            F.linear(xs[w.shape[1]], w)

    mbytes = sum(w.numel() * 4 for w in weights) / 1e6
    label = f"float32 projection (oneDNN packed) {rows} rows, {mbytes:.0f} MB of weights"
    return label, "F.linear", seconds(baseline, 5), seconds(onednn, 5)


def attention_case(kernels: CpuKernels, args: argparse.Namespace, batch: int, context: int) -> Row:
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
    return label, "gather + SDPA", seconds(baseline, 3), seconds(kernel, 3)


def shared_prefix_case(
    kernels: CpuKernels, args: argparse.Namespace, tokens: int, prefix_len: int
) -> Row:
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
    return label, "SDPA flash", seconds(baseline, 3), seconds(kernel, 3)


def prefill_attention_case(
    kernels: CpuKernels, args: argparse.Namespace, requests: int, tokens: int
) -> Row:
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
    return label, "SDPA causal", seconds(baseline, 3), seconds(kernel, 3)


def gated_case(kernels: CpuKernels, args: argparse.Namespace, tokens: int) -> Row:
    """gate_up projection + SiLU-and-mul over every layer: one packed matmul with SiLU in its
    store vs the packed matmul and the separate kernel."""
    weights = [
        torch.randn(2 * args.intermediate, args.hidden, dtype=BF16) * 0.02
        for _ in range(args.layers)
    ]
    plain = [kernels.pack_weight(w) for w in weights]
    gated = [kernels.pack_weight(interleave_gate_up(w)) for w in weights]
    x = torch.randn(tokens, args.hidden, dtype=BF16)

    def kernel() -> None:
        for packed in gated:
            kernels.packed_gated_silu(x, packed, args.intermediate, None)

    def baseline() -> None:
        for packed in plain:
            kernels.silu_and_mul(kernels.packed_linear(x, packed, 2 * args.intermediate, None))

    label = f"gate_up + SiLU, {tokens} rows, {args.layers} layers"
    return label, "packed matmul + SiLU", seconds(baseline, 5), seconds(kernel, 5)


def argmax_case(kernels: CpuKernels, rows: int, vocab: int) -> Row:
    """Greedy sampling of bf16 logits: the C argmax vs a float32 copy and torch.max."""
    logits = torch.randn(rows, vocab, dtype=BF16)
    return (
        f"argmax, {rows} x {vocab} bf16 logits",
        "float() + max",
        seconds(lambda: logits.float().max(dim=-1).indices, 20),
        seconds(lambda: kernels.argmax(logits), 20),
    )


def sampling_cases(rows: int, vocab: int) -> list[Row]:
    """Sampling with temperature (and top-p) from float32 logits: `Sampler.sample` vs the
    plain PyTorch formulation it replaced (softmax, exponential_, full sort for top-p)."""
    logits = torch.randn(rows, vocab) * 6  # peaked, as a trained model's
    sampler = Sampler(vocab, torch.device("cpu"))
    pool = torch.zeros(rows, 1, dtype=torch.int32)
    temps, top_p = torch.full((rows, 1), 0.7), torch.full((rows, 1), 0.9)
    no_greedy = torch.zeros(rows, dtype=torch.bool)

    def plain(nucleus: bool) -> None:
        probs = torch.softmax(logits / temps, dim=-1)
        if nucleus:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(drop, 0))
        (probs / torch.empty_like(probs).exponential_()).max(dim=-1)

    cases = []
    for nucleus in (False, True):
        args = SampleArgs(False, no_greedy, temps, top_p=top_p if nucleus else None)
        cases.append(
            (
                f"sampling, temperature{' + top-p' if nucleus else ''}, {rows} x {vocab}",
                "PyTorch ops",
                seconds(lambda nucleus=nucleus: plain(nucleus), 5),
                seconds(lambda args=args: sampler.sample(logits, args, pool), 5),
            )
        )
    return cases


def penalties_case(rows: int, vocab: int, history: int) -> Row:
    """Presence, frequency and repetition penalties on every row (`history` tokens each, half
    generated): the sampler's pass over the history's entries vs the vocabulary-wide one."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=gen)
    pool = torch.randint(0, vocab, (rows, history), dtype=torch.int32, generator=gen)

    def column(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full((rows, 1), value, dtype=dtype)

    pen = PenaltyArgs(
        torch.arange(rows),
        torch.arange(rows),
        column(history // 2, torch.int64),
        column(history, torch.int64),
        column(0.5),
        column(0.3),
        column(1.1),
    )

    def dense() -> torch.Tensor:
        tokens = pool.long()
        known = torch.ones(rows, history)
        generated = (torch.arange(history) >= history // 2).float().expand(rows, -1)
        counts = logits.new_zeros(rows, vocab).scatter_add_(1, tokens, generated)
        seen = logits.new_zeros(rows, vocab).scatter_add_(1, tokens, known) > 0
        scaled = torch.where(logits > 0, logits / pen.repetition, logits * pen.repetition)
        out = torch.where(seen, scaled, logits) - pen.frequency * counts
        return out - pen.presence * (counts > 0).float()

    sampler = Sampler(vocab, torch.device("cpu"))
    return (
        f"penalties, {rows} x {vocab}, {history} tokens of history",
        "vocabulary-wide ops",
        seconds(dense, 5),
        seconds(lambda: sampler._apply_penalties(logits, pen, pool), 5),
    )


def elementwise_cases(kernels: CpuKernels, tokens: int, hidden: int, inter: int) -> list[Row]:
    """Residual + RMSNorm and SiLU-and-mul on `tokens` rows: kernel vs the PyTorch ops."""
    x = torch.randn(tokens, hidden, dtype=BF16)
    residual = torch.randn(tokens, hidden, dtype=BF16)
    weight = torch.rand(hidden, dtype=BF16)
    gate_up = torch.randn(tokens, 2 * inter, dtype=BF16)

    def torch_norm() -> None:
        h32 = (residual + x).float()
        weight * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(BF16)

    def torch_silu() -> None:
        F.silu(gate_up[:, :inter]) * gate_up[:, inter:]

    return [
        (
            f"residual + RMSNorm, {tokens} x {hidden}",
            "PyTorch ops",
            seconds(torch_norm, 20),
            seconds(lambda: kernels.add_rms_norm(x, residual, weight, 1e-5), 20),
        ),
        (
            f"SiLU-and-mul, {tokens} x {inter}",
            "PyTorch ops",
            seconds(torch_silu, 20),
            seconds(lambda: kernels.silu_and_mul(gate_up), 20),
        ),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = cpu_kernels()
    if kernels is None:
        sys.exit("CPU kernels unavailable here (no gcc, not x86-64 Linux, or disabled)")
    print(
        f"# {torch.get_num_threads()} threads, avx512_bf16: {kernels.has_avx512_bf16}, "
        f"amx: {kernels.has_amx}"
    )
    q_width = args.heads * args.head_dim
    kv_width = args.kv_heads * args.head_dim
    shapes = [(q_width + 2 * kv_width, args.hidden), (args.hidden, q_width)]
    shapes += [(2 * args.intermediate, args.hidden), (args.hidden, args.intermediate)]
    rows: list[Row] = []
    if kernels.has_avx512_bf16:
        weights = [
            torch.randn(n, k, dtype=BF16) * 0.02 for _ in range(args.layers) for n, k in shapes
        ]
        onednn = [onednn_pack(w) for w in weights]
        packed = None if any(p is None for p in onednn) else [p for p in onednn if p is not None]
        rows += [gemv_case(kernels, weights, packed, n) for n in (1, 2, 4)]
        rows += [streamed_case(kernels, weights, n) for n in (1, 2, 4, 8)]
        if packed is not None:
            rows += [packed_case(kernels, weights, packed, n) for n in (16, 32, 64, 256, 2048)]
    weights32 = [torch.randn(n, k) * 0.02 for _ in range(args.layers) for n, k in shapes]
    packed32 = [p for p in map(onednn_pack, weights32) if p is not None]
    if len(packed32) == len(weights32):
        rows += [float32_case(weights32, packed32, n) for n in (1, 16, 64, 2048)]
    del weights32, packed32
    rows += [attention_case(kernels, args, b, c) for b, c in ((1, 1024), (16, 512), (64, 192))]
    if kernels.blocked_attention_fits(BF16, args.head_dim):
        rows += [shared_prefix_case(kernels, args, t, 1024) for t in (63, 2016)]
        rows += [prefill_attention_case(kernels, args, r, t) for r, t in ((16, 128), (1, 2048))]
    if kernels.has_avx512_bf16 and args.intermediate % 16 == 0:
        rows += [gated_case(kernels, args, t) for t in (64, 2048)]
    rows.append(argmax_case(kernels, 64, 49152))
    rows += sampling_cases(64, 151936)
    rows.append(penalties_case(64, 151936, 256))
    for tokens in (1, 64, 2048):
        rows += elementwise_cases(kernels, tokens, args.hidden, args.intermediate)
    print("| operation | baseline | baseline ms | kernel ms | speedup |")
    print("|-----------|----------|-------------|-----------|---------|")
    for label, name, base, kernel in rows:
        print(
            f"| {label} | {name} | {base * 1e3:.3f} | {kernel * 1e3:.3f} | {base / kernel:.2f}x |"
        )


if __name__ == "__main__":
    main()
