"""Every form of the C kernels, built on this machine: SSE2-only and AVX2-only builds (the portable
C), AVX-512 without bf16, avx512_bf16 with the AMX tiles compiled in (its vdpbf16ps form), and the
machine's own -march=native build. Each target is built wherever the tests run (cached per flags);
each one the CPU can execute is compared kernel by kernel against float64 PyTorch references
(here the products, elementwise and sampling kernels; attention in test_kernel_attention.py, error
paths in test_kernel_errors.py, which share this module's helpers).

Tolerances are bounds, not fits: float32 accumulation in any order (n terms: n * 2^-24 of the sum
of their magnitudes), each rounding to bf16 (2^-8 relative) or float32 (2^-24), exp within 4 ulps
(libmvec's bound), so they hold on every x86 class whatever order its kernels sum in.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import platform
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from minisgl.env import ENV
from minisgl.kernel.build import TARGETS, build_library, can_run
from minisgl.kernel.cpu import CpuKernels, cpu_kernels
from minisgl.kernel.ops import rotate_halves as _rotate
from minisgl.layers.linear import interleave_gate_up
from minisgl.layers.quant_weight import quantize_int4, quantize_int8
from minisgl.layers.quantized import AVX2_TILED_MAX_ROWS, QuantizedProjection

ONLY_WHERE_BUILT = pytest.mark.skipif(
    platform.system() != "Linux"
    or platform.machine() not in ("x86_64", "AMD64")
    or shutil.which("gcc") is None
    or not ENV.CPU_KERNELS.value,
    reason="the kernels are only built with gcc on x86-64 Linux",
)
pytestmark = ONLY_WHERE_BUILT

U32, UBF16 = 2.0**-24, 2.0**-8  # unit roundoffs of float32 and bfloat16
EXP_ULPS = 8  # relative error of a float32 exp, in units of U32 (4 ulps)
DTYPES = [torch.float32, torch.bfloat16]
# Every form this machine executes, the emulated ones included (test_kernel_fuzz.py runs them
# all); the kernel tests here run the emulated ones only in the sanitized process
# (test_kernel_sanitized.py), where a form's values and memory are checked at once.
EVERY_FORM = [t.name for t in TARGETS if can_run(t)] + ["native"]
# Where the CPU has no AVX-512, its native build compiles the kernels' code of the widest fixed
# target it runs (x86-64-v3's on Zen 2/3: the same HAVE_* paths, other instruction choices),
# and the sanitizers check source operations, not instruction choices: there the sanitized run
# takes that code once (a fifth of its time on an AVX2 CPU).
if ENV.CPU_SANITIZE.value and "x86-64-v3" in EVERY_FORM and "avx512-no-bf16" not in EVERY_FORM:
    EVERY_FORM.remove("native")
EMULATED = {t.name for t in TARGETS if t.emulated}
RUNNABLE = [name for name in EVERY_FORM if name not in EMULATED or ENV.CPU_SANITIZE.value]
# The variants built with avx512_bf16 (native: where this CPU has it), with vpdpbusd.
BF16_FORMS = {"avx512-bf16-amx", "avx512-bf16-amx-emulated", "native"}
VNNI_FORMS = {"avx512-bf16-amx", "avx512-vnni-emulated", "avx512-bf16-amx-emulated"}


@functools.cache
def libraries() -> dict[str, Path]:
    """Every target's library, built side by side (gcc runs outside the GIL); sanitized under
    MINISGL_CPU_SANITIZE (tests/test_kernel_sanitized.py)."""
    sanitize = ENV.CPU_SANITIZE.value
    targets = [t for t in TARGETS if can_run(t) or not sanitize]
    with ThreadPoolExecutor(len(targets)) as pool:
        paths = list(pool.map(lambda target: build_library(target.flags, sanitize), targets))
    return {target.name: path for target, path in zip(targets, paths)}


@functools.cache
def variant(name: str) -> CpuKernels:
    """The kernels of a RUNNABLE target (its library loaded once per process)."""
    if name == "native":
        kernels = cpu_kernels()
        assert kernels is not None
        return kernels
    kernels = CpuKernels(ctypes.CDLL(str(libraries()[name])))
    # The tile form is the native build's here (tests/test_cpu_kernels.py); this is the form a
    # CPU without tiles runs.
    kernels.has_amx = kernels.has_amx_int8 = False
    return kernels


def on_two_threads(name: str) -> Iterator[CpuKernels]:
    """A module fixture's body: the variant, on two threads while the module's tests run (so
    the attention kernels split batches of 1 and 3 by position and 5 by request everywhere)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield variant(name)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=RUNNABLE)
def kernels(request: pytest.FixtureRequest) -> Iterator[CpuKernels]:
    yield from on_two_threads(request.param)


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    err = (got.double() - want).abs()
    worst = int((err - bound).argmax()) if err.numel() else 0
    assert bool((err <= bound).all()), (
        f"{what}: error {err.flatten()[worst]:.3g} over its bound {bound.flatten()[worst]:.3g} "
        f"(value {want.flatten()[worst]:.4g})"
    )


def test_every_target_builds_and_reports_its_instructions():
    """The targets this CPU cannot execute are built too (a compile error fails here)."""
    sanitize = ENV.CPU_SANITIZE.value  # (a sanitized process builds only the forms it runs)
    assert set(libraries()) == {t.name for t in TARGETS if can_run(t) or not sanitize}
    for name in EVERY_FORM:
        kernels = variant(name)
        if name != "native":
            assert kernels.has_avx512_bf16 == (name in BF16_FORMS), name
            assert kernels.has_vnni == (name in VNNI_FORMS), name
            assert not kernels.has_amx


# ------------------------------------------------------------------------- matrix products
def _product_bound(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, unit_out: float):
    """float64 x @ w^T + bias (the products are exact: bf16 x bf16 fits float32) and the bound
    on a float32 sum of those terms in any order, rounded once to the output dtype (unit_out)."""
    bias64 = torch.zeros(w.shape[0], dtype=torch.float64) if bias is None else bias.double()
    want = x.double() @ w.double().T + bias64
    magnitude = x.double().abs() @ w.double().abs().T + bias64.abs()
    terms = x.shape[1] + 1
    return want, unit_out * want.abs() + (1 + unit_out) * terms * U32 * magnitude


@pytest.mark.parametrize("rows", [1, 4, 6])
@pytest.mark.parametrize("out_features,in_features", [(37, 100), (96, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_within_float32_accumulation_of_the_products(
    kernels, rows, out_features, in_features, bias
):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    w = torch.randn(out_features, in_features, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    want, bound = _product_bound(x, w, b, UBF16)
    assert_within(kernels.gemv_bf16(x, w, b), want, bound, "gemv")


@pytest.mark.parametrize("rows", [0, 3, 9, 40, 300])  # the packed GEMV's rows, then the matmul's
@pytest.mark.parametrize("out_features,in_features", [(37, 100), (70, 1100)])
def test_packed_matmul_within_float32_accumulation_or_unsupported(
    kernels, rows, out_features, in_features
):
    """Without avx512_bf16 or AVX2 a packed matmul is an error, never an unwritten output."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    w = torch.randn(out_features, in_features, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16()
    gate_up = torch.randn(64, in_features, generator=gen).bfloat16()
    packed, gated = kernels.pack_weight(w), kernels.pack_weight(interleave_gate_up(gate_up))
    if not kernels.has_packed_matmul:
        with pytest.raises(RuntimeError, match="packed_linear"):
            kernels.packed_linear(x, packed, out_features, b)
        with pytest.raises(RuntimeError, match="packed_gated_silu"):
            kernels.packed_gated_silu(x, gated, 32, None)
        return
    want, bound = _product_bound(x, w, b, UBF16)
    assert_within(kernels.packed_linear(x, packed, out_features, b), want, bound, "bf16 out")
    logits = kernels.packed_linear(x, packed, out_features, b, float_out=True)
    want, bound = _product_bound(x, w, b, U32)
    assert_within(logits, want, bound, "float32 out")
    # The SiLU epilogue: bit for bit the unfused matmul and silu_and_mul of this build.
    fused = kernels.packed_gated_silu(x, gated, 32, None)
    unfused = kernels.silu_and_mul(kernels.packed_linear(x, kernels.pack_weight(gate_up), 64, None))
    assert torch.equal(fused, unfused)


@pytest.mark.parametrize("out_features,in_features", [(37, 100), (96, 576)])
@pytest.mark.parametrize("gated", [False, True])
def test_avx2_packed_rows_are_the_same_bits_whatever_the_batch(
    kernels, out_features, in_features, gated
):
    """Without bf16 dots (AVX2 FMA on the tile copy) each row's sums are one FMA chain over k in
    order at every row count, so a row alone, in a decode batch, in a verify step or in a
    prefill gives the same bits (and the fused SiLU its unfused kernels' bits)."""
    if not kernels.has_packed_matmul or kernels.has_avx512_bf16:
        pytest.skip("this form multiplies the tile copy with bf16 dots, or has no AVX2")
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(70, in_features, generator=gen).bfloat16()
    w = torch.randn(2 * out_features, in_features, generator=gen).bfloat16()
    b = torch.randn(2 * out_features, generator=gen).bfloat16()
    packed = kernels.pack_weight(w)
    whole = kernels.packed_linear(x, packed, 2 * out_features, b)
    for rows in (1, 2, 3, 5, 8, 13, 64, 65):
        part = kernels.packed_linear(x[:rows].contiguous(), packed, 2 * out_features, b)
        assert torch.equal(part.view(torch.int16), whole[:rows].view(torch.int16)), rows
    alone = torch.cat(
        [kernels.packed_linear(x[i : i + 1], packed, 2 * out_features, b) for i in range(70)]
    )
    assert torch.equal(alone.view(torch.int16), whole.view(torch.int16))
    if gated and out_features % 16 == 0:
        interleaved = kernels.pack_weight(interleave_gate_up(w))
        gated_bias = interleave_gate_up(b).contiguous()
        fused = kernels.packed_gated_silu(x, interleaved, out_features, gated_bias)
        assert torch.equal(fused.view(torch.int16), kernels.silu_and_mul(whole).view(torch.int16))


@pytest.mark.parametrize("bits", [8, 6, 4])
def test_quantized_products_in_every_form(kernels, bits):
    """Each form's quantized matmul, in the row layout and (with VNNI) the tile layout, against
    float64 dequantize-then-matmul: within float32 sums (float32 x), the bf16 weights of the
    wide paths (2^-6 of the largest output, bf16 x) or int8-rounded activations (2^-5, tiled)."""
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(40, 128, generator=gen)
    if bits == 4:
        qweight = quantize_int4(weight, 32)
    else:  # 6: 8-bit integers within -32..31, which the tile layout holds in 6 bits
        qweight = quantize_int8(weight, 32, limit=127 if bits == 8 else 31)
    dense = qweight.dequantize().double()
    for tiled in [False, True] if kernels.reads_tiles else [False]:
        projection = QuantizedProjection(qweight, kernels, tiled=tiled)
        for rows, dtype in itertools.product((1, 6, 20), DTYPES):
            x = torch.randn(rows, 128, generator=gen).to(dtype)
            got = projection(x, torch.empty(0), None).double()
            want = x.double() @ dense.T
            tol = 1e-5 if dtype == torch.float32 else 2**-5 if tiled else 2**-6
            assert (got - want).abs().max() <= tol * want.abs().max(), (tiled, rows, dtype)
        all_rows = projection.rows(torch.arange(40), torch.float32)
        assert torch.equal(all_rows, qweight.dequantize()), tiled


@pytest.mark.skipif("x86-64-v3" not in RUNNABLE, reason="needs AVX2")
@pytest.mark.parametrize(
    "tiled,weight_only", [(False, False), (True, False), (True, True)], ids=["rows", "tiles", "wo"]
)
@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (8, 32), (8, 576), (6, 32), (6, 16)])
def test_avx2_integer_rows_are_the_same_bits_whatever_the_batch(bits, group, tiled, weight_only):
    """The AVX2 form's bf16 rows as integers (the row layout's int16 up to AVX2_ROWS_MAX rows,
    the tiles' int8 for 4 and 6 bits, else int16, up to AVX2_TILED_MAX_ROWS; 8 bits' int16 at
    every row count): a row's output does not depend on the rows beside it, so a speculative
    verify step's rows give what decoding one by one gives. 43 weight rows: the row layout's
    batch-1 kernel leaves a tail of 3, the tiles a partial half; 576 columns: 18 groups of 32,
    the offsets' sums end in a partial vector."""
    kernels = variant("x86-64-v3")
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(43, 576, generator=gen)
    if bits == 4:
        qweight = quantize_int4(weight, group)
    else:  # 6: 8-bit integers within -32..31, which the tiles hold in 6 bits
        qweight = quantize_int8(weight, group, limit=127 if bits == 8 else 31)
    # float32 outputs: every bit of the sums shows (bf16 outputs would hide most differences)
    projection = QuantizedProjection(
        qweight, kernels, float_out=True, tiled=tiled, weight_only=weight_only
    )
    bound = AVX2_TILED_MAX_ROWS if tiled else 8
    most = 2 * bound + 5 if tiled and bits == 8 else bound  # 8 bits: past the bound, a prefill
    x = torch.randn(most, 576, generator=gen).to(torch.bfloat16)
    alone = torch.cat([projection(x[i : i + 1], torch.empty(0), None) for i in range(most)])
    for rows in sorted({2, 3, 5, 8, bound, most}):
        together = projection(x[:rows], torch.empty(0), None)
        assert torch.equal(together, alone[:rows]), (rows, (together - alone[:rows]).abs().max())
    path = kernels.quantized_path(projection.params, most, 576, torch.bfloat16)
    int8 = tiled and bits != 8 and not weight_only
    assert path == ("avx2-tiled-int8" if int8 else "avx2-tiled-int16" if tiled else "avx2-int16")
    # So a verify step of any size keeps an 8-bit weight's rows; 4 and 6 bits stop at the bound.
    bounds = projection.path_changes(4 * AVX2_TILED_MAX_ROWS)
    if tiled:
        assert bounds == ([] if bits == 8 else [AVX2_TILED_MAX_ROWS]), bounds


# ----------------------------------------------------------------------- elementwise kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [40, 576, 8200])  # scalar tail, a model row, past 8192
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_within_its_roundings(kernels, dtype, hidden, with_residual):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, hidden, generator=gen).to(dtype)
    residual = torch.randn(5, hidden, generator=gen).to(dtype) if with_residual else None
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    out, new_residual = kernels.add_rms_norm(x, residual, weight, 1e-5)
    h = x if residual is None else x + residual  # one rounding to the dtype, as in C
    assert torch.equal(new_residual, h)
    h64 = h.double()
    inv_rms = (h64.square().mean(-1, keepdim=True) + 1e-5).rsqrt()
    want = weight.double() * (h64 * inv_rms)
    # The mean of squares in float32 (hidden terms), the sqrt and division, then two roundings
    # to the dtype (h * inv_rms, then the weight's product).
    unit = U32 if dtype == torch.float32 else UBF16
    bound = want.abs() * ((hidden + 8) * U32 + 2 * unit + unit**2)
    assert_within(out, want, bound, "rms norm")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [40, 1536])  # scalar tail, vector body
def test_silu_and_mul_within_its_roundings(kernels, dtype, inter):
    gen = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(9, 2 * inter, generator=gen) * 4).to(dtype)
    gate, up = gate_up.double().chunk(2, dim=-1)
    want = gate * torch.sigmoid(gate) * up
    # silu in float32 (exp, 1 + e, division), rounded to the dtype, times up, rounded again.
    unit = U32 if dtype == torch.float32 else UBF16
    bound = want.abs() * ((EXP_ULPS + 4) * U32 + 2 * unit + unit**2)
    assert_within(kernels.silu_and_mul(gate_up), want, bound, "silu")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 20, 64, 128])  # 20: the scalar tail alone
def test_rotary_matches_torch_in_place(kernels, dtype, head_dim):
    """bf16: every product and the sum rounded where torch rounds them, so bit for bit; float32
    within the roundings of two products and a sum (or one fused multiply-add)."""
    gen = torch.Generator().manual_seed(4)
    tokens, heads, max_pos = 11, 3, 50
    angles = torch.rand(max_pos, head_dim // 2, generator=gen) * 7
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    fused = torch.randn(tokens, 2 * heads * head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen)
    q = fused[:, : heads * head_dim].view(tokens, heads, head_dim)  # strided rows, as in qkv
    untouched = fused[:, heads * head_dim :].clone()
    x64, c64, s64 = q.double(), cos[positions, None].double(), sin[positions, None].double()
    rotated = torch.cat((-x64[..., head_dim // 2 :], x64[..., : head_dim // 2]), dim=-1)
    tables = (cos[positions].to(dtype)[:, None], sin[positions].to(dtype)[:, None])
    want_bf16 = _rotate(q.clone(), *tables)
    kernels.rotary_(q, positions, cos, sin)
    if dtype == torch.bfloat16:
        assert torch.equal(q, want_bf16)
    else:
        bound = 3 * U32 * ((x64 * c64).abs() + (rotated * s64).abs())
        assert_within(q, x64 * c64 + rotated * s64, bound, "rotary")
    assert torch.equal(fused[:, heads * head_dim :], untouched)


# -------------------------------------------------------------------------------- sampling
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [1, 15, 16, 1000])
def test_argmax_equals_torch_max_with_ties_and_nans(kernels, dtype, cols):
    gen = torch.Generator().manual_seed(6)
    x = torch.randint(-3, 4, (7, cols), generator=gen).to(dtype)  # many ties: the first wins
    if cols > 20:
        x[1, 5] = x[1, cols - 3] = float("nan")  # the first NaN wins
        x[2, cols - 1] = 100.0
        x[3] = float("-inf")
    assert torch.equal(kernels.argmax(x), x.max(dim=-1).indices)
    assert kernels.argmax(x[:0]).shape == (0,)


@pytest.mark.parametrize("normalize", [False, True])
def test_tempered_softmax_within_its_roundings(kernels, normalize):
    """softmax(x / T) by rows, each weight within a float32 exp's error of the float64 one (0
    where that is below e^-87, -inf included), normalised or with the largest 1."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(5, 1000, generator=gen) * 8  # some weights below e^-87
    x[2, 100:200] = float("-inf")
    temperatures = torch.tensor([0.3, 1.0, 2.5, 0.7, 1e-3])
    got = kernels.tempered_softmax(x, temperatures, normalize, torch.empty_like(x))
    z = (x.double() - x.double().amax(-1, keepdim=True)) / temperatures.double()[:, None]
    want = torch.where(z >= -87, z.exp(), torch.zeros_like(z))
    if normalize:
        want = want / want.sum(-1, keepdim=True)
    slack = U32 * (3 * z.abs().clamp(max=87) + EXP_ULPS + (1000 if normalize else 0))
    assert_within(got, want, want * slack + 1e-37, "tempered_softmax")  # (e^-87 ~ 1.6e-38)
    assert bool((got[2, 100:200] == 0).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [50, 64, 1000])
def test_mask_disallowed_equals_the_torch_ops(kernels, dtype, cols):
    """The rows named keep the columns whose bit is set (whole words set, clear and mixed, a
    last word past the columns), every other logit -inf; rows not named untouched."""
    from minisgl.kernel.ops import TORCH_OPS

    gen = torch.Generator().manual_seed(10)
    logits = torch.randn(5, cols, generator=gen).to(dtype)
    words = (cols + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=gen, dtype=torch.int32)
    bitmask[0, 0], bitmask[1, :] = -1, 0  # all allowed / none allowed
    rows = torch.tensor([4, 1, 2])
    got, want = logits.clone(), logits.clone()
    kernels.mask_disallowed(got, rows, bitmask)
    TORCH_OPS.mask_disallowed(want, rows, bitmask)
    assert torch.equal(got, want)
    assert torch.equal(got[[0, 3]], logits[[0, 3]]) and bool(torch.isinf(got[1]).all())
    # A row outside the logits, or a bitmask narrower than them: refused, nothing written.
    for bad_rows, bad_mask in ((torch.tensor([5, 0, 0]), bitmask), (rows, bitmask[:, :1])):
        before = got.clone()
        with pytest.raises(ValueError, match="mask_disallowed"):
            kernels.mask_disallowed(got, bad_rows, bad_mask)
        assert torch.equal(got, before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_flag_non_finite_equals_the_torch_ops(kernels, dtype):
    """A row whose chosen logit is NaN or infinite, or whose token is no column (never read),
    gives -1 and a safe 0; every other row its token twice."""
    from minisgl.kernel.ops import TORCH_OPS

    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(9, 50, generator=gen).to(dtype)
    sampled = torch.tensor([3, 7, 0, 49, -1, 50, 2**31 - 1, 12, 5], dtype=torch.int32)
    logits[1, 7], logits[2, 0], logits[3, 49] = float("nan"), float("inf"), float("-inf")
    logits[8, :5] = float("nan")  # only the chosen logit is read
    got = kernels.flag_non_finite(logits, sampled)
    want = TORCH_OPS.flag_non_finite(logits, sampled)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[0].tolist() == [3, -1, -1, -1, -1, -1, -1, 12, 5]
    assert got[1].tolist() == [3, 0, 0, 0, 0, 0, 0, 12, 5]


def test_sampling_draws_the_inverse_distribution(kernels):
    """Weights that float32 sums exactly (small integers): the draw is exactly the first column
    whose running sum exceeds u x total. From logits: the draw's interval of the float64
    distribution holds u, up to the float32 sums' and exps' error."""
    gen = torch.Generator().manual_seed(5)
    weights = torch.randint(0, 4, (6, 300), generator=gen).float()
    weights[:, :10] = 0  # no draw lands on a zero weight
    uniforms = torch.rand(6, dtype=torch.float64, generator=gen)
    cumulative = weights.double().cumsum(-1)
    want = torch.searchsorted(cumulative, (uniforms * cumulative[:, -1])[:, None], right=True)
    assert torch.equal(kernels.sample_rows(weights, uniforms), want[:, 0])
    logits = torch.randn(6, 1000, generator=gen) * 3
    temperatures = torch.tensor([0.5, 1.0, 2.0, 0.7, 1.3, 3.0])
    tokens = kernels.sample_rows(logits, uniforms, temperatures)
    probs = (logits.double() / temperatures.double()[:, None]).softmax(-1)
    upper = probs.cumsum(-1).gather(1, tokens[:, None])[:, 0]
    lower = upper - probs.gather(1, tokens[:, None])[:, 0]
    # Each weight exp((x - top) / T) within (3 |z| + EXP_ULPS) U32 (three rounded operations
    # on its argument z, then exp), the running sums within a float32 sum of every column.
    z_max = 2 * logits.abs().amax(-1).double() / temperatures.double()
    slack = U32 * (logits.shape[1] + 3 * z_max + EXP_ULPS + 4)
    assert bool(((lower - slack <= uniforms) & (uniforms < upper + slack)).all())


@pytest.mark.parametrize("k", [1, 7, 300])
def test_top_candidates_equal_a_stable_sort(kernels, k):
    gen = torch.Generator().manual_seed(6)
    x = torch.randint(-20, 20, (5, 300), generator=gen).float()  # ties: the first column first
    # Fewer finite values than k (a masked row): -inf ones fill the rest, the first first.
    x[3] = float("-inf")
    x[3, 40] = x[3, 250] = 1.0
    x[4, ::2], x[4, 1::2] = -0.0, 0.0  # equal values: the first column first, whatever the sign
    x[4, 7] = 5.0
    values, indices = kernels.top_candidates(x, k)
    want_values, want_indices = x.sort(dim=-1, descending=True, stable=True)
    assert torch.equal(values, want_values[:, :k]) and torch.equal(indices, want_indices[:, :k])
    # A row of NaNs but two values: those among the k, and every column a real one.
    x[0], x[0, 9], x[0, 200] = float("nan"), 2.0, 1.0
    values, indices = kernels.top_candidates(x[:1], k)
    assert {9, 200} & set(indices[0].tolist()) == ({9} if k == 1 else {9, 200})
    assert bool(((indices >= 0) & (indices < 300)).all())


@pytest.mark.parametrize(
    ("parts", "rank", "k"), [([24, 8, 8], 4, 40), ([16], 8, 7), ([10, 10], 3, 33)]
)
def test_lora_add_within_its_roundings(kernels, parts, rank, k):
    """The adapters' deltas as the C decode layer adds them (layers/lora.py), rows of several
    slots and of none: each row's delta within its float32 sums' rounding of the exact one,
    rounded to bf16 and added in bf16; rows without an adapter untouched, bit for bit."""
    from minisgl.kernel.abi import ProjectionParams

    gen = torch.Generator().manual_seed(7)
    slots, n = 3, sum(parts)
    width = len(parts) * slots * rank
    a, bt = torch.randn(width, k, generator=gen), torch.randn(width, n, generator=gen)
    x = torch.randn(7, k, generator=gen).bfloat16()
    y = torch.randn(7, n, generator=gen).bfloat16()
    row_slots = torch.tensor([0, -1, 2, 1, -1, 2, 0])
    params = ProjectionParams(lora_a=a.data_ptr(), lora_bt=bt.data_ptr())
    params.lora_parts, params.lora_slots, params.lora_rank = len(parts), slots, rank
    part_rows = torch.tensor(parts, dtype=torch.int64)
    params.lora_part_rows = part_rows.data_ptr()
    got = y.clone()
    kernels.lora_add(x, got, params, row_slots)
    delta, scale = torch.zeros(7, n, dtype=torch.float64), torch.zeros(7, n, dtype=torch.float64)
    for t, slot in enumerate(row_slots.tolist()):
        if slot < 0:
            continue
        start = 0
        for part, rows in enumerate(parts):
            cols = slice((part * slots + slot) * rank, (part * slots + slot + 1) * rank)
            h = a[cols].double() @ x[t].double()
            h_abs = a[cols].double().abs() @ x[t].double().abs()
            delta[t, start : start + rows] = bt[cols, start : start + rows].double().T @ h
            scale[t, start : start + rows] = bt[cols, start : start + rows].double().abs().T @ h_abs
            start += rows
    want = y.double() + delta
    bound = 2 * (k + rank) * U32 * scale + UBF16 * (delta.abs() + want.abs()) * 1.01
    assert_within(got, want, bound, "lora_add")
    untouched = row_slots < 0
    assert torch.equal(got[untouched], y[untouched])
