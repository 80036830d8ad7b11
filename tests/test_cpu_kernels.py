"""The C CPU kernels against the PyTorch ops they replace, and the engine without them."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import (
    MIXED_PROMPTS,
    assert_all_pages_free,
    bf16_decode_logits,
    build_llm,
    fused_decode_switch,
    greedy,
    hf_greedy,
    spy_logits,
)

from minisgl.env import ENV
from minisgl.kernel import cpu as cpu_mod
from minisgl.kernel.ops import rotate_halves as _rotate
from minisgl.layers.embedding import LMHead
from minisgl.layers.linear import (
    AMX_GEMV_MAX_ROWS,
    GEMV_MAX_ROWS,
    CpuProjection,
    c_matmuls_take,
)
from minisgl.layers.norm import RMSNorm

kernels = cpu_mod.cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="CPU kernels unavailable on this machine")


def _product_paths() -> list:
    """The kernels whose bf16 products run on the AMX tiles where the CPU has them, else with
    vdpbf16ps: both paths where there are tiles, the vdpbf16ps one wherever there is avx512_bf16."""
    if kernels is None or not kernels.has_avx512_bf16:
        return []
    vector = copy.copy(kernels)
    vector.has_amx = False
    paths = [pytest.param(vector, id="vdpbf16ps")]
    if kernels.has_amx:
        paths.append(pytest.param(kernels, id="tiles"))
    return paths


PRODUCT_PATHS = _product_paths()
# The packed matmuls' paths: those, or on AVX2 CPUs whose bf16 weights they take, the FMA form.
MATMUL_PATHS = PRODUCT_PATHS or (
    [pytest.param(kernels, id="avx2-fma")]
    if kernels is not None and c_matmuls_take(torch.bfloat16, kernels)
    else []
)
DTYPES = [torch.float32, torch.bfloat16]


def _reference_decode_attention(q, k_cache, v_cache, page_table, rows, kv_lens, window):
    outs = []
    group = q.shape[1] // k_cache.shape[1]
    for b in range(q.shape[0]):
        kv_len = int(kv_lens[b])
        start = max(0, kv_len - window) if window else 0
        slots = page_table[rows[b], start:kv_len].long()
        keys = k_cache[slots].float().transpose(0, 1).repeat_interleave(group, 0)
        values = v_cache[slots].float().transpose(0, 1).repeat_interleave(group, 0)
        scores = (q[b].float()[:, None, :] @ keys.transpose(1, 2)) / math.sqrt(q.shape[-1])
        outs.append((scores.softmax(-1) @ values)[:, 0])
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", DTYPES)
# More heads than a task holds (96: one kv head per task), head_dim 256, and 16 (portable path).
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim",
    [(9, 3, 64), (16, 8, 128), (96, 8, 64), (8, 2, 256), (4, 4, 16)],
)
@pytest.mark.parametrize("num_reqs", [1, 7])  # positions split across threads / whole requests
@pytest.mark.parametrize("window", [None, 17])
def test_decode_attention_matches_reference(dtype, heads, kv_heads, head_dim, num_reqs, window):
    gen = torch.Generator().manual_seed(0)
    slots = 3000
    k_cache = torch.randn(slots, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(slots, kv_heads, head_dim, generator=gen).to(dtype)
    page_table = torch.randint(0, slots, (10, 300), dtype=torch.int32, generator=gen)
    rows = torch.randperm(10, generator=gen)[:num_reqs]
    # 1 (a single key), a block boundary (64, 65) and a long one.
    kv_lens = torch.tensor([1, 64, 65, 299, 130, 2, 200][:num_reqs])
    q = torch.randn(num_reqs, heads, head_dim, generator=gen).to(dtype)
    out = kernels.decode_attention(
        q, k_cache, v_cache, page_table, rows, kv_lens, 1 / math.sqrt(head_dim), window
    )
    want = _reference_decode_attention(q, k_cache, v_cache, page_table, rows, kv_lens, window)
    atol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=0)


@pytest.mark.parametrize("rows", [1, 3, 4, 6, 8])
@pytest.mark.parametrize("out_features,in_features", [(96, 576), (37, 100), (8, 40)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_bf16_matches_float_matmul(rows, out_features, in_features, bias):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    want = x.float() @ weight.float().T + (0 if b is None else b.float())
    out = kernels.gemv_bf16(x, weight, b)
    assert out.dtype == torch.bfloat16
    # Only the final rounding to bf16 (and float32 summation order) differs.
    torch.testing.assert_close(out.float(), want, atol=1e-3, rtol=2**-8)


@pytest.mark.skipif(not MATMUL_PATHS, reason="bf16 weights take no C matmul on this CPU")
@pytest.mark.parametrize("matmul_kernels", MATMUL_PATHS)
@pytest.mark.parametrize("rows", [9, 16, 17, 40, 64, 100, 260, 300])
@pytest.mark.parametrize("out_features,in_features", [(96, 576), (37, 100), (8, 40), (70, 1100)])
@pytest.mark.parametrize("bias", [False, True])
def test_mid_sized_bf16_projection_matches_float_matmul(
    matmul_kernels, rows, out_features, in_features, bias
):
    """Above the GEMV: the packed matmul, on the AMX tiles where the CPU has them (odd shapes
    padded to whole tiles; from 256 rows by panels of columns, rows split by thread, k of 1,024
    and more in chunks), else with vdpbf16ps (k padded, rows in groups of 6)."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    projection = CpuProjection(weight, matmul_kernels)
    assert projection.tiles is not None
    out = projection(x, weight, b)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    want = x.float() @ weight.float().T + (0 if b is None else b.float())
    torch.testing.assert_close(out.float(), want, atol=1e-3, rtol=2**-8)


@pytest.mark.skipif(not MATMUL_PATHS, reason="bf16 weights take no C matmul on this CPU")
@pytest.mark.parametrize("matmul_kernels", MATMUL_PATHS)
def test_output_head_writes_float_logits_into_its_reused_buffer(matmul_kernels):
    """reuse_output: the float32 logits land in one buffer (the engine samples them before the
    next step), equal to a fresh call's; plain calls return tensors of their own."""
    gen = torch.Generator().manual_seed(5)
    head = LMHead(300, 96, tied=None)
    weight = torch.randn(300, 96, generator=gen).bfloat16()
    head.weight.data = weight.clone()
    head.prepare_for_cpu(matmul_kernels)  # its packed copy replaces the weight
    x = torch.randn(7, 96, generator=gen).bfloat16()
    fresh = head(x)
    first = head(x, reuse_output=True)
    assert first.dtype == torch.float32 and torch.equal(first, fresh)
    want = x.float() @ weight.float().T
    torch.testing.assert_close(first, want, atol=1e-4, rtol=1e-5)
    second = head(x[:3], reuse_output=True)  # fewer rows: the same buffer
    assert second.data_ptr() == first.data_ptr() and torch.equal(second, fresh[:3])
    assert head(x).data_ptr() != first.data_ptr()
    with pytest.raises(ValueError, match="out must be"):
        matmul_kernels.packed_linear(
            x, head.cpu_projection.tiles, 300, None, True, torch.empty(7, 299)
        )


@pytest.mark.skipif(not MATMUL_PATHS, reason="bf16 weights take no C matmul on this CPU")
@pytest.mark.parametrize("matmul_kernels", MATMUL_PATHS)
@pytest.mark.parametrize("rows", [9, 64, 260])  # above the GEMV; both tile orders
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("hidden", [96, 1100])  # k whole, k in chunks (from 260 rows)
def test_gated_projection_fuses_silu_into_the_packed_matmul(matmul_kernels, rows, bias, hidden):
    gen = torch.Generator().manual_seed(4)
    inter = 80
    x = torch.randn(rows, hidden, generator=gen).bfloat16()
    weight = torch.randn(2 * inter, hidden, generator=gen).bfloat16()
    b = torch.randn(2 * inter, generator=gen).bfloat16() if bias else None
    gated = CpuProjection(weight, matmul_kernels, gated=True, bias=b)
    assert gated.gated
    out = gated.silu_and_mul(x)
    assert out is not None and out.shape == (rows, inter)
    # The same products, SiLU after: bit for bit what the unfused kernels give.
    unfused = matmul_kernels.silu_and_mul(CpuProjection(weight, matmul_kernels)(x, weight, b))
    assert torch.equal(out, unfused)
    # Plain calls to a gated projection still return [gate | up] in order.
    plain = gated(x, weight, b)
    want = x.float() @ weight.float().T + (0 if b is None else b.float())
    torch.testing.assert_close(plain.float(), want, atol=1e-3, rtol=2**-8)
    # At the GEMV's row counts too (vdpbf16ps on the same copy).
    few = CpuProjection(weight, matmul_kernels, gated=True, bias=b).silu_and_mul(x[:4])
    assert torch.equal(
        few, matmul_kernels.silu_and_mul(CpuProjection(weight, matmul_kernels)(x[:4], weight, b))
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [1, 15, 16, 49152, 1000])
def test_argmax_matches_torch_max_with_ties_and_nans(dtype, cols):
    gen = torch.Generator().manual_seed(6)
    # Few distinct values: many ties, whose first column must win.
    x = torch.randint(-3, 4, (7, cols), generator=gen).to(dtype)
    if cols > 20:
        x[1, 5] = x[1, cols - 3] = float("nan")  # the first NaN wins
        x[2, cols - 1] = 100.0  # the max in the scalar tail
        x[3] = float("-inf")
    got = kernels.argmax(x)
    assert torch.equal(got, x.max(dim=-1).indices)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_module(dtype, with_residual):
    gen = torch.Generator().manual_seed(2)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.rand(576, generator=gen).to(dtype) + 0.5
    x = torch.randn(33, 576, generator=gen).to(dtype)
    residual = torch.randn(33, 576, generator=gen).to(dtype) if with_residual else None
    out, new_residual = kernels.add_rms_norm(x, residual, norm.weight, norm.eps)
    want_residual = x if residual is None else residual + x
    want = norm._norm(want_residual)
    assert torch.equal(new_residual, want_residual)
    # Equal but for float32 summation order inside the mean: at most one bf16 ulp, rarely.
    torch.testing.assert_close(out, want, atol=1e-6, rtol=2**-7 if dtype != torch.float32 else 1e-6)
    if dtype == torch.bfloat16:
        assert (out != want).float().mean() < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 40])  # vector body and scalar tail
def test_silu_and_mul_matches_torch(dtype, inter):
    gate_up = (torch.randn(9, 2 * inter, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    out = kernels.silu_and_mul(gate_up)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=2**-7 if dtype != torch.float32 else 1e-5)
    if dtype == torch.bfloat16:
        assert (out != want).float().mean() < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 20])
def test_rotary_matches_torch_in_place_on_strided_rows(dtype, head_dim):
    gen = torch.Generator().manual_seed(4)
    tokens, heads, max_pos = 11, 3, 50
    angles = torch.rand(max_pos, head_dim // 2, generator=gen) * 7
    cos = torch.cat([angles.cos()] * 2, dim=-1)
    sin = torch.cat([angles.sin()] * 2, dim=-1)
    fused = torch.randn(tokens, 2 * heads * head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen)
    q = fused[:, : heads * head_dim].view(tokens, heads, head_dim)  # strided rows, like qkv
    want = _rotate(q.clone(), cos[positions].to(dtype)[:, None], sin[positions].to(dtype)[:, None])
    untouched = fused[:, heads * head_dim :].clone()
    kernels.rotary_(q, positions, cos, sin)
    if dtype == torch.bfloat16:
        assert torch.equal(q, want)  # every product and sum rounded where torch rounds
    else:  # float32: the compiler may fuse a multiply-add (one rounding fewer)
        torch.testing.assert_close(q, want, atol=1e-6, rtol=1e-6)
    assert torch.equal(fused[:, heads * head_dim :], untouched)


@pytest.mark.parametrize("arch", ["mistral", "qwen3"])
def test_engine_without_kernels_matches_hf(arch, monkeypatch):
    """MINISGL_CPU_KERNELS=0: every op on the PyTorch path, still equal to HF."""
    monkeypatch.setattr(ENV.CPU_KERNELS, "value", False)
    cpu_mod.cpu_kernels.cache_clear()
    try:
        llm = build_llm(arch, page_size=4, max_running_req=3, cache_type="radix")
        assert type(llm.engine.attn_backend).__name__ == "TorchAttnBackend"
        max_new = [12, 5, 16, 9, 3, 14, 7, 10]
        outputs = llm.generate(MIXED_PROMPTS, [greedy(n) for n in max_new])
        expected = hf_greedy(arch, MIXED_PROMPTS, max_new)
        assert [o["token_ids"] for o in outputs] == expected
        assert_all_pages_free(llm)
        llm.shutdown()
    finally:
        cpu_mod.cpu_kernels.cache_clear()


def test_engine_uses_cpu_backend_by_default():
    llm = build_llm("smollm2", cache_type="naive")
    assert type(llm.engine.attn_backend).__name__ == "CpuAttnBackend"
    llm.shutdown()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_reqs", [2, 5])  # positions split across threads / whole requests
def test_decode_attention_continues_from_a_prefix_state(dtype, num_reqs):
    """Cascade: attention over positions [0, start) given as (out, lse) + the kernel over the
    rest equals attention over everything."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, head_dim, start = 8, 2, 64, 70
    k_cache = torch.randn(2000, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(2000, kv_heads, head_dim, generator=gen).to(dtype)
    page_table = torch.randint(0, 2000, (num_reqs, 200), dtype=torch.int32, generator=gen)
    rows = torch.arange(num_reqs)
    kv_lens = torch.tensor([71, 100, 199, 130, 140])[:num_reqs]
    q = torch.randn(num_reqs, heads, head_dim, generator=gen).to(dtype)
    scale = 1 / math.sqrt(head_dim)
    # The prefix state, from plain float32 math.
    outs, lses = [], []
    for b in range(num_reqs):
        slots = page_table[b, :start].long()
        keys = k_cache[slots].float().transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        values = v_cache[slots].float().transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        scores = (q[b].float()[:, None, :] @ keys.transpose(1, 2))[:, 0] * scale
        outs.append(scores.softmax(-1)[:, None, :].bmm(values)[:, 0])
        lses.append(scores.logsumexp(-1))
    prefix = (torch.full((num_reqs,), start), torch.stack(outs), torch.stack(lses))
    out = kernels.decode_attention(
        q, k_cache, v_cache, page_table, rows, kv_lens, scale, None, prefix
    )
    want = _reference_decode_attention(q, k_cache, v_cache, page_table, rows, kv_lens, None)
    atol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=0)


@pytest.mark.parametrize("arch", ["qwen3", "llama3"])  # head_dim 128 (vector) and 16 (portable)
def test_cascade_over_a_shared_system_prompt_matches_hf(arch, monkeypatch):
    from minisgl.attention import CpuAttnBackend

    monkeypatch.setattr(CpuAttnBackend, "cascade_min_prefix", 16)
    cascaded = {"prefill": 0, "decode": 0}
    prepare = CpuAttnBackend.prepare_metadata

    def spy(self, batch):
        prepare(self, batch)
        if getattr(batch.attn_metadata, "shared_slots", None) is not None:
            cascaded[batch.phase] += 1

    monkeypatch.setattr(CpuAttnBackend, "prepare_metadata", spy)
    llm = build_llm(arch, page_size=4, overlap_schedule=False)
    system = list(range(3000, 3050))
    llm.generate([system + [7]], greedy(1))  # cache the shared prompt first
    # Different question lengths, one request that shares nothing joins later batches. The
    # questions are longer than the extends the paged kernel prefills (paged_max_extend), so the
    # prefill reaches SDPA's shared-slot path where the CPU has no blocked kernel.
    longer = CpuAttnBackend.paged_max_extend
    prompts = [system + list(range(100 + i, 103 + longer + 2 * i)) for i in range(6)]
    prompts.append([11, 12, 13])
    max_new = [9, 4, 12, 6, 10, 3, 8]
    outputs = llm.generate(prompts, [greedy(n) for n in max_new])
    assert cascaded["prefill"] and cascaded["decode"], cascaded
    assert [o["token_ids"] for o in outputs] == hf_greedy(arch, prompts, max_new)
    assert_all_pages_free(llm)
    llm.shutdown()


@pytest.mark.skipif(not MATMUL_PATHS, reason="bf16 weights take no C matmul on this CPU")
@pytest.mark.parametrize("arch", ["smollm2", "qwen3", "mistral", "llama3"])
def test_fused_decode_layer_equals_the_module_path(arch, monkeypatch):
    """bf16 decode runs whole layers in C (GEMV batches, and above the GEMV's rows the packed
    matmul: AMX tiles or vdpbf16ps); its logits equal the module-by-module path's bit for bit
    (same kernels, same order), for every architecture's variant."""
    # More requests than the GEMV takes, so batches also run through the packed matmul.
    prompts = MIXED_PROMPTS + [p + " again" for p in MIXED_PROMPTS[1:4]]
    max_new = [6, 9, 4, 7, 5, 8, 3, 6, 5, 7, 4]
    fused_batches, set_fused = fused_decode_switch(monkeypatch)

    def decode_logits(fused: bool) -> tuple[list[torch.Tensor], list[list[int]]]:
        set_fused(fused)
        return bf16_decode_logits(arch, prompts, max_new)

    fused_logits, fused_ids = decode_logits(True)
    module_logits, module_ids = decode_logits(False)
    assert fused_batches, "the fused path never ran"
    assert max(fused_batches) > (AMX_GEMV_MAX_ROWS if kernels.has_amx else GEMV_MAX_ROWS)
    assert fused_ids == module_ids
    assert len(fused_logits) == len(module_logits)
    for got, want in zip(fused_logits, module_logits):
        assert torch.equal(got, want)


@pytest.mark.skipif(not MATMUL_PATHS, reason="bf16 weights take no C matmul on this CPU")
@pytest.mark.parametrize("arch", ["smollm2", "qwen3"])
def test_fused_cascade_decode_equals_the_module_path(arch, monkeypatch):
    """Decode batches whose requests share a cached system prompt run each fused layer in two
    C halves around the shared-prefix attention; logits equal the module path's bit for bit."""
    from minisgl.attention import CpuAttnBackend
    from minisgl.models.fused_decode import FusedDecode

    monkeypatch.setattr(CpuAttnBackend, "cascade_min_prefix", 16)
    system = list(range(3000, 3050))
    prompts = [system + list(range(100 + i, 103 + 2 * i)) for i in range(6)]
    max_new = [9, 4, 12, 6, 10, 3]
    cascade_steps = []
    run, cascade_args = FusedDecode.run, CpuAttnBackend.cascade_decode_args

    def spying_args(self, batch):
        args = cascade_args(self, batch)
        if args is not None:
            cascade_steps.append(len(batch.reqs))
        return args

    def decode_logits(fused: bool) -> tuple[list[torch.Tensor], list[list[int]]]:
        monkeypatch.setattr(FusedDecode, "run", run if fused else lambda self, *args: None)
        llm = build_llm(arch, dtype=torch.bfloat16, page_size=4, overlap_schedule=False)
        llm.generate([system + [7]], greedy(1))  # cache the shared prompt first
        logits = spy_logits(llm, "decode")
        outputs = llm.generate(prompts, [greedy(n) for n in max_new])
        assert_all_pages_free(llm)
        llm.shutdown()
        return logits, [o["token_ids"] for o in outputs]

    monkeypatch.setattr(CpuAttnBackend, "cascade_decode_args", spying_args)
    fused_logits, fused_ids = decode_logits(True)
    assert cascade_steps, "no cascade batch took the fused path"
    module_logits, module_ids = decode_logits(False)
    assert fused_ids == module_ids
    assert len(fused_logits) == len(module_logits)
    for got, want in zip(fused_logits, module_logits):
        assert torch.equal(got, want)


@pytest.mark.skipif(not PRODUCT_PATHS, reason="needs avx512_bf16")
@pytest.mark.parametrize("attn_kernels", PRODUCT_PATHS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (16, 8, 128), (4, 4, 96)])
@pytest.mark.parametrize("tokens,prefix_len", [(7, 1000), (40, 33), (1, 1)])
def test_shared_prefix_attention_matches_float_reference(
    attn_kernels, heads, kv_heads, head_dim, tokens, prefix_len
):
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn(1200, kv_heads, head_dim, generator=gen).bfloat16()
    v_cache = torch.randn(1200, kv_heads, head_dim, generator=gen).bfloat16()
    slots = torch.randperm(1200, generator=gen)[:prefix_len]
    q = torch.randn(tokens, heads, head_dim, generator=gen).bfloat16()
    scale = 1 / math.sqrt(head_dim)
    result = attn_kernels.shared_prefix_attention(q, k_cache, v_cache, slots, scale)
    assert result is not None
    out, lse = result
    group = heads // kv_heads
    keys = k_cache[slots].float().repeat_interleave(group, 1).transpose(0, 1)  # [heads, P, dim]
    values = v_cache[slots].float().repeat_interleave(group, 1).transpose(0, 1)
    scores = (q.float().transpose(0, 1) @ keys.transpose(1, 2)) * scale  # [heads, tokens, P]
    want_out = (scores.softmax(-1) @ values).transpose(0, 1)
    want_lse = scores.logsumexp(-1).transpose(0, 1)
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-5)
    # float32 probabilities (a bf16 part and a bf16 remainder), as PyTorch's SDPA keeps them.
    torch.testing.assert_close(out, want_out, atol=1e-4, rtol=0)


def _reference_prefill_attention(q, k_cache, v_cache, page_table, rows, cached, extend, window):
    outs, start = [], 0
    group = q.shape[1] // k_cache.shape[1]
    for row, cached_len, extend_len in zip(rows.tolist(), cached, extend):
        kv_len = cached_len + extend_len
        slots = page_table[row, :kv_len].long()
        keys = k_cache[slots].float().transpose(0, 1).repeat_interleave(group, 0)
        values = v_cache[slots].float().transpose(0, 1).repeat_interleave(group, 0)
        queries = q[start : start + extend_len].float().transpose(0, 1)
        start += extend_len
        scores = queries @ keys.transpose(1, 2) / math.sqrt(q.shape[-1])
        own = torch.arange(cached_len, kv_len)[:, None]
        key_pos = torch.arange(kv_len)[None, :]
        visible = key_pos <= own
        if window:
            visible &= key_pos > own - window
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append((scores.softmax(-1) @ values).transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.skipif(not PRODUCT_PATHS, reason="needs avx512_bf16")
@pytest.mark.parametrize("attn_kernels", PRODUCT_PATHS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (16, 8, 128), (4, 4, 96)])
@pytest.mark.parametrize("window", [None, 17])
@pytest.mark.parametrize(
    "cached,extend",
    [
        ([0, 100, 3, 0], [1, 40, 7, 130]),  # fresh prompts and radix hits mixed
        ([50], [300]),  # one long request: its tiles split over the threads
        ([0, 200, 31, 1, 0], [5, 1, 33, 64, 65]),  # block and tile boundaries
    ],
)
def test_prefill_attention_matches_float_reference(
    attn_kernels, heads, kv_heads, head_dim, window, cached, extend
):
    gen = torch.Generator().manual_seed(5)
    k_cache = torch.randn(3000, kv_heads, head_dim, generator=gen).bfloat16()
    v_cache = torch.randn(3000, kv_heads, head_dim, generator=gen).bfloat16()
    page_table = torch.randint(0, 3000, (10, 400), dtype=torch.int32, generator=gen)
    rows = torch.randperm(10, generator=gen)[: len(extend)]
    q = torch.randn(sum(extend), heads, head_dim, generator=gen).bfloat16()
    out = attn_kernels.prefill_attention(
        q,
        k_cache,
        v_cache,
        page_table,
        rows,
        torch.tensor(cached),
        torch.tensor(extend),
        1 / math.sqrt(head_dim),
        window,
    )
    assert out is not None and out.dtype == torch.bfloat16
    want = _reference_prefill_attention(
        q, k_cache, v_cache, page_table, rows, cached, extend, window
    )
    # Within the bf16 rounding of the output: the probabilities stay float32, as in SDPA.
    torch.testing.assert_close(out.float(), want, atol=1e-3, rtol=2**-8)


@pytest.mark.skipif(not PRODUCT_PATHS, reason="needs avx512_bf16")
@pytest.mark.parametrize("arch", ["smollm2", "qwen3"])  # without and with q/k norms
def test_prefill_attention_block_equals_the_module_path(arch, monkeypatch):
    """The prefill attention block (one C call) runs the module path's kernels per row: the
    prefill logits are the same bit for bit, chunked and batched."""
    from minisgl.attention.cpu_backend import CpuAttnBackend

    calls = []
    block = CpuAttnBackend.attention_block

    def counting_block(self, layer, qkv, positions, batch):
        out = block(self, layer, qkv, positions, batch)
        if batch.is_prefill:
            calls.append(out is not None)
        return out

    def prefill_logits(in_block: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(
            CpuAttnBackend,
            "attention_block",
            counting_block if in_block else (lambda self, layer, qkv, positions, batch: None),
        )
        llm = build_llm(arch, dtype=torch.bfloat16, cache_type="naive", max_prefill_length=32)
        logits = spy_logits(llm, "prefill")
        llm.generate(MIXED_PROMPTS, greedy(1))
        assert_all_pages_free(llm)
        llm.shutdown()
        return logits

    with_block, without = prefill_logits(True), prefill_logits(False)
    assert calls and all(calls)
    assert len(with_block) == len(without)
    for got, want in zip(with_block, without):
        assert torch.equal(got, want)


@pytest.mark.skipif(not PRODUCT_PATHS, reason="needs avx512_bf16")
def test_prefill_kernel_matches_sdpa_inside_the_engine(monkeypatch):
    """bf16 with radix hits, pages of 4 and chunks of 16: each prefill layer's attention block
    (norms, rotary, KV store and the C kernel in one call) against the torch backend's SDPA on
    the q/k/v it prepared and the same pool."""
    from minisgl.attention.cpu_backend import CpuAttnBackend, CpuPrefillMetadata
    from minisgl.attention.torch_backend import TorchAttnBackend

    cached_seen: list[int] = []
    in_kernel = CpuAttnBackend.attention_block

    def prefill_block(backend, layer, qkv, positions, batch):
        out = in_kernel(backend, layer, qkv, positions, batch)
        if out is None or batch.is_decode:  # e.g. a cascade over a shared prefix
            return out
        meta = batch.attn_metadata
        assert isinstance(meta, CpuPrefillMetadata)
        rope = layer.rotary.prepare(positions, qkv.dtype)
        q, k, v = layer.qkv_inputs(qkv, rope)  # from the projection, left as it was
        TorchAttnBackend.prepare_metadata(backend, batch)
        want = TorchAttnBackend.forward(backend, q, k, v, layer.layer_id, batch)
        batch.attn_metadata = meta
        torch.testing.assert_close(out.float(), want.float().flatten(1), atol=2e-2, rtol=2e-2)
        cached_seen.append(int(meta.cached_lens.max()))
        return out

    monkeypatch.setattr(CpuAttnBackend, "attention_block", prefill_block)
    llm = build_llm(
        "smollm2", dtype=torch.bfloat16, cache_type="radix", page_size=4, max_prefill_length=16
    )
    # 93 tokens in chunks of 16, others sharing its start (hits on the second round).
    prompts = [MIXED_PROMPTS[3], MIXED_PROMPTS[3] + " and then", MIXED_PROMPTS[4]]
    for _ in range(2):  # the second round starts from radix hits
        llm.generate(prompts, greedy(3))
    assert cached_seen and max(cached_seen) > 16  # chunks and hits were among the checked
    assert_all_pages_free(llm)
    llm.shutdown()
