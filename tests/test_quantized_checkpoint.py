"""Quantized HF checkpoints read as QuantizedWeight: every quantized weight dequantizes to what
an independent implementation makes of the same files (compressed-tensors' own decompression as
transformers loads it, its AutoAWQ converter, GPTQ's documented formula in a plain loop), the
dense view lists exactly the unquantized model's tensors, and bad configs name their field.

Tolerance: none beyond the reference's dtype. Our dequantization is exact in float32 (a 16-bit
scale times a small integer), the library rounds the same product once to the scale's dtype, so
ours rounded to that dtype must equal it bit for bit."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("compressed_tensors")

from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.base import (  # noqa: E402
    PackedQuantizationCompressor,
)
from compressed_tensors.entrypoints.convert.converters.autoawq import (  # noqa: E402
    AutoAWQConverter,
)
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402
from helpers import assert_logits_match_models  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM, CompressedTensorsConfig, LlamaConfig  # noqa: E402

from minisgl.models.quantized_checkpoint import (  # noqa: E402
    QuantizedCheckpoint,
    quantization_method,
)

# transformers notes that the checkpoint's own quantization_config wins over dequantize=True's.
pytestmark = pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def base() -> torch.nn.Module:
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def is_linear(name: str) -> bool:
    return name.rsplit(".", 2)[-2] in LINEARS and name.startswith("model.layers.")


def dense_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def compress(model: torch.nn.Module, scheme: dict, out: Path) -> None:
    """Quantize with compressed-tensors (min-max scales), compress and save as vLLM reads it."""
    config = QuantizationConfig.model_validate(
        {
            "config_groups": {"group_0": {"targets": ["Linear"], **scheme}},
            "ignore": ["lm_head"],
            "quantization_status": "frozen",
        }
    )
    apply_quantization_config(model, config)
    for module in model.modules():
        args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
        if args is None:
            continue
        weight = module.weight.data.float()
        groups = args.group_size if args.strategy == "group" else weight.shape[1]
        weight = weight.unflatten(1, (-1, groups))
        scale, zero = calculate_qparams(weight.amin(-1), weight.amax(-1), args)
        module.weight_scale.data.copy_(scale)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))


def weights(bits: int, strategy: str, symmetric: bool, group: int | None = None) -> dict:
    args = {"num_bits": bits, "type": "int", "strategy": strategy, "symmetric": symmetric}
    return {"weights": args | ({"group_size": group} if group else {})}


INT8_ACTS = {
    "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}
}
# id: (scheme, model dtype, QuantizedWeight bits, its group (None: in_features))
CT_CASES = {
    "w4a16-g32": (weights(4, "group", True, 32), torch.bfloat16, 4, 32),
    "w4a16-g128-asym": (weights(4, "group", False, 128), torch.bfloat16, 4, 128),
    "w4a16-channel-asym-fp16": (weights(4, "channel", False), torch.float16, 4, None),
    "w8a8-int8-channel": (weights(8, "channel", True) | INT8_ACTS, torch.bfloat16, 8, None),
    "w8a16-packed-g64-asym": (weights(8, "group", False, 64), torch.float16, 8, 64),
    "w8a16-naive-channel": (
        weights(8, "channel", True) | {"format": "naive-quantized"},
        torch.bfloat16,
        8,
        None,
    ),
}


@pytest.mark.parametrize("case", list(CT_CASES))
def test_compressed_tensors_matches_the_library(base, case: str, tmp_path: Path) -> None:
    scheme, dtype, bits, group = CT_CASES[case]
    model = copy.deepcopy(base).to(dtype)
    shapes = dense_shapes(model)
    compress(model, scheme, tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=CompressedTensorsConfig(dequantize=True)
    ).state_dict()
    assert quantization_method(tmp_path) == "compressed-tensors"
    with QuantizedCheckpoint(tmp_path) as checkpoint:
        assert {name: e.shape for name, e in checkpoint.entries.items()} == shapes
        assert checkpoint.quantized_names == {name for name in shapes if is_linear(name)}
        for name in shapes:
            weight = checkpoint.quantized(name)
            want = reference[name]
            if not is_linear(name):
                assert weight is None, name
                assert torch.equal(checkpoint.tensor(name), want), name
                continue
            assert weight is not None, name
            assert (weight.bits, weight.group) == (bits, group or want.shape[1]), name
            ours = weight.dequantize()
            assert torch.equal(ours.to(want.dtype), want), name
            assert torch.equal(checkpoint.tensor(name), ours), name
            if scheme["weights"]["symmetric"]:  # 16-bit scales lose nothing in float16
                assert weight.scales.dtype == torch.float16, name
            assert (weight.mins is None) == (bits == 8 and scheme["weights"]["symmetric"])
            checkpoint.release(name)


def save_checkpoint(base, tmp_path: Path, quant: dict, linear) -> dict[str, dict]:
    """`base`'s tensors with every layer projection replaced by `linear(out, in)`'s tensors."""
    tensors, parts = {}, {}
    for name, tensor in base.state_dict().items():
        if is_linear(name):
            prefix = name.removesuffix(".weight")
            parts[name] = linear(*tensor.shape)
            tensors.update({f"{prefix}.{leaf}": t for leaf, t in parts[name].items()})
        else:
            tensors[name] = tensor.contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = base.config.to_dict() | {"quantization_config": quant}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return parts


def random_ints(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(-(2**31), 2**31, shape, dtype=torch.int32, generator=gen)


def random_scales(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return (torch.rand(shape, generator=gen) * 0.01 + 1e-3).half()


@pytest.mark.parametrize("zero_point", [True, False])
def test_awq_matches_compressed_tensors_converter(base, tmp_path: Path, zero_point: bool) -> None:
    gen, group = torch.Generator().manual_seed(1), 64

    def awq(out: int, cols: int) -> dict[str, torch.Tensor]:
        part = {
            "qweight": random_ints(cols, out // 8, gen=gen),
            "qzeros": random_ints(cols // group, out // 8, gen=gen),
            "scales": random_scales(cols // group, out, gen=gen),
        }
        return part if zero_point else {k: t for k, t in part.items() if k != "qzeros"}

    quant = {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm"}
    parts = save_checkpoint(base, tmp_path, quant | {"zero_point": zero_point}, awq)
    scheme = QuantizationScheme.model_validate(
        {"targets": ["Linear"]} | weights(4, "group", not zero_point, group)
    )
    assert quantization_method(tmp_path) == "awq"
    with QuantizedCheckpoint(tmp_path) as checkpoint:
        assert {n: e.shape for n, e in checkpoint.entries.items()} == dense_shapes(base)
        for name, part in parts.items():
            converted = AutoAWQConverter(group_size=group, zero_point=zero_point).process(
                {f"m.{leaf}": t for leaf, t in part.items()}
            )
            local = {name.removeprefix("m."): t for name, t in converted.items()}
            want = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
            weight = checkpoint.quantized(name)
            assert weight is not None and (weight.bits, weight.group) == (4, group)
            assert torch.equal(weight.dequantize().to(want.dtype), want), name


def gptq_formula(part: dict[str, torch.Tensor], bits: int, v1: bool) -> torch.Tensor:
    """GPTQ's dequantization, row by row: W[:, k] = scales[g] * (q[k] - zeros[g]), g = g_idx[k];
    q packed down the input rows, zeros across the output columns, v1 storing zero - 1."""
    qweight, qzeros, scales, g_idx = (
        part[k].long() for k in ("qweight", "qzeros", "scales", "g_idx")
    )
    per, mask = 32 // bits, (1 << bits) - 1
    q = torch.stack([(qweight[k // per] >> (bits * (k % per))) & mask for k in range(len(g_idx))])
    zeros = torch.stack(
        [(qzeros[:, n // per] >> (bits * (n % per))) & mask for n in range(scales.shape[1])], 1
    )
    zeros = zeros + 1 if v1 else zeros
    return ((q - zeros[g_idx]) * part["scales"].float()[g_idx]).T


@pytest.mark.parametrize(
    ("bits", "group", "fmt"), [(4, 32, "gptq"), (8, -1, "gptq"), (4, 128, "gptq_v2")]
)
def test_gptq_matches_the_format(base, tmp_path: Path, bits: int, group: int, fmt: str) -> None:
    gen, per = torch.Generator().manual_seed(2), 32 // bits

    def gptq(out: int, cols: int) -> dict[str, torch.Tensor]:
        size = cols if group == -1 else group
        return {
            "qweight": random_ints(cols // per, out, gen=gen),
            "qzeros": random_ints(cols // size, out // per, gen=gen),
            "scales": random_scales(cols // size, out, gen=gen),
            "g_idx": (torch.arange(cols) // size).int(),
        }

    quant = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": False}
    parts = save_checkpoint(base, tmp_path, quant | {"sym": False, "checkpoint_format": fmt}, gptq)
    with QuantizedCheckpoint(tmp_path) as checkpoint:
        assert {n: e.shape for n, e in checkpoint.entries.items()} == dense_shapes(base)
        for name, part in parts.items():
            weight = checkpoint.quantized(name)
            assert weight is not None and weight.bits == bits, name
            want = gptq_formula(part, bits, v1=fmt == "gptq")
            assert torch.equal(weight.dequantize(), want), name


def test_gptq_act_order_is_rejected(base, tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(3)

    def gptq(out: int, cols: int) -> dict[str, torch.Tensor]:
        return {
            "qweight": random_ints(cols // 8, out, gen=gen),
            "qzeros": random_ints(cols // 32, out // 8, gen=gen),
            "scales": random_scales(cols // 32, out, gen=gen),
            "g_idx": (torch.randperm(cols, generator=gen) // 32).int(),
        }

    quant = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True}
    save_checkpoint(base, tmp_path, quant, gptq)
    with QuantizedCheckpoint(tmp_path) as checkpoint:
        with pytest.raises(ValueError, match="desc_act"):
            checkpoint.quantized("model.layers.0.self_attn.q_proj.weight")
        assert checkpoint.quantized("model.norm.weight") is None


@pytest.fixture(scope="module")
def w4_dir(base, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("w4")
    compress(copy.deepcopy(base).to(torch.bfloat16), weights(4, "group", True, 32), out)
    return out


def edit(config: dict, path: str, value: object) -> None:
    *parents, leaf = path.split(".")
    for key in parents:
        config = config[key]
    config[leaf] = value


BAD_CONFIGS = {
    "quant_method": ("quant_method", "bitsandbytes"),
    "format": ("config_groups.group_0.format", "float-quantized"),
    "num_bits": ("config_groups.group_0.weights.num_bits", 2),
    "type": ("config_groups.group_0.weights.type", "float"),
    "strategy": ("config_groups.group_0.weights.strategy", "block"),
    "sparsity_config": ("sparsity_config", {"format": "sparse-24-bitmask"}),
    "quantization_status": ("quantization_status", "frozen"),
}


@pytest.mark.parametrize("field", list(BAD_CONFIGS))
def test_bad_compressed_tensors_config_names_its_field(w4_dir, tmp_path, field: str) -> None:
    shutil.copy(w4_dir / "model.safetensors", tmp_path)
    config = json.loads((w4_dir / "config.json").read_text())
    edit(config["quantization_config"], *BAD_CONFIGS[field])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=field):
        QuantizedCheckpoint(tmp_path)


@pytest.mark.parametrize(
    ("quant", "field"),
    [
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version"),
        ({"quant_method": "awq", "bits": 8}, "bits"),
        ({"quant_method": "gptq", "bits": 3}, "bits"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format"),
        (None, "quantization_config"),
    ],
)
def test_bad_awq_gptq_config_names_its_field(base, tmp_path, quant, field: str) -> None:
    config = base.config.to_dict() | ({} if quant is None else {"quantization_config": quant})
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert quantization_method(tmp_path) == (None if quant is None else quant["quant_method"])
    with pytest.raises(ValueError, match=field):
        QuantizedCheckpoint(tmp_path)


def test_engine_serves_a_compressed_tensors_folder_quantized(base, w4_dir, tmp_path) -> None:
    """The engine loads the W4A16 folder's weights quantized (no dense copy), and so does it
    dense (`quantization="none"`: the weights dequantized): float32 activations, so both
    give the dequantized weights' logits (HF's float64 on them) within float32's accumulation
    noise; the only difference is the order of the sums."""
    torch.set_num_threads(2)
    reference = _dequantized_hf(base, w4_dir)
    for quantization in (None, "none"):
        logits = _served_logits(w4_dir, tmp_path, quantization=quantization)
        assert_logits_match_models(logits, *reference, PROMPT_IDS, f"quantization={quantization}")


def test_tensor_parallel_ranks_keep_their_shards_quantized(
    base, w4_dir, tmp_path, monkeypatch
) -> None:
    """TP=2 on the W4A16 folder: each rank's shard of every projection stays quantized (o and
    down cut by columns at group bounds), and the logits are the dequantized weights' within
    float32's accumulation noise (the all-reduce sums partial products in another order)."""
    monkeypatch.setenv("MINISGL_NUM_THREADS", "1")  # two ranks on the 2-core machine
    torch.set_num_threads(1)
    logits = _served_logits(w4_dir, tmp_path, tp_size=2)
    assert_logits_match_models(logits, *_dequantized_hf(base, w4_dir), PROMPT_IDS, "TP=2")


# Prompts (token ids) of 9, 17 and 30 tokens: 56 prefill rows, which the C kernels multiply.
_PROMPT_GEN = torch.Generator().manual_seed(5)
PROMPT_IDS = [torch.randint(3, 256, (n,), generator=_PROMPT_GEN).tolist() for n in (9, 17, 30)]


def _dequantized_hf(base, w4_dir: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    """HF's model on the folder's weights as we dequantize them (QuantizedCheckpoint's dense
    tensors, exact in float32): (float32, float64)."""
    with QuantizedCheckpoint(w4_dir) as checkpoint:
        state = {name: checkpoint.tensor(name).float() for name in checkpoint.entries}
    model = AutoModelForCausalLM.from_config(base.config, dtype=torch.float32).eval()
    model.load_state_dict(state)
    return model, copy.deepcopy(model).double()


def _served_logits(w4_dir: Path, tmp_path: Path, **kw) -> torch.Tensor:
    """The W4A16 folder served (float32 activations; `quantization` None: quantized, as the
    folder holds it, "none": dequantized): each prompt's last-token logits from its prefill
    (the prompts prefilled together), after checking what holds the weights, that greedy
    decoding runs and the pages are free."""
    from helpers import assert_all_pages_free, smollm2, spy_logits

    from minisgl.core import SamplingParams
    from minisgl.layers.quantized import QuantizedProjection
    from minisgl.llm import LLM

    folder = tmp_path / "w4"
    if not folder.exists():
        shutil.copytree(w4_dir, folder)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (smollm2() / name).exists():
                shutil.copy(smollm2() / name, folder / name)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    llm = LLM(str(folder), dtype=torch.float32, num_page_override=256, **kw)
    try:
        projections = [
            m.cpu_projection
            for m in llm.engine.model.modules()
            if getattr(m, "cpu_projection", None) is not None
        ]
        quantized = sum(isinstance(p, QuantizedProjection) for p in projections)
        assert quantized == (0 if kw.get("quantization") == "none" else 2 * 4), quantized
        prefill = spy_logits(llm, "prefill")
        outs = llm.generate(PROMPT_IDS, params)
        assert all(len(o["token_ids"]) == 4 for o in outs)
        assert len(prefill) == 1, "the prompts fit one prefill"
        assert_all_pages_free(llm)
    finally:
        llm.shutdown()
    return prefill[0]
