"""GGUF weights kept quantized: each supported block type repacks into QuantizedWeight with
`dequantize()` equal to gguf-py's, and a GgufCheckpoint gives the tensors transformers' GGUF
loader makes (names, shapes, q/k row order), for a written file and the default model."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFWriter
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from safetensors import safe_open

from minisgl.models.gguf import GgufCheckpoint, repack
from minisgl.utils.hf import default_gguf_path, default_model_path

# Byte offsets of each block's float16 fields (scale, and min where there is one).
_F16_FIELDS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q4_K: (0, 2), Q.Q6_K: (208,)}
_F16_FIELDS.update({Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q5_K: (0, 2)})
# (bits where in_features is a multiple of 64, group, scale dtype, has mins) per type.
_LAYOUTS = {
    Q.Q8_0: (8, 32, torch.float16, False),
    Q.Q4_0: (4, 32, torch.float16, True),
    Q.Q4_1: (4, 32, torch.float16, True),
    Q.Q4_K: (4, 32, torch.float32, True),
    Q.Q6_K: (8, 16, torch.float32, False),
    Q.Q5_0: (8, 32, torch.float16, False),
    Q.Q5_1: (8, 32, torch.float16, True),
    Q.Q5_K: (8, 32, torch.float32, True),
}


def _random_blocks(qtype: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random quants with finite float16 fields of either sign from 2^-20 to 1 (a few zero)."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for offset in _F16_FIELDS.get(qtype, (0,)):
        field = np.exp2(rng.uniform(-20, 0, size=raw.shape[:2])) * rng.choice(
            [-1, 1], raw.shape[:2]
        )
        field[rng.random(raw.shape[:2]) < 0.02] = 0.0
        raw[..., offset : offset + 2] = field.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def _assert_exact(got: torch.Tensor, want: torch.Tensor, qtype: Q) -> None:
    """Equal values, and equal bits except (Q4_0, whose d(q-8) is computed as dq + (-8d)) a
    zero's sign."""
    assert torch.equal(got, want)
    same_bits = got.view(torch.int32) == want.view(torch.int32)
    assert bool(same_bits.all() if qtype != Q.Q4_0 else same_bits[want != 0].all())


@pytest.mark.parametrize(
    ("qtype", "cols"),
    [
        (Q.Q8_0, 256),
        (Q.Q8_0, 288),
        (Q.Q4_0, 256),
        (Q.Q4_0, 288),
        (Q.Q4_1, 256),
        (Q.Q4_1, 288),
        (Q.Q4_K, 512),
        (Q.Q6_K, 512),
        (Q.Q5_0, 256),
        (Q.Q5_0, 288),
        (Q.Q5_1, 288),
        (Q.Q5_K, 512),
    ],
    ids=lambda v: v.name if isinstance(v, Q) else str(v),
)
def test_repack_dequantizes_like_gguf_py(qtype: Q, cols: int) -> None:
    raw = _random_blocks(qtype, 48, cols, seed=cols + int(qtype))
    weight = repack(raw, qtype)
    assert weight is not None and weight.out_features == 48 and weight.in_features == cols
    bits, group, scale_dtype, with_mins = _LAYOUTS[qtype]
    bits = bits if cols % 64 == 0 else 8  # 4-bit formats fall back to the 8-bit layout
    assert (weight.bits, weight.group, weight.scales.dtype) == (bits, group, scale_dtype)
    assert (weight.mins is not None) == with_mins
    _assert_exact(weight.dequantize(), torch.from_numpy(dequantize(raw, qtype)), qtype)


def test_q4_0_scale_too_large_for_float16_mins_keeps_float32() -> None:
    raw = _random_blocks(Q.Q4_0, 4, 64, seed=7)
    raw[1, 0:2] = np.array([10000.0], dtype=np.float16).view(np.uint8)  # -8 d > float16 max
    weight = repack(raw, Q.Q4_0)
    assert weight is not None and weight.scales.dtype == torch.float32
    assert torch.isfinite(weight.mins).all()
    _assert_exact(weight.dequantize(), torch.from_numpy(dequantize(raw, Q.Q4_0)), Q.Q4_0)


def test_unsupported_types_are_not_repacked() -> None:
    raw = _random_blocks(Q.IQ4_NL, 4, 64, seed=3)
    assert repack(raw, Q.IQ4_NL) is None
    assert repack(np.zeros((4, 64), dtype=np.float32), Q.F32) is None


# A one-layer model: (GGUF name, HF name, type, HF shape); 4 heads and 2 kv heads of 64.
_TENSORS = [
    ("token_embd.weight", "model.embed_tokens.weight", Q.Q8_0, (32, 256)),
    ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", Q.Q4_K, (256, 256)),
    ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight", Q.Q6_K, (128, 256)),
    ("blk.0.attn_v.weight", "model.layers.0.self_attn.v_proj.weight", Q.Q4_0, (128, 256)),
    ("blk.0.attn_output.weight", "model.layers.0.self_attn.o_proj.weight", Q.Q4_1, (256, 256)),
    ("blk.0.ffn_gate.weight", "model.layers.0.mlp.gate_proj.weight", Q.F16, (96, 256)),
    ("blk.0.ffn_up.weight", "model.layers.0.mlp.up_proj.weight", Q.Q4_1, (96, 256)),
    ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", Q.IQ4_NL, (256, 96)),
    ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight", Q.F32, (256,)),
    ("blk.0.ffn_norm.weight", "model.layers.0.post_attention_layernorm.weight", Q.F32, (256,)),
    ("output_norm.weight", "model.norm.weight", Q.F32, (256,)),
    ("output.weight", "lm_head.weight", Q.Q8_0, (32, 256)),
    ("rope_freqs.weight", None, Q.F32, (32,)),  # llama3's; transformers does not load it
]
_QWEN2_BIASES = [
    ("blk.0.attn_q.bias", "model.layers.0.self_attn.q_proj.bias", Q.F32, (256,)),
    ("blk.0.attn_k.bias", "model.layers.0.self_attn.k_proj.bias", Q.F32, (128,)),
    ("blk.0.attn_v.bias", "model.layers.0.self_attn.v_proj.bias", Q.F32, (128,)),
]


def _write_gguf(path: Path, arch: str, tensors: list) -> None:
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    rng = np.random.default_rng(0)
    for gguf_name, _, qtype, shape in tensors:
        rows = int(np.prod(shape[:-1]))
        if qtype in (Q.F32, Q.F16):
            dense = rng.standard_normal((rows, shape[-1])).reshape(shape)
            writer.add_tensor(gguf_name, dense.astype(np.float32 if qtype == Q.F32 else np.float16))
        else:
            blocks = _random_blocks(qtype, rows, shape[-1], 1)
            writer.add_tensor(gguf_name, blocks.reshape(*shape[:-1], -1), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_checkpoint_matches_transformers_loader(tmp_path: Path, arch: str) -> None:
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    tensors = _TENSORS + (_QWEN2_BIASES if arch == "qwen2" else [])
    path = tmp_path / f"{arch}.gguf"
    _write_gguf(path, arch, tensors)
    config = {"num_attention_heads": 4, "num_key_value_heads": 2}
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config)
    raw = {t.name: t for t in GGUFReader(str(path)).tensors}
    with GgufCheckpoint(path) as checkpoint:
        assert checkpoint.architecture == arch
        assert checkpoint.unmapped == ["rope_freqs.weight"]
        want_entries = {hf: shape for _, hf, _, shape in tensors if hf is not None}
        assert {n: e.shape for n, e in checkpoint.entries.items()} == want_entries
        for gguf_name, name, qtype, _ in tensors:
            if name is None:
                continue
            weights = dequantize(raw[gguf_name].data, raw[gguf_name].tensor_type)
            want = torch.from_numpy(np.copy(processor.process(weights, gguf_name).weights))
            dense = checkpoint.tensor(name)
            assert dense.dtype == torch.float32 and torch.equal(dense, want), name
            quantized = checkpoint.quantized(name)
            assert (quantized is None) == (qtype not in _LAYOUTS), name
            if quantized is not None:
                _assert_exact(quantized.dequantize(), want, qtype)
            checkpoint.release(name)
        kept = checkpoint.quantized("model.layers.0.self_attn.q_proj.weight")
    assert kept is not None and torch.isfinite(kept.dequantize()).all()  # a copy: outlives it
    with pytest.raises(RuntimeError, match="closed"):
        checkpoint.tensor("model.norm.weight")
    with pytest.raises(RuntimeError, match="closed"):
        checkpoint.quantized("model.embed_tokens.weight")
    if arch == "llama":  # the permutation moved rows: the test above saw it
        q = dequantize(raw["blk.0.attn_q.weight"].data, Q.Q4_K)
        assert not np.array_equal(q, processor.process(q, "blk.0.attn_q.weight").weights)


# A Qwen3-MoE layer's router and experts (4 experts of 32 rows): one 3-D tensor per projection.
_MOE_TENSORS = [
    ("blk.0.ffn_gate_inp.weight", "model.layers.0.mlp.gate.weight", Q.F32, (4, 256)),
    ("blk.0.ffn_gate_exps.weight", "gate_proj", Q.Q4_K, (4, 32, 256)),
    ("blk.0.ffn_up_exps.weight", "up_proj", Q.Q8_0, (4, 32, 256)),
    ("blk.0.ffn_down_exps.weight", "down_proj", Q.Q6_K, (4, 256, 32 * 8)),
]


def test_moe_experts_are_served_per_expert_as_transformers_reads_them(tmp_path: Path) -> None:
    """qwen3moe: each expert's matrix of a 3-D expert tensor is an HF tensor of its own (the
    loader stacks them), kept quantized and equal to what transformers' GGUF loader puts in
    its fused gate_up_proj / down_proj; the router is the dense mlp.gate."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    path = tmp_path / "moe.gguf"
    _write_gguf(path, "qwen3moe", _MOE_TENSORS)
    raw = {t.name: t for t in GGUFReader(str(path)).tensors}
    hf = "model.layers.0.mlp.experts."
    mapping = {
        f"blk.0.ffn_{w}_exps": hf + ("down_proj" if w == "down" else "gate_up_proj")
        for w in ("gate", "up", "down")
    }
    parsed: dict[str, dict] = {"tensors": {}}
    processor = TENSOR_PROCESSORS["qwen3moe"]()
    for gguf_name, *_ in _MOE_TENSORS[1:]:
        weights = dequantize(raw[gguf_name].data, raw[gguf_name].tensor_type)
        processor.process(weights, gguf_name, tensor_key_mapping=mapping, parsed_parameters=parsed)
    fused = {
        "gate_proj": parsed["tensors"][hf + "gate_up_proj"].chunk(2, dim=1)[0],
        "up_proj": parsed["tensors"][hf + "gate_up_proj"].chunk(2, dim=1)[1],
        "down_proj": parsed["tensors"][hf + "down_proj"],
    }
    with GgufCheckpoint(path) as checkpoint:
        assert checkpoint.entries["model.layers.0.mlp.gate.weight"].shape == (4, 256)
        assert checkpoint.quantized("model.layers.0.mlp.gate.weight") is None
        for _, proj, qtype, shape in _MOE_TENSORS[1:]:
            for expert in range(4):
                name = f"{hf}{expert}.{proj}.weight"
                assert checkpoint.entries[name].shape == shape[1:], name
                want = fused[proj][expert].float()
                assert torch.equal(checkpoint.tensor(name), want), name
                quantized = checkpoint.quantized(name)
                assert quantized is not None, name
                _assert_exact(quantized.dequantize(), want, qtype)


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "gemma.gguf"
    _write_gguf(path, "gemma", _TENSORS[-3:-1])
    with pytest.raises(ValueError, match="gemma"):
        GgufCheckpoint(path)


@pytest.fixture(scope="module")
def default_gguf():
    """The default model's GGUF, parsed once for the module (gguf-py reads its tokenizer's
    metadata, one array per token: seconds a parse)."""
    with GgufCheckpoint(default_gguf_path()) as checkpoint:
        yield checkpoint


def test_default_model_quantized_equals_converted_folder(default_gguf) -> None:
    start = time.perf_counter()
    quantized_bytes = dense_bytes = 0
    folder = default_model_path() / "model.safetensors"
    checkpoint = default_gguf
    with safe_open(folder, "pt") as hf:
        assert set(checkpoint.entries) == set(hf.keys())  # tied: neither has lm_head
        for name, entry in checkpoint.entries.items():
            want = hf.get_tensor(name)
            quantized = checkpoint.quantized(name)
            if quantized is None:
                got = checkpoint.tensor(name)
                quantized_bytes += got.numel() * 2
            else:
                got = quantized.dequantize()
                quantized_bytes += quantized.nbytes
            assert tuple(want.shape) == entry.shape and torch.equal(got, want), name
            dense_bytes += want.numel() * 2
            checkpoint.release(name)
    ratio = quantized_bytes / dense_bytes
    print(f"quantized {quantized_bytes / 2**20:.1f} MiB = {ratio:.1%} of bf16")
    print(f"checked in {time.perf_counter() - start:.1f} s")
    assert ratio < 0.40


def test_repacked_weights_are_cached_and_a_bad_cache_is_replaced(monkeypatch, tmp_path) -> None:
    """The first complete load writes the repacked tensors; the next reads them back equal (no
    GGUF parse); an incomplete load writes nothing; an unreadable cache file is replaced. On
    the one-layer llama file above (quantized tensors with and without mins, dense F16/F32 and
    an unsupported type's): the default model's file costs seconds a parse."""
    from minisgl.models import gguf_cache

    target = tmp_path / "cache.safetensors"
    monkeypatch.setattr(gguf_cache, "cache_file", lambda path: target)
    gguf = tmp_path / "llama.gguf"
    _write_gguf(gguf, "llama", _TENSORS)
    with gguf_cache.open_gguf(gguf) as partial:
        assert isinstance(partial, gguf_cache.CachingGguf)
        partial.tensor("model.norm.weight")
    assert not target.exists()  # not every tensor was taken
    taken = {}
    with gguf_cache.open_gguf(gguf) as first:
        quantized_names = first.quantized_names
        for name in first.entries:
            q = first.quantized(name) if name in first.quantized_names else None
            taken[name] = q if q is not None else first.tensor(name)
    assert target.exists()
    with gguf_cache.open_gguf(gguf) as cached:
        assert isinstance(cached, gguf_cache.CachedGguf)
        assert cached.entries == first.entries and cached.quantized_names == quantized_names
        for name, want in taken.items():
            if isinstance(want, torch.Tensor):
                assert cached.quantized(name) is None and torch.equal(cached.tensor(name), want)
                continue
            got = cached.quantized(name)
            assert (got.bits, got.group) == (want.bits, want.group), name
            assert torch.equal(got.values, want.values) and torch.equal(got.scales, want.scales)
            assert (got.mins is None) == (want.mins is None)
            assert want.mins is None or torch.equal(got.mins, want.mins)
    target.write_bytes(b"not a safetensors file")
    with gguf_cache.open_gguf(gguf) as rebuilt:
        assert isinstance(rebuilt, gguf_cache.CachingGguf)
    assert not target.exists()  # removed, rewritten by the next complete load


def test_a_gguf_path_converts_only_its_config_and_serves_the_file(
    tmp_path: Path, default_gguf
) -> None:
    """A .gguf model path: its cached folder holds the config and tokenizer only (a large file
    is never dequantized whole), and every weight comes from the file: its blocks served
    quantized, or, with any other quantization, its tensors dense (the values
    test_default_model_quantized_equals_converted_folder compares with transformers')."""
    import shutil

    from helpers import greedy

    from minisgl.llm import LLM
    from minisgl.models.checkpoint import DenseView, open_checkpoint
    from minisgl.utils.hf import convert_gguf

    link = tmp_path / "smollm2-copy.gguf"
    link.symlink_to(default_gguf_path())
    folder = convert_gguf(link)
    try:
        assert (folder / "config.json").exists() and (folder / "tokenizer.json").exists()
        assert not list(folder.glob("*.safetensors"))
        llm = LLM(str(link), num_page_override=256, max_seq_len_override=64)
        assert llm.config.quantization == "gguf"
        out = llm.generate(["The capital of France is"], greedy(3))[0]
        assert out["text"].startswith(" Paris"), out["text"]
        llm.shutdown()
        name = "model.layers.0.self_attn.o_proj.weight"
        want = default_gguf.tensor(name)  # the file `link` points at, parsed by the fixture
        for quantization in ("none", "int8", None):
            with open_checkpoint(folder, quantization, link) as checkpoint:
                assert isinstance(checkpoint, DenseView) and not checkpoint.quantized_names
                assert torch.equal(checkpoint.tensor(name), want), quantization
    finally:
        shutil.rmtree(folder)


def test_a_touched_file_gets_a_new_cache_and_the_old_one_goes(monkeypatch, tmp_path) -> None:
    """Touching (or replacing) a GGUF file gives its cache a new name; writing it removes the
    path's older copy, and leaves another path's alone."""
    import os

    from minisgl.models import gguf_cache

    monkeypatch.setattr(gguf_cache, "cache_dir", lambda: tmp_path / "cache")

    def load_whole(path: Path) -> Path:
        with gguf_cache.open_gguf(path) as checkpoint:
            for name in checkpoint.entries:
                if checkpoint.quantized(name) is None:
                    checkpoint.tensor(name)
        return gguf_cache.cache_file(path)

    gguf, other = tmp_path / "llama.gguf", tmp_path / "other" / "llama.gguf"
    other.parent.mkdir()
    _write_gguf(gguf, "llama", _TENSORS)
    _write_gguf(other, "llama", _TENSORS)
    first, beside = load_whole(gguf), load_whole(other)
    assert first.exists() and beside.exists() and first != beside
    stat = gguf.stat()
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    second = load_whole(gguf)
    assert second != first and second.exists() and beside.exists()
    assert not first.exists()


def test_a_moe_gguf_loads_every_expert_quantized(tmp_path: Path) -> None:
    """The tiny Qwen3-MoE's weights written as a qwen3moe GGUF (Q8_0 matrices, experts in 3-D
    tensors): the model loads every projection and every expert quantized, each equal to
    gguf-py's dequantization of its blocks, the routers and norms dense."""
    from gguf.quants import quantize
    from helpers import tiny_model

    from minisgl.layers.moe import SparseMoE
    from minisgl.layers.quantized import QuantizedProjection
    from minisgl.models import create_model, load_model_config
    from minisgl.models.gguf import _EXPERT_NAMES, _GLOBAL_NAMES, _LAYER_NAMES

    folder = tiny_model("qwen3-moe")
    config = load_model_config(folder)
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            tensors.update({name: f.get_tensor(name).float() for name in f.keys()})  # noqa: SIM118
    to_gguf = {hf: gguf for gguf, hf in {**_GLOBAL_NAMES, **_LAYER_NAMES}.items()}
    writer = GGUFWriter(str(tmp_path / "moe.gguf"), "qwen3moe")
    expected: dict[str, np.ndarray] = {}  # HF name -> the GGUF's dequantized values

    def add(gguf_name: str, values: np.ndarray) -> np.ndarray:
        if values.ndim == 1 or gguf_name.endswith("ffn_gate_inp.weight"):
            writer.add_tensor(gguf_name, values)
            return values
        writer.add_tensor(gguf_name, quantize(values, Q.Q8_0), raw_dtype=Q.Q8_0)
        return dequantize(quantize(values, Q.Q8_0), Q.Q8_0)

    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        for gguf_part, proj in _EXPERT_NAMES.items():
            stack = np.stack(
                [
                    tensors.pop(f"{prefix}.{e}.{proj}.weight").numpy()
                    for e in range(config.num_experts)
                ]
            )
            values = add(f"blk.{layer}.{gguf_part}.weight", stack)
            for e in range(config.num_experts):
                expected[f"{prefix}.{e}.{proj}.weight"] = values[e]
    for name, tensor in tensors.items():
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            part, _, kind = rest.rpartition(".")
            gguf_name = f"blk.{layer}.{to_gguf[part]}.{kind}"
        else:
            part, _, kind = name.rpartition(".")
            gguf_name = f"{to_gguf[part]}.{kind}"
        expected[name] = add(gguf_name, tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    from minisgl.models.gguf_cache import cache_file

    # The load writes a repacked copy keyed by this temporary file: not one a run in the cache.
    repacked = cache_file(tmp_path / "moe.gguf")
    try:
        model = create_model(
            config, folder, torch.float32, torch.device("cpu"), 64, "gguf", tmp_path / "moe.gguf"
        )
    finally:
        repacked.unlink(missing_ok=True)
    for layer_id, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        assert isinstance(attn.o_proj.cpu_projection, QuantizedProjection)
        got = attn.o_proj.cpu_projection.weight.dequantize()
        want = expected[f"model.layers.{layer_id}.self_attn.o_proj.weight"]
        assert torch.equal(got, torch.from_numpy(want))
        if not isinstance(layer.mlp, SparseMoE):
            continue
        gate_up, down = layer.mlp.stacks()
        assert gate_up.projections is not None and down.projections is not None
        prefix = f"model.layers.{layer_id}.mlp.experts"
        for e in range(config.num_experts):
            want_gate_up = np.concatenate(
                [
                    expected[f"{prefix}.{e}.gate_proj.weight"],
                    expected[f"{prefix}.{e}.up_proj.weight"],
                ]
            )
            assert torch.equal(
                gate_up.projections[e].weight.dequantize(), torch.from_numpy(want_gate_up)
            )
            got_down = down.projections[e].weight.dequantize()
            assert torch.equal(
                got_down, torch.from_numpy(expected[f"{prefix}.{e}.down_proj.weight"])
            )
        assert not isinstance(layer.mlp.gate.cpu_projection, QuantizedProjection)
