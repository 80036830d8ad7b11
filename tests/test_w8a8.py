"""W8A8 (`--quantization int8` where the kernels read the tile layout): the bf16 rows of a decode
batch or a prefill (more than W8A8_MIN_ROWS) rounded to int8 per row and multiplied with the int8
weight in int8 products (the AMX int8 tiles, else vpdpbusd), the call's largest columns kept
apart. The kernels' shapes and bounds are tests/test_kernel_fuzz.py's (on every CPU, through the
emulated builds); here their accuracy on outlier channels and the engine's choice of them."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import MIXED_PROMPTS, assert_all_pages_free, build_llm, greedy, spy_logits

from minisgl.kernel.cpu import CpuKernels, cpu_kernels
from minisgl.layers.quant_weight import quantize_int8
from minisgl.layers.quantized import W8A8_MIN_ROWS, QuantizedProjection

KERNELS = cpu_kernels()
W8A8_PATHS = ("tiled-w8a8", "tiled-w8a8-vnni")


def _w8a8_kernels(path: str) -> CpuKernels | None:
    """Kernels that take W8A8 by `path`: this CPU's where they do, else an emulated build's
    (the Xeon's int8 tiles; vpdpbusd without them, Ice Lake's)."""
    if KERNELS is None:
        return None
    if path == "tiled-w8a8" and KERNELS.has_amx_int8:
        return KERNELS
    from test_kernel_fuzz import form

    if path == "tiled-w8a8":
        return form("avx512-bf16-amx-emulated+amx")
    # The engine picks W8A8 only with AMX-INT8; a build without int8 tiles told it has them
    # runs the same call in vpdpbusd.
    kernels = copy.copy(form("avx512-vnni-emulated"))
    kernels.has_amx_int8 = True
    return kernels


def _w8a8_runs(kernels: CpuKernels | None) -> int:
    """Calls that took either W8A8 path so far."""
    if kernels is None:
        return 0
    runs = kernels.quantized_path_runs()
    return sum(runs[path] for path in W8A8_PATHS)


@pytest.mark.skipif(KERNELS is None, reason="the C kernels are not built here")
@pytest.mark.parametrize("path", W8A8_PATHS)
@pytest.mark.parametrize("rows", [W8A8_MIN_ROWS + 1, 16, 200])
def test_outlier_channels_keep_w8a8_within_a_percent(path: str, rows: int) -> None:
    """Activations with a few channels 100x the rest (as LLMs' are): rounding each row to int8
    by its largest value would leave the other channels a few steps; with the largest columns
    kept apart the product stays as close to the exact one as weight-only's (Sapphire Rapids:
    0.25% and 0.24%)."""
    kernels = _w8a8_kernels(path)
    assert kernels is not None
    gen = torch.Generator().manual_seed(8)
    in_features = 512
    weight = quantize_int8(torch.randn(96, in_features, generator=gen))
    x = torch.randn(rows, in_features, generator=gen)
    x[:, torch.randperm(in_features, generator=gen)[:6]] *= 100
    x = x.bfloat16()
    want = x.float() @ weight.dequantize().T
    for int8_x, bound in ((True, 0.01), (False, 0.005)):
        projection = QuantizedProjection(
            weight, kernels, int8_activations=int8_x, weight_only=not int8_x
        )
        assert projection.int8_x == int8_x
        before = kernels.quantized_path_runs()[path]
        got = projection(x, torch.empty(0), None).float()
        ran = kernels.quantized_path_runs()[path] - before
        assert ran == int(int8_x), (int8_x, ran)
        relative = ((got - want).norm() / want.norm()).item()
        assert relative < bound, (int8_x, relative)
    # Below W8A8_MIN_ROWS rows a call keeps the 16-bit or per-32-column paths.
    projection = QuantizedProjection(weight, kernels, int8_activations=True)
    route = projection.route(W8A8_MIN_ROWS, torch.bfloat16)
    taken = kernels.quantized_path(projection.params, W8A8_MIN_ROWS, in_features, x.dtype)
    assert route != "kernel" or taken not in W8A8_PATHS, (route, taken)


@pytest.mark.skipif(KERNELS is None, reason="the C kernels are not built here")
def test_a_w8a8_gate_up_runs_silu_in_its_epilogue_as_the_unfused_product() -> None:
    """A gated int8 gate_up in vpdpbusd: SiLU in the matmul equals silu(gate) * up of the same
    W8A8 product, unfused (the outliers are the call's: the same columns either way)."""
    kernels = _w8a8_kernels("tiled-w8a8-vnni")
    assert kernels is not None
    gen = torch.Generator().manual_seed(4)
    weight = quantize_int8(torch.randn(2 * 48, 160, generator=gen))
    gated = QuantizedProjection(weight, kernels, gated=True, int8_activations=True)
    plain = QuantizedProjection(weight, kernels, int8_activations=True)
    for rows in (W8A8_MIN_ROWS + 1, 37, 130):
        x = torch.randn(rows, 160, generator=gen).bfloat16()
        act = gated.silu_and_mul(x)
        assert act is not None, rows
        gate_up = plain(x, torch.empty(0), None)
        want = torch.nn.functional.silu(gate_up[:, :48]) * gate_up[:, 48:]
        torch.testing.assert_close(act.float(), want.float(), rtol=0.02, atol=0.02)


def _prefill_logits(quantization: str) -> tuple[torch.Tensor, tuple[int, int]]:
    """The bf16 prefill logits of MIXED_PROMPTS (one batch, > W8A8_MIN_ROWS rows) and how many
    matmuls took the W8A8 path: in that prefill, and in the decode steps of a batch of 8."""
    llm = build_llm("qwen3", quantization=quantization, dtype=torch.bfloat16)
    prefill = spy_logits(llm, "prefill")
    before = _w8a8_runs(KERNELS)
    llm.generate(MIXED_PROMPTS, greedy(1))
    ran = _w8a8_runs(KERNELS) - before
    assert len(prefill) == 1 and len(prefill[0]) == len(MIXED_PROMPTS), len(prefill)
    decode = spy_logits(llm, "decode")
    before = _w8a8_runs(KERNELS)
    outputs = llm.generate(MIXED_PROMPTS[:8], greedy(4))
    decode_ran = _w8a8_runs(KERNELS) - before
    assert all(len(out["token_ids"]) == 4 for out in outputs), outputs
    assert decode and all(len(step) == 8 for step in decode), [len(step) for step in decode]
    assert_all_pages_free(llm)
    llm.shutdown()
    return prefill[0].float(), (ran, decode_ran)


def test_int8_serves_a_prefill_w8a8_where_the_cpu_has_int8_products() -> None:
    """`int8` and `int8-wo` hold the same weights: with VNNI or AMX-INT8 a bf16 prefill, and a
    decode batch, of more than W8A8_MIN_ROWS rows takes W8A8 under `int8` only, and the
    prefill's logits stay close to weight-only's; elsewhere the two are the same computation,
    logits equal."""
    torch.set_num_threads(2)
    wo, wo_ran = _prefill_logits("int8-wo")
    w8a8, w8a8_ran = _prefill_logits("int8")
    assert wo_ran == (0, 0)
    if KERNELS is None or not KERNELS.has_vnni:
        assert w8a8_ran == (0, 0) and torch.equal(w8a8, wo)
        return
    # every projection of the 3 decode steps of 8 rows (the head stays weight-only)
    if KERNELS.has_amx_int8:
        assert w8a8_ran[0] > 0 and w8a8_ran[1] >= 3 * 4, w8a8_ran
    else:  # VNNI alone: int8 rounded per 32 columns (tiled-int8), not per row
        assert w8a8_ran == (0, 0), w8a8_ran
    # A random-weight model (flat, near-tied distributions): logits within a few percent, the
    # same argmax nearly everywhere (measured on Sapphire Rapids: 1.2% and every row).
    relative = ((w8a8 - wo).norm() / wo.norm()).item()
    same = (w8a8.argmax(dim=-1) == wo.argmax(dim=-1)).float().mean().item()
    assert relative < 0.05 and same >= 0.8, (relative, same)
