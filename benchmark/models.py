"""The models the benchmarks load: the default model, any HF folder or GGUF, and models with
random weights built once on first use: Qwen3-0.6B's shape, and a small Qwen3-MoE."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import paths  # noqa: F401  (before minisgl: a checkout without `pip install -e .`)
import torch

from minisgl.utils.hf import cache_dir, gguf_source, resolve_model_path

QWEN3_RANDOM = "qwen3-0.6b-random"
# Qwen3-0.6B's shape (random weights): q/k RMSNorm come with the Qwen3 architecture.
QWEN3_0_6B_CONFIG: dict[str, Any] = dict(
    hidden_size=1024,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=3072,
    vocab_size=151936,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
)
QWEN3_MOE_RANDOM = "qwen3-moe-random"
# A small Qwen3-MoE (random weights): 16 experts, top-4 renormalised, every layer sparse.
QWEN3_MOE_CONFIG: dict[str, Any] = dict(
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    intermediate_size=1024,
    moe_intermediate_size=256,
    num_experts=16,
    num_experts_per_tok=4,
    norm_topk_prob=True,
    vocab_size=49152,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
)
RANDOM_MODEL_SEED = 0


def build_random_qwen3(seed: int = RANDOM_MODEL_SEED) -> Path:
    """A Qwen3-0.6B-shaped bf16 model with random weights and the default model's tokenizer."""
    return build_random(QWEN3_RANDOM, "Qwen3Config", QWEN3_0_6B_CONFIG, seed)


def build_random(name: str, config_class: str, shape: dict[str, Any], seed: int) -> Path:
    """A bf16 model of this shape with random weights and the default model's tokenizer.

    Built once (fixed seed) into `cache_dir()/bench-models/`; later calls return the folder.
    """
    import transformers

    spec = json.dumps([shape, seed, "bf16"], sort_keys=True)
    digest = hashlib.sha256(spec.encode()).hexdigest()[:12]
    target = cache_dir() / "bench-models" / f"{name}-{digest}"
    if (target / "config.json").exists():
        return target
    print(f"building {name} (random weights, seed {seed}) into {target}", flush=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(resolve_model_path(None)))
    special = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = getattr(transformers, config_class)(**shape, **special)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    staging = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(str(staging))
    tokenizer.save_pretrained(str(staging))
    del model
    gc.collect()
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)  # atomic: a half-written folder is never taken as done
    return target


def resolve_bench_model(name: str | None) -> Path:
    """`None`/"default": the default model; `qwen3-0.6b-random`, `qwen3-moe-random`; else any
    HF folder or GGUF."""
    if name is None or name == "default":
        return resolve_model_path(None)
    if name == QWEN3_RANDOM:
        return build_random_qwen3()
    if name == QWEN3_MOE_RANDOM:
        return build_random(QWEN3_MOE_RANDOM, "Qwen3MoeConfig", QWEN3_MOE_CONFIG, RANDOM_MODEL_SEED)
    return resolve_model_path(name)


def model_source(name: str | None) -> str | None:
    """What to hand LLM() or the server for `name`: a GGUF file as it is (served from its own
    quantized tensors; its prepared folder holds only the config and tokenizer), the default
    model as None, else resolve_bench_model's folder."""
    if name is None or name == "default":
        return None
    gguf = gguf_source(name)
    return str(gguf) if gguf is not None else str(resolve_bench_model(name))


def model_label(path: Path) -> str:
    """A short name for tables and file names."""
    name = path.name
    for random_name in (QWEN3_RANDOM, QWEN3_MOE_RANDOM):
        if name.startswith(random_name):
            return random_name
    return name
