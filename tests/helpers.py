"""Shared test fixtures: tiny random-weight models per architecture, and the HF oracle."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

import torch

from minisgl.core import SamplingParams
from minisgl.llm import LLM
from minisgl.utils.hf import cache_dir, default_model_path

# Prompts of very different lengths (1 to 100+ tokens) for batch-mix tests.
LONG_TEXT = (
    "In the beginning the universe was created. This has made a lot of people very angry and "
    "been widely regarded as a bad move. Many were increasingly of the opinion that they'd all "
    "made a big mistake in coming down from the trees in the first place. And some said that "
    "even the trees had been a bad move, and that no one should ever have left the oceans. "
    "Far out in the uncharted backwaters of the unfashionable end of the western spiral arm"
)
MIXED_PROMPTS: list[str | list[int]] = [
    [42],
    "The capital of France is",
    "Hello, my name is",
    LONG_TEXT,
    "1, 2, 3, 4, 5,",
    "def fibonacci(n):",
    LONG_TEXT[:200],
    "Write a haiku about the sea.",
]
# The seed chapter's prompts: two share a prefix and are prefilled in the same batch.
PROMPTS = [
    "The capital of France is",
    "The capital of France is a city that",
    "Once upon a time, in a small village,",
    "def add(a, b):",
    "The three primary colors are",
]

_TINY_BASE = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    rms_norm_eps=1e-6,
)
# initializer_range 0.1 (not 0.02): routing and expert outputs then decide the greedy tokens, so
# a wrong expert, weight or renormalisation changes them.
_TINY_MOE = dict(
    head_dim=16,
    num_experts=8,
    moe_intermediate_size=32,
    norm_topk_prob=False,
    initializer_range=0.1,
)
TINY_CONFIGS: dict[str, tuple[str, dict]] = {
    "llama3": (
        "LlamaConfig",
        dict(
            head_dim=16,
            attention_bias=True,  # biases on q/k/v and o
            mlp_bias=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, rope_parameters=dict(rope_theta=1e6))),
    # head_dim 128 and 64 take the CPU decode kernel's vector path; 16 its portable one.
    "qwen3": ("Qwen3Config", dict(head_dim=128, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(head_dim=64, sliding_window=48)),
    # Qwen3-0.6B's context (40,960 positions) on the tiny shape: pools smaller than the context.
    "qwen3-long": (
        "Qwen3Config",
        dict(head_dim=128, tie_word_embeddings=True, max_position_embeddings=40960),
    ),
    # One KV head: tensor-parallel ranks replicate it (tests/test_tp.py); an untied head.
    "qwen3-kv1": ("Qwen3Config", dict(head_dim=64, num_key_value_heads=1)),
    # Qwen3-MoE: 8 experts, top-2 without renormalisation, every layer sparse.
    "qwen3-moe": ("Qwen3MoeConfig", dict(_TINY_MOE, num_experts_per_tok=2)),
    # top-4 renormalised; sparse layers 1 and 5 only: 0, 2 and 4 dense by decoder_sparse_step,
    # 3 by mlp_only_layers.
    "qwen3-moe-mixed": (
        "Qwen3MoeConfig",
        dict(
            _TINY_MOE,
            num_experts_per_tok=4,
            norm_topk_prob=True,
            num_hidden_layers=6,
            decoder_sparse_step=2,
            mlp_only_layers=[3],
        ),
    ),
}
# Every width 32 mod 64 (hidden 96, 3 heads of 32 and one KV head, FFN 160, experts' 96): no
# projection's in_features is whole 64-column blocks (4-bit values stay in bytes; on VNNI the
# int8 tiles' odd last 32 columns); a small vocabulary of 1000 (a partial last tile of 16 rows).
_WIDTHS_32_MOD_64 = dict(
    vocab_size=1000,
    hidden_size=96,
    intermediate_size=160,
    num_attention_heads=3,
    num_key_value_heads=1,
    head_dim=32,
)
TINY_CONFIGS["qwen3-w96"] = ("Qwen3Config", dict(_WIDTHS_32_MOD_64, tie_word_embeddings=True))
# The tokenizer's vocabulary in 64 more rows (as a family's models pad theirs differently): a
# draft model for qwen3, and a target whose tokens past 49,152 qwen3 has no row for.
TINY_CONFIGS["qwen3-pad"] = (
    "Qwen3Config",
    dict(head_dim=64, tie_word_embeddings=True, vocab_size=49152 + 64),
)
TINY_CONFIGS["qwen3-moe-w96"] = (
    "Qwen3MoeConfig",
    dict(_TINY_MOE, **_WIDTHS_32_MOD_64, num_experts_per_tok=2, moe_intermediate_size=96),
)


def smollm2() -> Path:
    return default_model_path()


@functools.cache
def tiny_model(name: str) -> Path:
    """A random-weight model of the named architecture with SmolLM2's tokenizer, cached on disk."""
    import transformers

    class_name, overrides = TINY_CONFIGS[name]
    spec = json.dumps([class_name, _TINY_BASE, overrides, "4MB shards"], sort_keys=True)
    digest = hashlib.sha256(spec.encode()).hexdigest()[:12]
    target = cache_dir() / "test-models" / f"{name}-{digest}"
    if (target / "config.json").exists():
        return target
    config = getattr(transformers, class_name)(**{**_TINY_BASE, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(smollm2()))
    staging = target.with_name(target.name + f".tmp{os.getpid()}")
    # Several shards with an index, as large checkpoints come.
    model.save_pretrained(str(staging), max_shard_size="4MB")
    tokenizer.save_pretrained(str(staging))
    staging.rename(target)
    return target


QWEN3 = "qwen3"  # the seed tests' model fixture: a tiny random Qwen3


def model_path(name: str) -> Path:
    return smollm2() if name == "smollm2" else tiny_model(name)


@functools.cache
def _hf_model(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(path))


def hf_encode(name_or_path: str | Path, prompt: str | list[int]) -> list[int]:
    path = model_path(name_or_path) if isinstance(name_or_path, str) else name_or_path
    return prompt if isinstance(prompt, list) else _hf_model(path)[1](prompt).input_ids


@functools.cache
def _hf_greedy_one(path: Path, ids: tuple[int, ...], max_new_tokens: int, **kw) -> list[int]:
    model, _ = _hf_model(path)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            **kw,
        )
    return out[0, len(ids) :].tolist()


def hf_greedy(
    name: str | Path, prompts: list[str | list[int]], max_new_tokens: int | list[int], **kw
) -> list[list[int]]:
    """HF transformers float32 greedy continuation of each prompt, run one at a time."""
    path = model_path(name) if isinstance(name, str) else name
    lens = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
    return [_hf_greedy_one(path, tuple(hf_encode(path, p)), n, **kw) for p, n in zip(prompts, lens)]


def hf_logits(name: str, prompt: str | list[int]) -> torch.Tensor:
    """HF float32 logits at every prompt position: [tokens, vocab]."""
    path = model_path(name)
    model, _ = _hf_model(path)
    with torch.inference_mode():
        return model(torch.tensor([hf_encode(path, prompt)])).logits[0].float()


def hf_last_logits(name: str, prompt: str | list[int]) -> torch.Tensor:
    return hf_logits(name, prompt)[-1]


@functools.cache
def _hf_model_float64(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64).eval()


def assert_logits_match_hf(rows: torch.Tensor, name: str, prompts: list[str | list[int]]) -> None:
    """Our float32 last-token logits (one row per prompt) against HF's on the named test model
    (see `assert_logits_match_models`)."""
    path = model_path(name)
    ids = [hf_encode(path, prompt) for prompt in prompts]
    assert_logits_match_models(rows, _hf_model(path)[0], _hf_model_float64(path), ids, name)


def assert_logits_match_models(
    rows: torch.Tensor, model, exact_model, prompts: list[list[int]], label: str
) -> None:
    """Our float32 last-token logits (one row per prompt, token ids) against an HF model's
    (`model` in float32, `exact_model` the same weights in float64).

    The tolerance is float32's accumulation-order noise for this model on this machine: how far
    HF's own float32 logits are from its float64 ones, at most over the prompts. Two float32
    implementations that sum in different orders (oneDNN on AMX, on AVX-512, MKL) each land
    about that far from the exact values, so they differ by up to about twice it; four times
    leaves room for the tail. The argmax must be HF's wherever float64's top two are further
    apart than that.
    """
    exact = []
    noise = 0.0
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            exact.append(exact_model(ids).logits[0, -1])
            single = model(ids).logits[0, -1].double()
        noise = max(noise, (single - exact[-1]).abs().max().item())
    atol = 4 * noise
    assert len(rows) == len(exact), (len(rows), len(exact))
    for i, (row, want) in enumerate(zip(rows, exact)):
        diff = (row.double() - want).abs().max().item()
        assert diff <= atol, f"{label} prompt {i}: logits off by {diff:.3g} > {atol:.3g}"
        top2 = want.topk(2).values
        if (top2[0] - top2[1]).item() > atol:
            assert row.argmax().item() == want.argmax().item(), f"{label} prompt {i}: argmax"


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def build_llm(name: str, **kw) -> LLM:
    """An fp32 LLM on the named test model with a small KV pool."""
    kw.setdefault("num_page_override", 4096 // max(kw.get("page_size", 1), 1))
    kw.setdefault("max_seq_len_override", 512)
    kw.setdefault("max_running_req", 8)
    kw.setdefault("dtype", torch.float32)
    return LLM(str(model_path(name)), device="cpu", **kw)


def assert_all_pages_free(llm: LLM) -> None:
    llm.cache_manager.check_integrity()
    cached = llm.cache_manager.prefix_cache.size_info.total_size // llm.page_size
    assert llm.cache_manager.num_free_pages + cached == llm.engine.num_pages


def spy_prefill_tokens(llm: LLM) -> list[int]:
    """Record the tokens each prefill step computes (the seed chapter's `_forward` spy)."""
    computed: list[int] = []
    orig = llm._forward

    def spy(forward_input):
        if forward_input.batch.is_prefill:
            computed.append(sum(r.extend_len for r in forward_input.batch.reqs))
        return orig(forward_input)

    llm._forward = spy
    return computed


def spy_logits(llm: LLM, phase: str) -> list[torch.Tensor]:
    """Collect the logits of every forward step of the given phase ("prefill" or "decode")."""
    captured: list[torch.Tensor] = []
    orig = llm._forward

    def spy(forward_input):
        out = orig(forward_input)
        if forward_input.batch.phase == phase:
            captured.append(out.logits.clone())
        return out

    llm._forward = spy  # type: ignore[method-assign]
    return captured


def fused_decode_switch(monkeypatch) -> tuple[list[int], object]:
    """(the batch sizes the fused C decode layers ran, set_fused(on)): with on False every
    decode step takes the module path instead."""
    from minisgl.models.fused_decode import FusedDecode

    batches: list[int] = []
    run = FusedDecode.run

    def counting_run(self, model, x, *args):
        out = run(self, model, x, *args)
        if out is not None:
            batches.append(x.shape[0])
        return out

    def set_fused(on: bool) -> None:
        monkeypatch.setattr(FusedDecode, "run", counting_run if on else lambda self, *a: None)

    return batches, set_fused


def bf16_decode_logits(
    name: str, prompts: list, max_new: list[int], **kw
) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Every decode step's logits and each request's tokens, greedy, on the named test model in
    bf16 (no overlap, no prefix cache, every request at once); pages checked free after."""
    llm = build_llm(
        name,
        dtype=torch.bfloat16,
        overlap_schedule=False,
        cache_type="naive",
        max_running_req=len(prompts),
        **kw,
    )
    logits = spy_logits(llm, "decode")
    outputs = llm.generate(prompts, [greedy(n) for n in max_new])
    assert_all_pages_free(llm)
    llm.shutdown()
    return logits, [o["token_ids"] for o in outputs]
