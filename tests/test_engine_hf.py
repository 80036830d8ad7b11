"""Greedy generation equals Hugging Face transformers (float32) token for token."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    MIXED_PROMPTS,
    assert_all_pages_free,
    assert_logits_match_hf,
    build_llm,
    greedy,
    hf_greedy,
    hf_logits,
    spy_logits,
)

ARCHS = ["llama3", "qwen2", "qwen3", "mistral", "smollm2"]
# Different lengths make requests leave at different steps, so slots are reused mid-run.
MAX_NEW = [12, 5, 16, 9, 3, 14, 7, 10]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf_with_continuous_batching(arch: str, page_size: int) -> None:
    # Fewer running slots than prompts: requests join and leave between steps.
    llm = build_llm(arch, page_size=page_size, max_running_req=3, cache_type="naive")
    params = [greedy(n) for n in MAX_NEW]
    outputs = llm.generate(MIXED_PROMPTS, params)
    expected = hf_greedy(arch, MIXED_PROMPTS, MAX_NEW)
    for out, want, prompt in zip(outputs, expected, MIXED_PROMPTS):
        assert out["token_ids"] == want, f"{arch} page_size={page_size} prompt={prompt!r}"
    assert_all_pages_free(llm)
    assert llm.cache_manager.num_free_pages == llm.engine.num_pages
    llm.shutdown()


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_hf(arch: str) -> None:
    llm = build_llm(arch, cache_type="naive", overlap_schedule=False)
    captured = spy_logits(llm, "prefill")
    llm.generate(MIXED_PROMPTS, greedy(1))
    assert len(captured) == 1, "all prompts fit one prefill batch"
    assert_logits_match_hf(captured[0], arch, MIXED_PROMPTS)
    llm.shutdown()


@pytest.mark.parametrize("arch", ["qwen3", "llama3"])
def test_equal_length_prompts_share_one_causal_attention_call(arch: str) -> None:
    """Fresh prompts of one length take a single batched causal SDPA call (mixed lengths are
    covered above); logits and greedy tokens still equal HF's."""
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 200, (11,), generator=gen).tolist() for _ in range(4)]
    llm = build_llm(arch, cache_type="naive", overlap_schedule=False)
    captured = spy_logits(llm, "prefill")
    outputs = llm.generate(prompts, greedy(6))
    assert len(captured) == 1
    assert_logits_match_hf(captured[0], arch, prompts)
    assert [o["token_ids"] for o in outputs] == hf_greedy(arch, prompts, [6] * 4)
    assert_all_pages_free(llm)
    llm.shutdown()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_default_model_says_paris(dtype: torch.dtype) -> None:
    llm = build_llm("smollm2", cache_type="naive", dtype=dtype)
    out = llm.generate(["The capital of France is"], greedy(4))[0]
    assert out["text"].startswith(" Paris")
    assert out["finish_reason"] == "length"
    llm.shutdown()


@pytest.mark.parametrize("matmuls", ["native", "float32"])
def test_bf16_prefill_top1_agrees_with_hf_fp32(matmuls: str, monkeypatch) -> None:
    """float32: the projections of a CPU where neither the C kernels nor oneDNN multiply bf16
    (AVX2 only), which multiply the bf16 weights in float32."""
    from minisgl.core import set_global_ctx
    from minisgl.layers import linear as linear_mod

    if matmuls == "float32":
        monkeypatch.setattr(linear_mod, "c_matmuls_take", lambda dtype, kernels: False)
        monkeypatch.setattr(linear_mod, "onednn_packs", lambda dtype: dtype == torch.float32)
    llm = build_llm("smollm2", dtype=torch.bfloat16, cache_type="naive", overlap_schedule=False)
    all_logits = []
    orig = llm._forward

    def spy(forward_input):
        out = orig(forward_input)
        batch = forward_input.batch
        if batch.is_prefill:  # rerun the step for every position's logits (KV writes repeat)
            set_global_ctx(llm.engine.ctx)
            llm.engine.ctx.set_batch(batch)
            with torch.inference_mode():
                all_logits.append(llm.engine.model(batch.input_ids, batch.positions))
            llm.engine.ctx.set_batch(None)
        return out

    llm._forward = spy
    llm.generate(MIXED_PROMPTS, greedy(1))
    ours = torch.cat(all_logits).argmax(-1)
    want = torch.cat([hf_logits("smollm2", prompt).argmax(-1) for prompt in MIXED_PROMPTS])
    assert len(ours) == len(want)
    agreement = (ours == want).float().mean().item()
    assert agreement >= 0.95, f"bf16 top-1 agrees with fp32 HF at {agreement:.1%} of positions"
    projection = llm.engine.model.model.layers[0].mlp.down_proj.cpu_projection
    assert projection is not None
    # natively in float32 too where neither the C kernels nor oneDNN multiply bf16 (AVX2 only)
    native_float32 = linear_mod.computes_in_float32(torch.bfloat16, projection.kernels)
    assert projection.in_float32 == (matmuls == "float32" or native_float32)
    llm.shutdown()
