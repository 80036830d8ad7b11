"""Quantized weights: every layout the kernels take equals dequantize-then-matmul within its
arithmetic's rounding (exact dequantization, bf16 rounding where the activations are bf16),
stacked and re-laid-out weights keep their values exactly, and quantized engines in float32 give
their dequantized weights' logits (HF's float64 on them) within float32's accumulation noise:
int8/int4 at load, and the default model served from its own Q4_1 GGUF. As quality figures,
their top-1 agreement with the dense model (bf16 activations, for the GGUF)."""

from __future__ import annotations

import copy
from typing import cast

import pytest
import torch
from helpers import (
    LONG_TEXT,
    MIXED_PROMPTS,
    assert_all_pages_free,
    assert_logits_match_hf,
    assert_logits_match_models,
    bf16_decode_logits,
    build_llm,
    fused_decode_switch,
    greedy,
    hf_encode,
    hf_logits,
    spy_logits,
    tiny_model,
)

from minisgl.core import SamplingParams
from minisgl.engine.config import EngineConfig
from minisgl.kernel.cpu import CpuKernels, cpu_kernels
from minisgl.kernel.quantized import QUANTIZED_AMX_MIN_ROWS
from minisgl.layers.quant_weight import (
    QuantizedWeight,
    as_8bit,
    concat_rows,
    narrow,
    pack_nibbles,
    quantize_int4,
    quantize_int8,
)
from minisgl.layers.quantized import (
    AVX2_TILED_MAX_ROWS,
    QUANTIZED_GEMV_MAX_ROWS,
    QuantizedProjection,
    int8_group,
    quantize,
    quantize_head,
)

KERNELS = cpu_kernels()


def _tile_kernels() -> CpuKernels | None:
    """Kernels with the tile layout and AMX: this CPU's, or the emulated Xeon build where it
    has neither (tests/test_kernel_fuzz.py), so that the tile layout's tests run everywhere."""
    if KERNELS is None or (KERNELS.has_vnni and KERNELS.has_amx):
        return KERNELS
    from test_kernel_fuzz import form

    return form("avx512-bf16-amx-emulated+amx")


TILE_KERNELS = _tile_kernels()
PROMPTS = [p for p in MIXED_PROMPTS if isinstance(p, str)]
# 80 tokens: a prefill of them all multiplies the quantized weights in the C kernels (up to
# QUANTIZED_GEMV_MAX_ROWS rows); PROMPTS' 173 take the weights dequantized once per call.
SHORT_PROMPTS = [p for p in PROMPTS if p != LONG_TEXT]


def _layouts(weight: torch.Tensor) -> dict[str, QuantizedWeight]:
    """Every layout the kernels take, from one weight [N, 256]."""
    gen = torch.Generator().manual_seed(3)
    g32 = quantize_int4(weight, 32)
    symmetric4 = QuantizedWeight(g32.values, g32.scales, None, 4, 32)
    k_quant_like = QuantizedWeight(  # float32 scales and mins, as Q4_K's
        g32.values, g32.scales.float() * 1.5, g32.mins.float(), 4, 32
    )
    # Float32 scales with few significant bits, as every source's are (Q6_K: d * sc), so that
    # values * scales is exact and the kernels' fused multiply-add rounds as the reference.
    int8_mins = QuantizedWeight(
        quantize_int8(weight, 16).values,
        (torch.rand(weight.shape[0], 16, generator=gen) / 64).half().float(),
        (torch.randn(weight.shape[0], 16, generator=gen) / 64).half().float(),
        8,
        16,
    )
    return {
        "int8 per row": quantize_int8(weight),
        "int8 g32 (Q8_0)": quantize_int8(weight, 32),
        "int8 g16 with mins": int8_mins,
        "int4 g32 (Q4_1)": g32,
        "int4 g32 symmetric": symmetric4,
        "int4 g32 float32 scales": k_quant_like,
        "int4 g64": quantize_int4(weight, 64),
        "int4 g128": quantize_int4(weight, 128),
        "int4 as 8-bit": as_8bit(g32),
        # 8-bit integers within -32..31 in groups of 32: tiled in 6 bits.
        "int6 g32 (the int4 head)": quantize_int8(weight, 32, limit=31, scale_dtype=torch.float16),
        "int6 g16 (Q6_K-like)": QuantizedWeight(
            torch.randint(-32, 32, weight.shape, generator=gen, dtype=torch.int8),
            (torch.rand(weight.shape[0], 16, generator=gen) / 64).half().float(),
            None,
            8,
            16,
        ),
        "int6 g64 with mins (Q5_1-like)": QuantizedWeight(
            torch.randint(0, 32, weight.shape, generator=gen, dtype=torch.int8),
            (torch.rand(weight.shape[0], 4, generator=gen) / 32).half(),
            (torch.randn(weight.shape[0], 4, generator=gen) / 8).half(),
            8,
            64,
        ),
    }


@pytest.mark.skipif(not TILE_KERNELS, reason="the C kernels are not built here")
def test_six_bit_integers_tile_in_six_bits() -> None:
    """8-bit weights whose integers fit -32..31 take 6 bits a weight in the tile layout (the
    int4 method's output head: 0.82 of int8's bytes; Q6_K's groups of 16), the same values."""
    weight = torch.randn(40, 256, generator=torch.Generator().manual_seed(8))
    head = quantize_head(weight, "int4")
    assert head.bits == 8 and head.group == 32 and int(head.values.abs().max()) <= 31
    projection = QuantizedProjection(head, TILE_KERNELS, tiled=True)
    assert projection.weight.bits == 6
    assert projection.weight.values.numel() == 48 * 256 * 6 // 8  # 40 rows in 3 tiles
    lookup = projection.rows(torch.arange(40), torch.float32)
    assert torch.equal(lookup, head.dequantize())
    assert QuantizedProjection(quantize_head(weight, "int8"), TILE_KERNELS).weight.bits == 8
    q6_k_like = QuantizedWeight(head.values, head.scales.float().repeat(1, 2), None, 8, 16)
    assert QuantizedProjection(q6_k_like, TILE_KERNELS, tiled=True).weight.bits == 6  # 16 columns


def test_narrow_cuts_rows_and_whole_groups_of_columns_exactly() -> None:
    """A tensor-parallel shard of each layout: rows, or columns at group bounds (4 bits that are
    not whole 64-column blocks in the 8-bit layout), equal the dequantized weight's; columns
    that cut a group give None."""
    weight = torch.randn(12, 256, generator=torch.Generator().manual_seed(4))
    for name, qweight in _layouts(weight).items():
        dense, group = qweight.dequantize(), qweight.group
        rows = narrow(qweight, 0, 4, 6)
        assert rows is not None and torch.equal(rows.dequantize(), dense[4:10]), name
        for start, length in ((0, 128), (128, 128), (group, group)):
            if start + length > 256 or length % group or start % group:
                continue
            cols = narrow(qweight, 1, start, length)
            assert cols is not None, name
            want = dense[:, start : start + length]
            assert torch.equal(cols.dequantize(), want), (name, start, length)
            assert cols.bits == (4 if qweight.bits == 4 and length % 64 == 0 else 8), name
        assert narrow(qweight, 1, group // 2, group // 2) is None, name
    with pytest.raises(ValueError, match="columns \\[192, 320\\)"):
        narrow(quantize_int4(weight, 32), 1, 192, 128)


def test_quantize_rounds_to_the_nearest_step() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 128, generator=gen)
    weight[3] = 0.0  # an all-zero row keeps a usable scale
    q8 = quantize_int8(weight)
    assert q8.values.abs().max() <= 127 and q8.scales[3, 0] == 1.0
    step8 = q8.scales.repeat_interleave(q8.group, dim=1)
    assert torch.all((q8.dequantize() - weight).abs() <= step8 / 2 + 1e-7)
    q4 = quantize_int4(weight, 32)
    assert q4.values.dtype == torch.uint8 and q4.scales.dtype == torch.float16
    step4 = q4.scales.float().repeat_interleave(32, dim=1)
    # The float16 offset and scale round too: at most a step off, never more.
    assert torch.all((q4.dequantize() - weight).abs() <= step4 * 1.01 + 1e-3)
    assert torch.equal(q4.dequantize()[3], torch.zeros(128))


def test_nibbles_round_trip_and_layouts_convert_exactly() -> None:
    gen = torch.Generator().manual_seed(1)
    integers = torch.randint(0, 16, (5, 192), generator=gen)
    packed = pack_nibbles(integers)
    assert packed.shape == (5, 96) and packed.dtype == torch.uint8
    weight = QuantizedWeight(packed, torch.ones(5, 6, dtype=torch.float16), None, 4, 32)
    assert torch.equal(weight.integers(), integers.to(torch.int16))
    layouts = list(_layouts(torch.randn(24, 256, generator=gen)).values())
    stacked = concat_rows(layouts)
    assert stacked.bits == 8 and stacked.group == 16 and stacked.scales.dtype == torch.float32
    assert torch.equal(stacked.dequantize(), torch.cat([w.dequantize() for w in layouts]))
    same = concat_rows(layouts[3:4] * 2)
    assert same.bits == 4 and torch.equal(same.values, torch.cat([layouts[3].values] * 2))


def test_bad_layouts_are_refused_naming_the_field() -> None:
    values = torch.zeros(4, 96, dtype=torch.int8)
    with pytest.raises(ValueError, match="group"):
        QuantizedWeight(values, torch.ones(4, 4), None, 8, 24)
    with pytest.raises(ValueError, match="scales"):
        QuantizedWeight(values, torch.ones(4, 5), None, 8, 32)
    with pytest.raises(ValueError, match="multiple of 64"):
        QuantizedWeight(torch.zeros(4, 48, dtype=torch.uint8), torch.ones(4, 3), None, 4, 32)
    assert quantize(torch.randn(8, 40), "int8") is None  # no group fits: stays dense


def test_int8_takes_a_float16_scale_per_64_columns_but_per_row_for_amxs_w8a8() -> None:
    """int8 at load: a float16 scale per 64 columns (halved until it divides in_features), the
    head per 32; one float32 scale a row where AMX-INT8's W8A8 tiles multiply it (int8, not
    int8-wo). Finer scales round each weight no worse than one per row."""

    class Cpu:
        def __init__(self, has_amx_int8: bool) -> None:
            self.has_amx_int8 = self.reads_tiles = has_amx_int8

    weight = torch.randn(24, 192, generator=torch.Generator().manual_seed(3))
    weight[5, 7] = 40.0  # an outlier sets its row's step, not its neighbours' groups'
    for in_features, group in ((192, 64), (160, 32), (48, 16)):
        q = quantize(weight[:, :in_features], "int8-wo")
        assert q is not None and (q.group, q.scales.dtype) == (group, torch.float16)
        step = q.scales.float().repeat_interleave(group, dim=1)
        assert torch.all((q.dequantize() - weight[:, :in_features]).abs() <= step / 2 + 1e-6)
    grouped, per_row = quantize(weight, "int8"), quantize(weight, "int8", None)
    assert per_row is not None and per_row.group == 192 and per_row.scales.dtype == torch.float32
    row5_error = [(q.dequantize()[5, 64:] - weight[5, 64:]).abs().max() for q in (grouped, per_row)]
    assert row5_error[0] < row5_error[1] / 5
    assert quantize_head(weight, "int8").group == 32
    amx, vnni = cast(CpuKernels, Cpu(True)), cast(CpuKernels, Cpu(False))
    assert int8_group("int8", amx, 192) is None
    assert int8_group("int8", amx, 48) == 64  # 48 columns do not tile: no W8A8 to need a row
    assert int8_group("int8-wo", amx, 192) == int8_group("int8", vnni, 192) == 64
    assert int8_group("int8", None, 192) == 64


def _int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x rounded to int8 per 32 columns as the tiled kernels do (scale max|x| / 127, nearest
    even), back in float32."""
    blocks = x.float().view(x.shape[0], -1, 32)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return (torch.round(blocks * inverse) * scale).view(x.shape)


def _without_amx(kernels: CpuKernels | None) -> CpuKernels | None:
    """The kernels as a CPU without AMX tiles runs them (the tiled weights' int8 products)."""
    if kernels is None or not kernels.has_amx:
        return kernels
    vector = copy.copy(kernels)
    vector.has_amx = vector.has_amx_int8 = False
    return vector


FORMS = ["rows", "tiled"] if KERNELS is not None and KERNELS.reads_tiles else ["rows"]
# weight_only: the tiles' bf16 rows kept to 16 bits (VNNI: two int8 passes; AVX2: vpmaddwd).
FORMS += ["tiled-precise"] if KERNELS is not None and KERNELS.reads_tiles else []
FORMS += ["tiled-amx"] if KERNELS is not None and KERNELS.has_amx else []
# The C kernels in each layout and dtype; the torch path (one F.linear) in float32.
PROJECTION_CASES = [
    pytest.param(
        KERNELS if form == "tiled-amx" else _without_amx(KERNELS),
        dtype,
        form,
        id=f"C kernels-{form}-{str(dtype)[6:]}",
    )
    for form in FORMS
    for dtype in (torch.float32, torch.bfloat16)
] + [pytest.param(None, torch.float32, "rows", id="torch")]


@pytest.mark.parametrize(("kernels", "dtype", "form"), PROJECTION_CASES)
def test_quantized_projection_equals_dequantize_then_matmul(kernels, dtype, form) -> None:
    gen = torch.Generator().manual_seed(2)
    # 54: a last block of 4 rows is partial, and AVX2's last block of 16 leaves its batch-1
    # kernel (4 rows at a time) 2 rows
    weight = torch.randn(54, 256, generator=gen)
    bias = torch.randn(54, generator=gen).to(dtype)
    for name, qweight in _layouts(weight).items():
        projection = QuantizedProjection(
            qweight, kernels, tiled=form.startswith("tiled"), weight_only=form == "tiled-precise"
        )
        assert projection.on_amx == (form == "tiled-amx")
        assert projection.precise == (form == "tiled-precise")
        dense = qweight.dequantize()
        mins = qweight.mins
        offsets = (
            torch.zeros_like(dense)
            if mins is None
            else mins.float().repeat_interleave(qweight.group, dim=1)
        )
        for rows in (1, 3, 5, 9, QUANTIZED_AMX_MIN_ROWS, 17, 35, QUANTIZED_GEMV_MAX_ROWS + 6):
            x = torch.randn(rows, 256, generator=gen).to(dtype)
            got = projection(x, torch.empty(0), bias)
            want = x.float() @ dense.T + bias.float()
            assert got.dtype == dtype and got.shape == (rows, 54)
            # float32: reassociation only. bf16: the output's rounding, and from 5 rows on the
            # row layout's weights dequantized to bf16 once per call (one more bf16 rounding
            # each); x to 16 bits (2^-15 of each 32 columns' largest), or exact in float32 on
            # AVX2's tiles past AVX2_TILED_MAX_ROWS: a precise weight's up to
            # QUANTIZED_GEMV_MAX_ROWS (AVX2: every row count), AVX2's 8-bit tiles'. The VNNI
            # tiles otherwise, at every row count, and AVX2's 4- and 6-bit tiles up to
            # AVX2_TILED_MAX_ROWS: the integer part meets x rounded to int8 per 32 columns, the
            # offsets x itself; a rounding tie may fall the other way. On AMX from
            # QUANTIZED_AMX_MIN_ROWS: x as it is against the weights rounded to bf16 once, then
            # the output's rounding.
            tol = 1e-5 if dtype == torch.float32 else 2**-8 if rows <= 4 else 2**-6
            bf16 = dtype == torch.bfloat16
            avx2_tiles = form == "tiled" and not kernels.has_vnni
            avx2_int8 = avx2_tiles and rows <= AVX2_TILED_MAX_ROWS and projection.weight.bits != 8
            sixteen_bits = (
                rows <= QUANTIZED_GEMV_MAX_ROWS or not kernels.has_vnni
                if form == "tiled-precise"
                else avx2_tiles and not avx2_int8
            )
            if form == "tiled-amx" and bf16 and rows >= QUANTIZED_AMX_MIN_ROWS:
                want = x.float() @ dense.bfloat16().float().T + bias.float()
                tol = 2**-8
            elif sixteen_bits:
                tol = 1e-5 if dtype == torch.float32 else 2**-8
            elif bf16 and (
                avx2_int8
                or (
                    form in ("tiled", "tiled-amx")
                    and kernels.has_vnni
                    and rows <= QUANTIZED_GEMV_MAX_ROWS  # a weight-only prefill: dequantized
                )
            ):
                rounded = _int8_rounded(x) @ (dense - offsets).T
                want, tol = rounded + x.float() @ offsets.T + bias.float(), 2**-7
            scale = want.abs().max().item()
            torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * scale, msg=name)


@pytest.mark.skipif(not TILE_KERNELS, reason="the C kernels are not built here")
def test_int8_activations_stay_close_to_the_exact_product() -> None:
    """On rows whose magnitudes span 100x: a precise (weight-only) tiled product is within
    bf16's rounding of the exact one at every row count; rounding the activations to int8 per 32
    columns (llama.cpp's Q8_0; the VNNI tiles' default) costs about 1% (under 2%)."""
    gen = torch.Generator().manual_seed(5)
    weight = quantize_int4(torch.randn(64, 512, generator=gen), 32)
    kernels = _without_amx(TILE_KERNELS)
    precise = QuantizedProjection(weight, kernels, tiled=True, weight_only=True)
    default = QuantizedProjection(weight, kernels, tiled=True)
    # AVX2's tiles multiply more than AVX2_TILED_MAX_ROWS rows in float32.
    for rows in (1, 16, 17, QUANTIZED_GEMV_MAX_ROWS + 6):
        x = (torch.randn(rows, 512, generator=gen) * torch.logspace(-1, 1, 512)).bfloat16()
        want = x.float() @ weight.dequantize().T
        for projection in (precise, default):
            wide = not kernels.has_vnni and rows > AVX2_TILED_MAX_ROWS
            exact = projection.precise or wide
            got = projection(x, torch.empty(0), None).float()
            relative = (got - want).norm() / want.norm()
            assert relative < (2**-8 if exact else 0.02), (rows, projection.precise, relative)


@pytest.mark.skipif(
    KERNELS is None or not KERNELS.has_vnni, reason="the int8 prefill needs vpdpbusd"
)
def test_int8_prefill_rounds_activations_per_32_columns() -> None:
    """`int8` (int8_activations) on VNNI without AMX: a prefill's rows (past
    QUANTIZED_GEMV_MAX_ROWS) meet the tiles in one int8 pass, x rounded per 32 columns, as a
    decode batch's do; weight-only formats dequantize the weight for such rows instead."""
    gen = torch.Generator().manual_seed(8)
    weight = quantize_int8(torch.randn(80, 256, generator=gen))
    kernels = _without_amx(KERNELS)
    int8 = QuantizedProjection(weight, kernels, int8_activations=True)
    weight_only = QuantizedProjection(weight, kernels)
    rows = QUANTIZED_GEMV_MAX_ROWS * 2
    assert int8.route(rows, torch.bfloat16) == "kernel"
    assert weight_only.route(rows, torch.bfloat16) == "dequantized"
    x = torch.randn(rows, 256, generator=gen).bfloat16()
    want = _int8_rounded(x) @ weight.dequantize().T
    got = int8(x, torch.empty(0), None).float()
    torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7 * want.abs().max().item())
    assert kernels.quantized_path(int8.params, rows, 256, torch.bfloat16) == "tiled-int8"


@pytest.mark.skipif(not TILE_KERNELS, reason="the C kernels are not built here")
def test_gated_projection_fuses_silu_on_amx() -> None:
    """A gate_up weight ([gate; up]) on AMX gives silu(gate) * up straight from its matmul, from
    QUANTIZED_AMX_MIN_ROWS rows up to a prefill's (the whole weight dequantized, gate and up
    paired); fewer rows leave the activation to the caller (None)."""
    gen = torch.Generator().manual_seed(6)
    inter = 48
    for name, qweight in _layouts(torch.randn(2 * inter, 256, generator=gen)).items():
        projection = QuantizedProjection(qweight, TILE_KERNELS, gated=True)
        assert projection.gated, name
        dense = qweight.dequantize().bfloat16().float()
        assert projection.silu_and_mul(torch.randn(QUANTIZED_AMX_MIN_ROWS - 1, 256)) is None
        for rows in (QUANTIZED_AMX_MIN_ROWS, 40, QUANTIZED_GEMV_MAX_ROWS + 6):
            x = torch.randn(rows, 256, generator=gen).bfloat16()
            act = projection.silu_and_mul(x)
            gate, up = (x.float() @ dense.T).split(inter, dim=-1)
            want = torch.nn.functional.silu(gate) * up
            assert act is not None and act.shape == (rows, inter) and act.dtype == torch.bfloat16
            scale = want.abs().max().item()
            torch.testing.assert_close(act.float(), want, rtol=2**-7, atol=2**-7 * scale)
            plain = projection(x, torch.empty(0), None).float()  # columns in order
            exact = x.float() @ dense.T
            bound = 2**-8 * exact.abs().max().item()
            torch.testing.assert_close(plain, exact, rtol=2**-8, atol=bound)


@pytest.mark.skipif(KERNELS is None, reason="the C kernels' lookups")
@pytest.mark.parametrize("rows", [1, 6, 20])
def test_groups_across_32_column_blocks(rows) -> None:
    """8-bit groups of 48 straddle the 32-column blocks some kernels scale by (AVX2's int16
    form): they take another path and still equal dequantize-then-matmul."""
    gen = torch.Generator().manual_seed(7)
    qweight = quantize_int8(torch.randn(40, 96, generator=gen), 48)
    projection = QuantizedProjection(qweight, KERNELS)
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    got = projection(x, torch.empty(0), None).float()
    want = x.float() @ qweight.dequantize().T
    torch.testing.assert_close(got, want, rtol=2**-6, atol=2**-6 * want.abs().max().item())


def test_quantized_rows_are_the_dequantized_rows() -> None:
    gen = torch.Generator().manual_seed(4)
    ids = torch.tensor([0, 17, 5, 51, 17])
    all_rows = torch.arange(52)
    for name, qweight in _layouts(torch.randn(52, 256, generator=gen)).items():
        for form in FORMS:
            projection = QuantizedProjection(qweight, KERNELS, tiled=form == "tiled")
            want = qweight.dequantize()
            assert torch.equal(projection.rows(ids, torch.float32), want[ids]), (name, form)
            assert torch.equal(projection.rows(ids, torch.bfloat16), want[ids].bfloat16()), name
            assert torch.equal(projection.rows(all_rows, torch.float32), want), (name, form)
    with pytest.raises(IndexError, match="52"):
        projection.rows(torch.tensor([52]), torch.float32)


def _prompt_top1(llm) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=1, prompt_logprobs=1))
    return [[top[0][0] for _, _, top in out["prompt_logprobs"][1:]] for out in outs]


def _agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, int]:
    pairs = [(x, y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b)]
    return sum(x == y for x, y in pairs) / len(pairs), len(pairs)


def _engines_group(method: str, weight: torch.Tensor) -> int | None:
    """The int8 group the engine picks for this weight on this CPU."""
    return int8_group(method, KERNELS, weight.shape[-1])


def _hf_dequantized(model: str, method: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """HF's model of the named test model with every weight that `method` quantizes at load
    replaced by its dequantization (projections and experts by `quantize`, the output head, and
    with it a tied embedding, by `quantize_head`; routers, norms and an untied embedding
    dense): (float32, float64)."""
    from transformers import AutoModelForCausalLM

    # Eager experts: transformers' grouped matmul takes no float64.
    kw = {"experts_implementation": "eager"} if "moe" in model else {}
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model(model)), dtype=torch.float32, **kw)
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear):  # a MoE router is not one
                qweight = (
                    quantize_head(module.weight, method)
                    if name == "lm_head"
                    else quantize(module.weight, method, _engines_group(method, module.weight))
                )
                if qweight is not None:
                    module.weight.copy_(qweight.dequantize())
            for stack in ("gate_up_proj", "down_proj"):  # the experts [E, N, K], per expert
                experts = getattr(module, stack, None)
                if isinstance(experts, torch.nn.Parameter) and experts.dim() == 3:
                    for expert in experts:
                        qweight = quantize(expert, method, _engines_group(method, expert))
                        assert qweight is not None
                        expert.copy_(qweight.dequantize())
    hf.eval()
    return hf, copy.deepcopy(hf).double()


@pytest.mark.parametrize("model", ["qwen3", "qwen3-moe"])
def test_quantized_at_load_agrees_with_the_dense_model(model: str) -> None:
    """The quantized model's float32 logits are the dequantized weights' (HF's float64 on
    them) within float32's accumulation noise, on every CPU class (float32 activations meet
    the weight dequantized exactly, whatever the layout); and as a quality figure, top-1
    prefill agreement with the same model dense (a MoE model's experts quantized too). Greedy
    decode runs and the page accounting holds."""
    torch.set_num_threads(2)
    top1 = {}
    batches = [PROMPTS, SHORT_PROMPTS]
    for quantization in (None, "int8", "int4-g32"):
        llm = build_llm(model, quantization=quantization)  # float32: quantization alone differs
        if quantization is not None:
            # PROMPTS' prefill takes the weights dequantized once per call; then their prefixes
            # are cached and SHORT_PROMPTS' last tokens meet the weights in the C kernels.
            prefill = spy_logits(llm, "prefill")
            for prompts in batches:
                llm.generate(prompts, greedy(1))
            assert len(prefill) == len(batches), "each batch fits one prefill"
            reference = _hf_dequantized(model, quantization)
            for rows, prompts in zip(prefill, batches):
                ids = [hf_encode(model, prompt) for prompt in prompts]
                assert_logits_match_models(rows, *reference, ids, f"{model} {quantization}")
        top1[quantization] = _prompt_top1(llm)
        assert llm.generate(PROMPTS[:2], greedy(8))[0]["token_ids"]
        assert_all_pages_free(llm)
        llm.shutdown()
    int8, positions = _agreement(top1[None], top1["int8"])
    int4, _ = _agreement(top1[None], top1["int4-g32"])
    # A random-weight model's flat distributions make near ties common (Zen 2: qwen3 0.952 and
    # 0.735, qwen3-moe 0.946 and 0.602, where a changed input also changes the router's choice
    # of experts; a broken kernel scores near 0): the bounds leave room for another CPU's
    # rounding. The default model's figures are benchmark/quantized_quality.py's.
    int4_bound = 0.5 if model == "qwen3-moe" else 0.65
    assert positions > 100 and int8 >= 0.9 and int4 >= int4_bound, (int8, int4)


def test_default_model_served_from_its_gguf_agrees_with_hf() -> None:
    """The default model from its Q4_1 GGUF, quantized as the file holds it, against HF on the
    same file's dequantized weights (the default model's folder): in float32, the logits within
    float32's accumulation noise of HF's float64 (every CPU class: float32 activations meet the
    weights dequantized exactly); with bf16 activations, as a quality figure, top-1 prefill
    agreement with HF's float32 >= 95%, greedy decode through the fused layers, and the page
    accounting holds."""
    torch.set_num_threads(2)
    from minisgl.llm import LLM

    exact = LLM(None, dtype=torch.float32, num_page_override=512, overlap_schedule=False)
    assert exact.config.quantization == "gguf"
    prefill = spy_logits(exact, "prefill")
    exact.generate(SHORT_PROMPTS, greedy(1))
    exact.shutdown()
    assert len(prefill) == 1, "all prompts fit one prefill batch"
    assert_logits_match_hf(prefill[0], "smollm2", SHORT_PROMPTS)

    llm = LLM(None, num_page_override=512)
    assert llm.config.quantization == "gguf"
    ours = _prompt_top1(llm)
    hf = [hf_logits("smollm2", p)[:-1].argmax(dim=-1).tolist() for p in PROMPTS]
    agreement, positions = _agreement(hf, ours)
    assert positions > 150 and agreement >= 0.95, agreement
    out = llm.generate(["The capital of France is"], greedy(4))[0]
    assert out["text"].startswith(" Paris")
    assert_all_pages_free(llm)
    llm.shutdown()


@pytest.mark.skipif(
    KERNELS is None or not (KERNELS.has_avx512_bf16 or KERNELS.has_avx2),
    reason="the fused decode layer's quantized matmuls",
)
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_fused_decode_layers_take_quantized_weights(quantization, monkeypatch) -> None:
    """bf16 decode with quantized projections runs whole layers in C (every row count's path:
    the exact ones up to 4 rows, then bf16-dequantized weights) and equals the module-by-module
    path bit for bit."""
    torch.set_num_threads(2)
    prompts = PROMPTS + [p + " again" for p in PROMPTS] + [p + " once more" for p in PROMPTS]
    max_new = [3 + i % 7 for i in range(len(prompts))]
    fused_batches, set_fused = fused_decode_switch(monkeypatch)

    def decode(fused: bool) -> tuple[list[torch.Tensor], list[list[int]]]:
        set_fused(fused)
        return bf16_decode_logits("qwen3", prompts, max_new, quantization=quantization)

    fused_logits, fused_ids = decode(True)
    module_logits, module_ids = decode(False)
    assert fused_batches and max(fused_batches) > 16 and min(fused_batches) <= 4, fused_batches
    assert fused_ids == module_ids
    for got, want in zip(fused_logits, module_logits, strict=True):
        assert torch.equal(got, want)


def test_unknown_quantization_is_refused() -> None:
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(model_path="x", quantization="int3")
    with pytest.raises(ValueError, match="gguf"):
        EngineConfig(model_path="x", quantization="gguf")


def test_weights_quantized_at_load_round_the_checkpoints_own_values() -> None:
    """A bf16 model's weights quantized at load are rounded from the checkpoint's float32
    values (the loader hands them over so), not from bf16's rounding of them: every row as
    `quantize` gives it on the float32 weight, exactly."""
    torch.set_num_threads(2)
    llm = build_llm("qwen3", quantization="int8-wo", dtype=torch.bfloat16)
    from safetensors import safe_open

    from minisgl.models.weight import safetensors_files

    name = "model.layers.0.mlp.down_proj.weight"
    for shard in safetensors_files(tiny_model("qwen3")):
        with safe_open(str(shard), framework="pt") as f:
            if name in f.keys():  # noqa: SIM118
                source = f.get_tensor(name)
    assert source.dtype == torch.float32
    projection = llm.engine.model.model.layers[0].mlp.down_proj.cpu_projection
    assert isinstance(projection, QuantizedProjection)
    rows = torch.arange(source.shape[0])
    group = int8_group("int8-wo", KERNELS, source.shape[1])
    want = quantize(source, "int8-wo", group)
    assert want is not None
    assert torch.equal(projection.rows(rows, torch.float32), want.dequantize(rows))
    from_bf16 = quantize(source.bfloat16(), "int8-wo", group)
    assert from_bf16 is not None and not torch.equal(
        from_bf16.dequantize(rows), want.dequantize(rows)
    )
    llm.shutdown()
