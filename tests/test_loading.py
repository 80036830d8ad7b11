"""Loading: tensor by tensor from the memory-mapped checkpoint into the target dtype, each weight
resident once (a projection's packed copy in place of its weight), so that loading adds about
the weights and the KV pool to the process's memory, and its peak stays near them."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_model
from safetensors.torch import load_file, save_file

from minisgl.models import create_model, load_model_config
from minisgl.utils.hf import cache_dir

# Four layers of Qwen3-0.6B's shape and a 65,536-token tied embedding: 248 MB of bf16 weights,
# enough that the process's own few tens of MB do not hide a copy of them.
_MEMORY_MODEL = dict(
    hidden_size=1024,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=3072,
    vocab_size=65536,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)
KV_TOKENS = 1024
MiB = 1 << 20
# What an engine holds besides weights and KV pool: page table and token pool, rotary tables,
# the kernels' library, allocator slack (20 MiB for Qwen3-0.6B's shape, 18 for SmolLM2).
AFTER_LOAD_MARGIN = 64 * MiB

_MEASURE = """
import json, sys, torch
torch.set_num_threads(1)
from minisgl.engine import Engine, EngineConfig
from minisgl.utils.memory import peak_rss_bytes, reset_peak_rss, rss_bytes
before = rss_bytes()
assert reset_peak_rss(), "cannot reset VmHWM (/proc/self/clear_refs)"
engine = Engine(EngineConfig(sys.argv[1], dtype=torch.bfloat16, num_page_override=int(sys.argv[2]),
                             max_seq_len_override=256))
after, peak = rss_bytes(), peak_rss_bytes()
model = engine.model
params = sum(p.numel() * p.element_size() for p in model.parameters())
projections = [m.cpu_projection for m in model.modules()
               if getattr(m, "cpu_projection", None) is not None and m.cpu_projection.packed is not None]
copies = sum(p.packed.numel() * p.packed.element_size() for p in projections)
# Where a CPU multiplies bf16 in float32 (no bf16 matmuls), a weight's float32 copy takes twice
# its bytes, and a tied head's sits beside the embedding rows the lookups read (embedding.py).
head = model.lm_head.cpu_projection
tied_head = model.lm_head.tied is not None and head in projections
widened = sum(p.packed.numel() * (4 if p is head and tied_head else 2)
              for p in projections if p.in_float32)
mapped = [line for line in open("/proc/self/maps") if ".safetensors" in line]
print(json.dumps(dict(after=after - before, peak=peak - before, params=params, copies=copies,
                      widened=widened,
                      kv=engine.kv_cache.k_cache(0).numel() * 2 * 2 * len(model.model.layers),
                      mapped=len(mapped))))
"""


def _memory_model() -> Path:
    """The random bf16 checkpoint, built once into the cache."""
    import transformers

    spec = json.dumps([_MEMORY_MODEL, "bf16", 0], sort_keys=True)
    target = (
        cache_dir() / "test-models" / f"memory-{hashlib.sha256(spec.encode()).hexdigest()[:12]}"
    )
    if (target / "config.json").exists():
        return target
    torch.manual_seed(0)
    config = transformers.Qwen3Config(**_MEMORY_MODEL)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    staging = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(str(staging))
    staging.rename(target)
    return target


def test_loading_adds_the_weights_and_kv_pool_once():
    path = _memory_model()
    weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))  # bf16 on disk
    result = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(path), str(KV_TOKENS)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MINISGL_NUM_THREADS": "1", "MINISGL_LOG_LEVEL": "WARNING"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    f = json.loads(result.stdout.strip().splitlines()[-1])
    print(
        f"weights {weights / MiB:.0f} MiB, KV {f['kv'] / MiB:.0f} MiB: after load "
        f"{f['after'] / MiB:.0f} MiB, peak {f['peak'] / MiB:.0f} MiB"
    )
    assert f["mapped"] == 0, "the checkpoint is still mapped"
    held = f["params"] + f["copies"]
    once = weights + f["widened"]  # each weight once (and in float32 where multiplied so)
    assert once * 0.99 <= held <= once * 1.01, (held, weights, f["widened"])
    assert f["after"] <= once + f["kv"] + AFTER_LOAD_MARGIN, f
    assert f["peak"] <= 1.5 * once, f


def _saved_copy(tmp_path: Path, edit) -> Path:
    """A tiny model (biases on every projection) saved as one file with `edit` applied."""
    source = tiny_model("llama3")
    tensors = {}
    for shard in sorted(source.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    target = tmp_path / "model"
    target.mkdir()
    (target / "config.json").write_text((source / "config.json").read_text())
    save_file(edit(tensors), str(target / "model.safetensors"))
    return target


def _without(part: str):
    return lambda tensors: {k: v for k, v in tensors.items() if part not in k}


@pytest.mark.parametrize(
    "edit,error,match",
    [
        (_without("layers.1.mlp.up_proj.bias"), ValueError, "gate_up_proj.bias lacks"),
        (_without("layers.1.input_layernorm"), ValueError, "lacks 1 tensors"),
        (lambda t: {**t, "model.layers.0.extra.weight": torch.zeros(2)}, KeyError, "extra"),
        (lambda t: {**t, "model.norm.weight": torch.zeros(7)}, ValueError, "model.norm.weight"),
    ],
    ids=["fused-part-missing", "tensor-missing", "unknown-tensor", "wrong-shape"],
)
def test_a_checkpoint_that_does_not_fit_names_the_tensor(tmp_path, edit, error, match):
    path = _saved_copy(tmp_path, edit)
    with pytest.raises(error, match=match):
        create_model(load_model_config(path), path, torch.bfloat16, torch.device("cpu"), 64)
