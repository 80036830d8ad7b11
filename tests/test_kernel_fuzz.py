"""A shape fuzz of the quantized kernels' C entry points, in every form this machine executes
(the AVX-512/VNNI/AMX forms emulated where the CPU lacks them, build.py): seeded shapes on and
off every boundary the code branches on (rows 1-300 across 4/5, 8/9, 16/17, 128/129; columns on
and off 32, 64 and every group; 16-row tiles with 1-15 rows left over), every layout (8 bits per
row and in groups of 16/32/48, 6-bit integers, 4 bits in groups of 32/64, with and without
offsets, float16 and float32 scales: the forms GGUF's types take), float32 and bf16 x, 1-4
threads. Outputs land between guard regions checked afterwards; values are compared with float64
dequantize-then-matmul within the bound of the path that ran (minisgl_quantized_path), and the
path counters must agree with that choice. tests/test_kernel_sanitized.py runs this file against
the sanitized builds."""

from __future__ import annotations

import ctypes
import functools
import itertools
import random
from collections.abc import Iterator

import pytest
import torch
from test_kernel_variants import EVERY_FORM, ONLY_WHERE_BUILT, U32, UBF16, libraries, variant

from minisgl.kernel.abi import QuantizedWeightParams
from minisgl.kernel.cpu import CpuKernels
from minisgl.kernel.quantized import quantized_fits, quantized_weight_params, w8a8_fits
from minisgl.layers.quant_tiles import tile_weight
from minisgl.layers.quant_weight import QuantizedWeight, quantize_int4, quantize_int8
from minisgl.layers.quantized import QuantizedProjection

pytestmark = ONLY_WHERE_BUILT

GUARD = 64  # elements each side of an output
ROWS = [1, 2, 3, 4, 5, 8, 9, 10, 15, 16, 17, 33, 128, 129, 300]
OUT_FEATURES = [1, 15, 16, 17, 31, 32, 33, 40]
# The weights' layouts: (name, bits of the values, group (None: the row), offsets, scales dtype).
LAYOUTS = [
    ("int8-row", 8, None, False, torch.float32),
    ("int8-g16", 8, 16, False, torch.float16),  # Q6_K's groups
    ("int8-g32", 8, 32, False, torch.float16),  # Q8_0
    ("int8-g48-mins", 8, 48, True, torch.float16),  # (scales with offsets: few bits, exact)
    ("int6-g32", 6, 32, False, torch.float16),  # 8-bit integers within -32..31: Q5_0, the head
    ("int6-g16-mins", 6, 16, True, torch.float16),  # Q5_1 / Q5_K shapes
    ("int4-g32", 4, 32, True, torch.float16),  # Q4_1 / Q4_K
    ("int4-g64", 4, 64, True, torch.float32),
    ("int4-g32-nomins", 4, 32, False, torch.float16),  # Q4_0
]
IN_FEATURES = [32, 48, 64, 96, 128, 160, 192]

# The paths each form's fuzz ran (conftest.py prints them at the end of the run).
PATHS_RAN: dict[str, list[str]] = {}

# Forms: every runnable build; an emulated AMX build once more with its tiles on (Sapphire
# Rapids' paths; without them it is Zen 4's).
FORMS = EVERY_FORM + [f"{name}+amx" for name in EVERY_FORM if name.endswith("-amx-emulated")]


@functools.cache
def form(name: str) -> CpuKernels:
    base, _, amx = name.partition("+")
    if not amx:
        return variant(base)
    kernels = CpuKernels(ctypes.CDLL(str(libraries()[base])))
    assert kernels.has_amx, f"{base}: an emulated AMX build grants its tiles"
    return kernels


@pytest.fixture(scope="module", params=FORMS)
def kernels(request: pytest.FixtureRequest) -> Iterator[CpuKernels]:
    threads = torch.get_num_threads()
    built = form(request.param)
    built.form_name = request.param  # type: ignore[attr-defined]
    yield built
    torch.set_num_threads(threads)


def possible_paths(kernels: CpuKernels) -> set[str]:
    """Every path this build's dispatcher chooses over the fuzz's layouts, rows and dtypes, and
    the paths its instructions must give it (so a path the dispatcher drops fails too)."""
    gen = torch.Generator().manual_seed(5)
    paths = set()
    for tiled in layouts(kernels):
        for layout, k, *_ in cases(0, tiled):
            q = make_weight(layout, 16, k, gen)
            params, _held, _bits = weight_params(q, tiled, kernels.has_amx)
            for rows, dtype in itertools.product(ROWS, (torch.float32, torch.bfloat16)):
                paths.add(kernels.quantized_path(params, rows, k, dtype))
    needed = {"avx2-rows", "avx2-tile"} if kernels.has_avx2 else {"generic"}
    if kernels.has_avx512:
        needed.add("avx512-f32")
    if kernels.has_avx512_bf16:
        needed |= {"avx512-nibbles", "avx512-wide", "avx512-bf16-block", "avx512-packed"}
    else:
        needed |= {"avx2-int16"} if kernels.has_avx2 else set()
    if kernels.has_vnni:
        needed |= {"tiled-f32", "tiled-precise", "tiled-amx" if kernels.has_amx else "tiled-int8"}
    elif kernels.has_avx2:
        needed |= {"avx2-tiled-int16", "avx2-tiled-f32", "avx2-tiled-int8"}
    if kernels.has_vnni:
        needed.add("tiled-w8a8" if kernels.has_amx_int8 else "tiled-w8a8-vnni")
    assert needed <= paths, f"the dispatcher never chooses {sorted(needed - paths)}"
    return paths


def make_weight(layout: tuple, out_features: int, in_features: int, gen) -> QuantizedWeight:
    """A random weight of `layout` [out_features, in_features] in the row layout."""
    _, bits, group, mins, scale_dtype = layout
    group = group or in_features
    weight = torch.randn(out_features, in_features, generator=gen)
    if bits == 4:
        q = quantize_int4(weight, group)
        if not mins:  # Q4_0: offset -8 * scale, folded into the integers' frame: none stored
            q = QuantizedWeight(q.values, q.scales.to(scale_dtype), None, q.bits, q.group)
        return QuantizedWeight(
            q.values, q.scales.to(scale_dtype), None if q.mins is None else q.mins.to(scale_dtype),
            q.bits, q.group,
        )  # fmt: skip
    q = quantize_int8(weight, group, limit=127 if bits == 8 else 31, scale_dtype=scale_dtype)
    offsets = (torch.randn(q.scales.shape, generator=gen) * 0.1).to(scale_dtype) if mins else None
    return QuantizedWeight(q.values, q.scales, offsets, 8, q.group)


def weight_params(
    q: QuantizedWeight, tiled: bool, amx: bool
) -> tuple[QuantizedWeightParams, object, int]:
    """The C view (and the tensors it points at, to keep alive) and the layout's bits; a tiled
    int8 weight with one scale a row takes more than W8A8_MIN_ROWS rows as int8 (W8A8). Half the
    tiled weights (by their first byte) are precise: x kept to 16 bits (VNNI, AVX2)."""
    held = tile_weight(q) if tiled else q
    int8_x = tiled and w8a8_fits(held.bits, q.group, q.in_features, q.mins is not None)
    precise = tiled and int(q.values.reshape(-1)[0]) % 2 == 0
    params = quantized_weight_params(
        held.values, held.scales, held.mins, held.bits, q.group, tiled, amx, int8_x, precise
    )
    return params, held, held.bits


def guarded(rows: int, cols: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """An output [rows, cols] between GUARD elements each side, all of a marker value."""
    buffer = torch.full((rows * cols + 2 * GUARD,), -1234.5, dtype=dtype)
    return buffer, buffer[GUARD : GUARD + rows * cols].view(rows, cols)


def assert_guards(buffer: torch.Tensor, what: str) -> None:
    for side in (buffer[:GUARD], buffer[-GUARD:]):
        assert bool((side == -1234.5).all()), f"{what}: a write past the output"


def product_bound(path: str, x: torch.Tensor, dense: torch.Tensor, out_unit: float):
    """float64 x @ dense^T and the bound on what `path` computes: float32 sums of the products
    in any order (twice: the scale's multiply), plus where the path rounds them: the weights to
    bf16 (wide, packed, GEMV blocks, AMX), x to int16 per 32 columns (AVX2 int16), to int8
    per 32 columns (tiled, AVX2 int8: one pass; two where precise) or per row (W8A8), and the
    output to its dtype."""
    x64, w64 = x.double(), dense.double()
    want = x64 @ w64.T
    magnitude = x64.abs() @ w64.abs().T
    bound = 2 * (x.shape[1] + 2) * U32 * magnitude
    if path in ("avx512-wide", "avx512-packed", "avx512-bf16-block", "tiled-amx"):
        bound += UBF16 * magnitude
    steps = {
        "avx2-int16": 1 / 32767,
        "avx2-tiled-int16": 1 / 32767,
        "tiled-precise": 1 / (127 * 128),
        "tiled-int8": 1 / 127,
        "avx2-tiled-int8": 1 / 127,
    }
    if path in steps:  # half a step of each 32 columns' scale (amax * step), per column
        blocks = x64.abs().view(x.shape[0], -1, 32).amax(dim=2)
        step = blocks.repeat_interleave(32, dim=1) * steps[path]
        bound += step @ w64.abs().T
    if path in ("tiled-w8a8", "tiled-w8a8-vnni"):  # x to int8 per row
        bound += (x64.abs().amax(dim=1, keepdim=True) / 127) @ w64.abs().sum(dim=1)[None]
    return want, out_unit * want.abs() + (1 + out_unit) * bound


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    err = (got.double() - want).abs()
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), (
        f"{what}: error {err.flatten()[worst]:.3g} over its bound {bound.flatten()[worst]:.3g}"
    )


def cases(seed: int, tiled: bool) -> Iterator[tuple]:
    """(layout, in_features, rows, out_features, x dtype, threads, bias, float_out): every layout
    and width the layout fits, each with rows and outputs cycling through their boundaries."""
    rng = random.Random(seed)
    rows_cycle = itertools.cycle(ROWS)
    for layout, in_features in itertools.product(LAYOUTS, IN_FEATURES):
        bits, group = layout[1], layout[2] or in_features
        if bits == 4 and in_features % 64:
            bits = 6  # quantize_int4 keeps 4-bit integers of such widths in the 8-bit layout
        if bits == 6:
            bits = 6 if tiled else 8  # tile_weight holds 8-bit integers within -32..31 in 6 bits
        if not quantized_fits(bits, group, in_features, tiled):
            continue
        # Rows cycling through their boundaries; a few bf16 rows (the 4-bit nibble path); and
        # for one scale a row, many bf16 rows (W8A8's int8 tiles).
        kinds = ["cycle", "cycle", "few"] + (["many"] if layout[2] is None else [])
        for kind in kinds:
            rows = {"few": rng.randint(1, 4), "many": rng.choice([129, 300])}.get(kind)
            yield (
                layout,
                in_features,
                next(rows_cycle) if rows is None else rows,
                rng.choice(OUT_FEATURES),
                rng.choice([torch.float32, torch.bfloat16]) if kind == "cycle" else torch.bfloat16,
                rng.randint(1, 4),
                rng.random() < 0.5,
                rng.random() < 0.3,
            )


def layouts(kernels: CpuKernels) -> list[bool]:
    """tiled or not: the row layout, and the tile layout where the build reads it (vpdpbusd,
    or AVX2)."""
    return [False, True] if kernels.reads_tiles else [False]


def test_quantized_linear_shapes_stay_in_bounds_and_within_their_path(kernels):
    gen = torch.Generator().manual_seed(7)
    ran: set[str] = set()
    every = [(tiled, case) for tiled in layouts(kernels) for case in cases(11 + tiled, tiled)]
    for tiled, (layout, k, rows, n, dtype, threads, with_bias, float_out) in every:
        q = make_weight(layout, n, k, gen)
        params, _held, _bits = weight_params(q, tiled, kernels.has_amx)
        x = torch.randn(rows, k, generator=gen).to(dtype)
        bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
        path = kernels.quantized_path(params, rows, k, dtype)
        assert path is not None, (layout[0], k, tiled)
        out_dtype = torch.float32 if float_out else dtype
        buffer, out = guarded(rows, n, out_dtype)
        before = kernels.quantized_path_runs()[path]
        torch.set_num_threads(threads)
        kernels.quantized_linear(x, params, (n, k), bias, float_out, out)
        what = f"{path} {layout[0]} x {tuple(x.shape)} {dtype} N {n} threads {threads}"
        assert kernels.quantized_path_runs()[path] == before + 1, what
        assert_guards(buffer, what)
        out_unit = U32 if out_dtype == torch.float32 else UBF16
        want, bound = product_bound(path, x, q.dequantize(), out_unit)
        if bias is not None:
            want = want + bias.double()
            bound = bound + out_unit * bias.double().abs()
        assert_within(out, want, bound, what)
        ran.add(path)
    PATHS_RAN[kernels.form_name] = sorted(ran)
    missing = possible_paths(kernels) - ran
    assert not missing, f"paths this build takes that the fuzz did not run: {sorted(missing)}"


def test_a_prefill_past_the_row_block_equals_its_rows_in_shorter_calls(kernels):
    """More bf16 rows than the tile kernels' ROW_BLOCK (512; csrc/quantized_tiled.c) go through
    in blocks: every row comes out as a call of fewer rows (on the same path) gives it, bit for
    bit, and nothing is written past the output. Grouped weights: a W8A8 call's outlier columns
    follow its rows, so its rows do depend on the call."""
    gen = torch.Generator().manual_seed(13)
    rows, part = 1100, 275  # two whole blocks and a partial one; parts on the same path
    for tiled, layout in itertools.product(layouts(kernels), (LAYOUTS[2], LAYOUTS[6])):
        q = make_weight(layout, 40, 128, gen)
        params, _held, _bits = weight_params(q, tiled, kernels.has_amx)
        x = torch.randn(rows, 128, generator=gen).bfloat16()
        path = kernels.quantized_path(params, rows, 128, torch.bfloat16)
        assert path == kernels.quantized_path(params, part, 128, torch.bfloat16), path
        buffer, whole = guarded(rows, 40, torch.bfloat16)
        kernels.quantized_linear(x, params, (40, 128), None, False, whole)
        assert_guards(buffer, f"{path} {layout[0]}")
        parts = [
            kernels.quantized_linear(x[start : start + part].contiguous(), params, (40, 128), None)
            for start in range(0, rows, part)
        ]
        assert torch.equal(whole, torch.cat(parts)), (path, layout[0])


def test_quantized_rows_are_the_dequantized_weight_and_stay_in_bounds(kernels):
    """Row lookups (an embedding) and the whole weight in order (a prefill's dequantization):
    exactly the float32 dequantization, or it rounded to bf16 once."""
    gen = torch.Generator().manual_seed(8)
    rng = random.Random(3)
    every = [(tiled, case) for tiled in layouts(kernels) for case in cases(21 + tiled, tiled)]
    for tiled, (layout, k, _, n, dtype, threads, _, _) in every:
        q = make_weight(layout, n, k, gen)
        params, _held, _bits = weight_params(q, tiled, False)
        dense = q.dequantize()
        ids_options = [torch.arange(n), torch.tensor([rng.randrange(n) for _ in range(5)])]
        for ids in ids_options:
            buffer, out = guarded(len(ids), k, dtype)
            torch.set_num_threads(threads)
            kernels.quantized_rows(params, (n, k), ids, dtype, out)
            what = f"{layout[0]} rows {ids.tolist()[:4]} of {n} x {k} {dtype} tiled {tiled}"
            assert_guards(buffer, what)
            assert torch.equal(out, dense[ids].to(dtype)), what


def test_quantized_amx_entry_points_stay_in_bounds(kernels):
    """The tiled weight's packed copy (a prefill's weight on AMX) equals the dequantized weight
    packed; the gated SiLU on the tiles (and a W8A8 weight's anywhere) within its roundings;
    builds without the tiles refuse the packed copy."""
    gen = torch.Generator().manual_seed(9)
    for layout, k in itertools.product([LAYOUTS[0], *LAYOUTS[1:8:2]], (32, 96, 160)):
        bits = layout[1]
        if not quantized_fits(bits, layout[2] or k, k, True) or not kernels.has_vnni:
            continue
        q = make_weight(layout, 64, k, gen)
        params, _held, _bits = weight_params(q, True, kernels.has_amx)
        elems = kernels.packed_elems(64, k)
        buffer, packed = guarded(1, elems, torch.bfloat16)
        try:
            kernels.quantized_packed(params, (64, k), packed.view(-1))
            assert_guards(buffer, f"quantized_packed {layout[0]} K {k}")
            assert torch.equal(packed.view(-1), kernels.pack_weight(q.dequantize().bfloat16()))
        except RuntimeError as error:  # built without the tiles
            assert "quantized_packed" in str(error) and not kernels.has_amx, error
        if not kernels.has_amx and not params.int8_x:
            continue
        for rows in (10, 17, 129):
            x = torch.randn(rows, k, generator=gen).bfloat16()
            act = kernels.quantized_gated_silu(x, params, 32)
            dense = q.dequantize()
            path = kernels.quantized_path(params, rows, k, torch.bfloat16)
            gate, gate_bound = product_bound(path, x, dense[:32], UBF16)
            up, up_bound = product_bound(path, x, dense[32:], UBF16)
            silu = gate * torch.sigmoid(gate)
            want = silu * up
            bound = 3 * UBF16 * want.abs() + 1.1 * up.abs() * gate_bound + silu.abs() * up_bound
            assert_within(act, want, bound, f"gated silu {layout[0]} K {k} rows {rows}")


def test_the_fit_rule_is_the_same_in_python_and_in_c(kernels):
    for bits, group, k, tiled in itertools.product(
        (4, 6, 8), range(0, 200, 8), range(0, 400, 16), (False, True)
    ):
        want = quantized_fits(bits, group, k, tiled)
        assert kernels.quantized_fits(bits, group, k, tiled) == want, (bits, group, k, tiled)


def test_a_shape_the_kernels_cannot_take_is_an_error_not_a_write(kernels):
    """The C entry point checks the rule itself: a 4-bit weight of 96 columns (not whole 64-
    column blocks) and a group that does not divide the columns are refused, nothing written."""
    q = quantize_int4(torch.randn(16, 128), 32)
    for bits, group, k in ((4, 32, 96), (8, 48, 64), (4, 96, 192), (8, 0, 64)):
        params = quantized_weight_params(q.values, q.scales, q.mins, bits, group)
        assert kernels.quantized_path(params, 3, k, torch.float32) is None
        buffer, out = guarded(3, 16, torch.float32)
        with pytest.raises(ValueError, match="quantized_linear"):
            kernels.quantized_linear(torch.randn(3, k), params, (16, k), None, False, out)
        assert bool((buffer == -1234.5).all())


@pytest.mark.parametrize("in_features", [32, 96])
def test_the_reported_overflow_of_8_bit_tiles_whose_width_is_32_mod_64(kernels, in_features):
    """The issue's reproduction: an int8 weight of 32 (a tiny MoE expert's down) or 96 columns
    (768 / 8 under tensor parallelism) in the tile layout. Its row lookup wrote 64 floats a
    step: past a 32-column row, and a prefill's whole-weight dequantization past its output.
    Guards intact, values the dequantized weight's, on every build (the tiles where it has
    vpdpbusd)."""
    gen = torch.Generator().manual_seed(35)
    q = quantize_int8(torch.randn(64, in_features, generator=gen))
    for tiled in layouts(kernels):
        params, _held, _bits = weight_params(q, tiled, kernels.has_amx)
        buffer, out = guarded(1, in_features, torch.float32)
        kernels.quantized_rows(params, (64, in_features), torch.tensor([63]), torch.float32, out)
        assert_guards(buffer, f"row 63, tiled {tiled}")
        assert torch.equal(out, q.dequantize()[63:])
        buffer, whole = guarded(64, in_features, torch.float32)
        kernels.quantized_rows(params, (64, in_features), torch.arange(64), torch.float32, whole)
        assert_guards(buffer, f"every row, tiled {tiled}")
        assert torch.equal(whole, q.dequantize())
        for int8_x, rows, dtype in itertools.product(
            (False, True), (1, 9, 200), (torch.float32, torch.bfloat16)
        ):
            projection = QuantizedProjection(q, kernels, tiled=tiled, int8_activations=int8_x)
            x = torch.randn(rows, in_features, generator=gen).to(dtype)
            got = projection(x, torch.empty(0), None)
            route = projection.route(rows, dtype)
            path = kernels.quantized_path(projection.params, rows, in_features, dtype)
            path = path if route == "kernel" else "avx512-packed"  # dequantized to bf16 once
            out_unit = U32 if dtype == torch.float32 else UBF16
            want, bound = product_bound(path, x, q.dequantize(), out_unit)
            what = f"{route} {path} rows {rows} {dtype} tiled {tiled} int8_x {int8_x}"
            assert_within(got, want, bound, what)
