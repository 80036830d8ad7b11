"""Quantized models whose every width is 32 mod 64 (helpers' qwen3-w96 and qwen3-moe-w96: hidden
96, heads of 32, FFN 160, experts' 96; no in_features is whole 64-column blocks, which on VNNI
CPUs is the int8 tiles' odd last 32 columns, once an out-of-bounds write), int8 and int4 loaded in
float32: with the C kernels on (the build `cpu_kernels()` gives, i.e. whatever MINISGL_CPU_TARGET
selects), at 1 and 2 kernel threads, they generate what the PyTorch path (MINISGL_CPU_KERNELS=0:
the weights dequantized, F.linear) does for prompts of 1 to 150 tokens submitted together, and
each of their quantized projections equals its dequantized weight's product.

Tolerances: the generations' chosen-token log-probabilities within 2e-3 (float32 on both sides:
they differ by accumulation order only, ~1e-6 here; a wrong kernel is off by far more), the same
tokens except after a tie (the reference's top two within 1e-4). The projections against float64:
float32 x, K * 2^-24 * sum|x||w| per output (accumulation in any order; every path multiplies x by
the weight dequantized exactly); bf16 x, also one bf16 rounding of the output and of each product
(2^-8: the weight dequantized to bf16, or x and w on AMX), and where the tiled kernels round x to
integers per 32 columns, its step: 2^-15 of the 32 columns' largest |x| where x is kept to 16
bits (a precise weight; AVX2's 8-bit tiles up to AVX2_TILED_MAX_ROWS rows), else 1/254 of it
(int8, Q8_0), times sum|w|."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_all_pages_free, build_llm

from minisgl.core import SamplingParams
from minisgl.env import ENV
from minisgl.kernel import cpu as cpu_mod
from minisgl.layers.moe import SparseMoE
from minisgl.layers.quant_tiles import TiledWeight
from minisgl.layers.quantized import AVX2_TILED_MAX_ROWS, QuantizedProjection

MODELS = ["qwen3-w96", "qwen3-moe-w96"]
PROMPT_LENGTHS = (1, 2, 17, 64, 129, 150)
MAX_NEW = 8
# Prefill chunks of 150 tokens: 150, 150 and 63 rows, so prefill takes both the weights
# dequantized once per call (over QUANTIZED_GEMV_MAX_ROWS rows) and the C kernels' product, and
# prompts are cut across chunks; decode multiplies 6 rows in the C kernels.
PREFILL_CHUNK = 150
LOGPROB_ATOL = 2e-3
TIE = 1e-4
PROJECTION_ROWS = (1, 3, 5, 16, 17, 64, 129, 150)
U32, UBF16 = 2.0**-24, 2.0**-8

pytestmark = pytest.mark.skipif(
    cpu_mod.cpu_kernels() is None, reason="no C kernels on this machine (or MINISGL_CPU_KERNELS=0)"
)


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(96)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def _projections(model: torch.nn.Module) -> dict[str, QuantizedProjection]:
    """Every quantized projection by name: the layers', the head's, each expert's."""
    found: dict[str, QuantizedProjection] = {}
    for name, module in model.named_modules():
        projection = getattr(module, "cpu_projection", None)
        if isinstance(projection, QuantizedProjection):
            found[name] = projection
        if isinstance(module, SparseMoE):
            for stack, experts in zip(("gate_up", "down"), module.stacks()):
                for e, expert in enumerate(experts.projections or []):
                    if isinstance(expert, QuantizedProjection):
                        found[f"{name}.{stack}[{e}]"] = expert
    return found


def _bound(
    x: torch.Tensor, w: torch.Tensor, want: torch.Tensor, tiled: bool, sixteen_bits: bool
) -> torch.Tensor:
    """Per output, how far any path's product of x [M, K] and w [N, K] may be from the exact
    one `want` (see the module docstring); sixteen_bits: tiled x kept to 16 bits."""
    k = x.shape[1]
    magnitudes = x.abs().double() @ w.abs().double().T
    bound = k * U32 * magnitudes
    if x.dtype == torch.bfloat16:
        bound = bound + UBF16 * (want.abs() + magnitudes)
        if tiled:
            block_max = x.double().abs().view(x.shape[0], -1, 32).amax(dim=2)
            step = 2.0**-15 if sixteen_bits else 1 / 254
            bound = bound + step * (block_max.repeat_interleave(32, dim=1) @ w.abs().double().T)
    return bound


def _check_projections(projections: dict[str, QuantizedProjection]) -> None:
    """Each projection at PROJECTION_ROWS rows of float32 and bf16 x against its dequantized
    weight in float64, at 1 and 2 kernel threads."""
    gen = torch.Generator().manual_seed(7)
    threads = torch.get_num_threads()
    try:
        for name, projection in projections.items():
            w = projection.weight.dequantize()
            tiled = isinstance(projection.weight, TiledWeight)
            vnni = projection.kernels is not None and projection.kernels.has_vnni
            for rows in PROJECTION_ROWS:
                x32 = torch.randn(rows, projection.in_features, generator=gen)
                # AVX2's tiles: 8-bit weights meet x as int16, more rows in float32.
                wide = rows > AVX2_TILED_MAX_ROWS or projection.weight.bits == 8
                avx2_sixteen_bits = not vnni and wide
                for x in (x32, x32.bfloat16()):
                    want = x.double() @ w.double().T
                    bound = _bound(x, w, want, tiled, projection.precise or avx2_sixteen_bits)
                    for count in (1, 2):
                        torch.set_num_threads(count)
                        got = projection(x, torch.empty(0), None).double()
                        excess = ((got - want).abs() - bound).max().item()
                        where = (name, tuple(w.shape), type(projection.weight).__name__, rows)
                        assert excess <= 0, (*where, x.dtype, count, excess)
    finally:
        torch.set_num_threads(threads)


def _generate(model: str, quantization: str, kernels_on: bool, threads: int, monkeypatch):
    """Every prompt's generated (token, logprob, top-2) steps, greedy, all prompts submitted
    together; with the C kernels on, the model's projections checked too."""
    torch_threads = torch.get_num_threads()
    with monkeypatch.context() as patch:
        patch.setattr(ENV.CPU_KERNELS, "value", kernels_on)
        patch.setattr(ENV.NUM_THREADS, "value", threads)
        cpu_mod.cpu_kernels.cache_clear()
        try:
            kernels = cpu_mod.cpu_kernels()
            assert (kernels is not None) == kernels_on
            llm = build_llm(
                model,
                quantization=quantization,
                max_running_req=len(PROMPT_LENGTHS),
                max_prefill_length=PREFILL_CHUNK,
            )
            projections = _projections(llm.engine.model)
            assert projections
            for name, projection in projections.items():
                assert projection.in_features % 64 == 32, (name, projection.shape)
                if kernels is not None:  # the layout the kernels under test take
                    tiled = isinstance(projection.weight, TiledWeight)
                    assert tiled == kernels.reads_tiles, name
            prompts = _prompts(llm.engine.model_config.vocab_size)
            params = SamplingParams(
                temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2
            )
            outputs = llm.generate(prompts, params)
            assert_all_pages_free(llm)
            llm.shutdown()
            if kernels_on:
                _check_projections(projections)
        finally:
            cpu_mod.cpu_kernels.cache_clear()
            torch.set_num_threads(torch_threads)
    assert all(o["error"] is None and len(o["token_ids"]) == MAX_NEW for o in outputs)
    return [o["logprobs"] for o in outputs]


def _assert_same_generation(got: list, want: list, label: str) -> None:
    """The same tokens and chosen-token log-probabilities within LOGPROB_ATOL; a request may
    part only where the reference's top two were within TIE (then its comparison ends)."""
    for request, (ours, reference) in enumerate(zip(got, want, strict=True)):
        for step, (mine, theirs) in enumerate(zip(ours, reference, strict=True)):
            token, logprob, _ = mine
            want_token, want_logprob, want_top = theirs
            where = f"{label} prompt of {PROMPT_LENGTHS[request]} tokens, step {step}"
            if token != want_token:
                alternatives = dict((t, lp) for t, lp in want_top)
                tied = token in alternatives and want_logprob - alternatives[token] <= TIE
                assert tied, f"{where}: token {token} != {want_token} (top {want_top})"
                break
            assert abs(logprob - want_logprob) <= LOGPROB_ATOL, (where, logprob, want_logprob)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("model", MODELS)
def test_c_kernels_generate_what_the_torch_path_does(model, quantization, monkeypatch) -> None:
    want = _generate(model, quantization, False, 2, monkeypatch)
    for threads in (1, 2):
        got = _generate(model, quantization, True, threads, monkeypatch)
        _assert_same_generation(got, want, f"{model} {quantization} {threads} threads")
