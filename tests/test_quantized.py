"""int8 weight-only quantization at load: each quantized projection equals dequantize-then-
matmul within its dtype's rounding, and a quantized engine's top-1 next tokens agree with the
same model unquantized (teacher-forced over the test prompts)."""

from __future__ import annotations

import pytest
import torch
from helpers import MIXED_PROMPTS, assert_all_pages_free, build_llm, greedy

from minisgl.core import SamplingParams
from minisgl.engine.config import EngineConfig
from minisgl.layers.quantized import Int8Projection, quantize_int8


def test_quantize_int8_rounds_to_the_nearest_step() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=gen)
    weight[3] = 0.0  # an all-zero channel keeps a usable scale
    q, scales = quantize_int8(weight)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert torch.all((q.float() * scales[:, None] - weight).abs() <= scales[:, None] / 2 + 1e-7)
    assert scales[3] == 1.0 and not q[3].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_projection_equals_dequantize_then_matmul(dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(96, 128, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(2, 5, 128, generator=gen).to(dtype)
    projection = Int8Projection(weight)
    got = projection(x, weight.new_empty(0), bias)
    scales = projection.scales.to(dtype).float()  # what the kernel multiplies with
    want = x.float() @ (projection.qweight.float() * scales[:, None]).T + bias.float()
    assert got.shape == (2, 5, 96) and got.dtype == dtype
    tol = 2**-7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())


def test_int8_engine_agrees_with_the_unquantized_model() -> None:
    torch.set_num_threads(2)
    prompts = [p for p in MIXED_PROMPTS if isinstance(p, str)]
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    top1 = {}
    for quantization in (None, "int8"):
        llm = build_llm("qwen3", quantization=quantization)  # float32: quantization alone differs
        outs = llm.generate(prompts, params)
        top1[quantization] = [
            [top[0][0] for _, _, top in out["prompt_logprobs"][1:]] for out in outs
        ]
        assert llm.generate(prompts[:2], greedy(8))[0]["token_ids"]
        assert_all_pages_free(llm)
        llm.shutdown()
    pairs = [(a, b) for x, y in zip(top1[None], top1["int8"]) for a, b in zip(x, y)]
    agreement = sum(a == b for a, b in pairs) / len(pairs)
    # 0.964 here; a random-weight model's flat distributions make near ties common, so the
    # bound leaves room for another CPU's rounding (the default model: 0.964 against bf16).
    assert len(pairs) > 100 and agreement >= 0.93, agreement


def test_unknown_quantization_is_refused() -> None:
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(model_path="x", quantization="int3")
