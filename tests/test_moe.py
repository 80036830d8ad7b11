"""Qwen3-MoE: the router and grouped experts against transformers' and a per-token reference, the
sparse layers chosen as transformers chooses them, greedy output equal to HF float32, the
loader's stacked experts, and the fused C decode layer refusing the model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import (
    MIXED_PROMPTS,
    PROMPTS,
    assert_all_pages_free,
    build_llm,
    fused_decode_switch,
    greedy,
    hf_greedy,
    spy_prefill_tokens,
    tiny_model,
)
from safetensors.torch import load_file, save_file

from minisgl import models as models_mod
from minisgl.kernel.cpu import cpu_kernels
from minisgl.layers.moe import ExpertStack, SparseMoE, route
from minisgl.models import create_model, load_model_config
from minisgl.models.config import ModelConfig
from minisgl.moe import grouped_experts

MOE_MODELS = ["qwen3-moe", "qwen3-moe-mixed"]
MAX_NEW = [12, 5, 16, 9, 3, 14, 7, 10]


def naive_experts(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """One token and one of its experts at a time, summed in top-k order."""
    inter = w_down.shape[-1]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            gate_up = w_gate_up[ids[t, k]] @ x[t]
            act = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += (w_down[ids[t, k]] @ act) * weights[t, k]
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,top_k", [(1, 2), (7, 4), (40, 2)])
def test_grouped_experts_equal_a_per_token_reference(
    tokens: int, top_k: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(tokens * 10 + top_k)
    experts, hidden, inter = 8, 32, 24
    x = torch.randn(tokens, hidden, generator=gen)
    w_gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w_down = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    weights, ids = route(torch.randn(tokens, experts, generator=gen), top_k, normalize=True)
    args = [t.to(dtype) for t in (x, w_gate_up, w_down)] + [ids, weights.to(dtype)]
    got = grouped_experts(args[0], ExpertStack(args[1]), ExpertStack(args[2]), *args[3:])
    want = naive_experts(*[a.double() if a.is_floating_point() else a for a in args])
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    atol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=0)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_moe_equals_transformers_block(norm_topk_prob: bool, dtype: torch.dtype) -> None:
    """Routing (float32 softmax, top-k, renormalisation, cast) and experts as transformers'
    Qwen3MoeSparseMoeBlock computes them, with its weights stacked as ours are."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=32,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=16,
        norm_topk_prob=norm_topk_prob,
    )
    torch.manual_seed(1)
    hf = Qwen3MoeSparseMoeBlock(config).to(dtype).eval()
    for param in hf.parameters():
        torch.nn.init.normal_(param, std=0.2)
    ours = SparseMoE(32, 16, 8, 3, norm_topk_prob, grouped_experts)
    ours.gate.weight.data = hf.gate.weight.data.clone()
    ours.w_gate_up.data = hf.experts.gate_up_proj.data.clone()
    ours.w_down.data = hf.experts.down_proj.data.clone()
    x = torch.randn(1, 19, 32).to(dtype)
    with torch.inference_mode():
        _, want_weights, want_ids = hf.gate(x[0])
        weights, ids = route(ours.gate(x[0]), 3, norm_topk_prob)
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)
        atol = 1e-6 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(ours(x[0]), hf(x)[0], atol=atol, rtol=0)


@pytest.mark.parametrize(
    "layers,step,mlp_only",
    [(4, 1, []), (6, 2, [3]), (5, 3, []), (4, 1, [0, 2]), (3, 1, [0, 1, 2])],
)
def test_sparse_layers_are_those_transformers_builds(
    layers: int, step: int, mlp_only: list[int]
) -> None:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import (
        Qwen3MoeDecoderLayer,
        Qwen3MoeSparseMoeBlock,
    )

    hf_config = Qwen3MoeConfig(
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=layers,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=step,
        mlp_only_layers=mlp_only,
        architectures=["Qwen3MoeForCausalLM"],
    )
    want = tuple(
        isinstance(Qwen3MoeDecoderLayer(hf_config, i).mlp, Qwen3MoeSparseMoeBlock)
        for i in range(layers)
    )
    config = ModelConfig.from_hf(hf_config)
    assert config.moe_layers == want
    assert config.qk_norm and config.num_experts == 4 and config.num_experts_per_tok == 2


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", MOE_MODELS)
def test_greedy_matches_hf_with_continuous_batching(name: str, page_size: int) -> None:
    llm = build_llm(name, page_size=page_size, max_running_req=3, cache_type="naive")
    sparse = [type(layer.mlp) is SparseMoE for layer in llm.engine.model.model.layers]
    assert tuple(sparse) == llm.engine.model.config.moe_layers and any(sparse)
    outputs = llm.generate(MIXED_PROMPTS, [greedy(n) for n in MAX_NEW])
    expected = hf_greedy(name, MIXED_PROMPTS, MAX_NEW)
    for out, want, prompt in zip(outputs, expected, MIXED_PROMPTS):
        assert out["token_ids"] == want, f"{name} page_size={page_size} prompt={prompt!r}"
    assert_all_pages_free(llm)
    llm.shutdown()


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", MOE_MODELS)
def test_radix_hits_and_chunked_prefill_match_hf(name: str, page_size: int) -> None:
    """Prompts sharing prefixes, prefilled 24 tokens a step, twice: the second round from the
    radix cache."""
    llm = build_llm(name, page_size=page_size, max_running_req=4, max_prefill_length=24)
    computed = spy_prefill_tokens(llm)
    prompts = PROMPTS + MIXED_PROMPTS
    expected = hf_greedy(name, prompts, 6)
    for _ in range(2):
        outputs = llm.generate(prompts, greedy(6))
        assert [o["token_ids"] for o in outputs] == expected
        assert_all_pages_free(llm)
    assert max(computed) <= 24
    assert sum(o["cached_tokens"] for o in outputs) > 0
    llm.shutdown()


def test_bf16_runs_module_by_module(monkeypatch) -> None:
    """The fused C decode layer does not compute experts: it refuses the model, and decode
    takes the module path."""
    from minisgl.models.fused_decode import FusedDecode

    batches, set_fused = fused_decode_switch(monkeypatch)
    set_fused(True)
    llm = build_llm("qwen3-moe-mixed", dtype=torch.bfloat16, cache_type="naive")
    model = llm.engine.model.model
    x = torch.zeros(1, model.config.hidden_size, dtype=torch.bfloat16)
    assert model.layers[0].parts() is not None and model.layers[1].parts() is None
    assert FusedDecode.supported(model, x) is None
    outputs = llm.generate(MIXED_PROMPTS[:4], greedy(6))
    assert all(len(o["token_ids"]) == 6 for o in outputs)
    assert batches == []
    assert_all_pages_free(llm)
    llm.shutdown()


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_load_quantization_quantizes_the_experts_and_keeps_the_router_dense(
    quantization: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every expert's projections quantized in place of the stacked weights, each equal to its
    dense weight quantized alone; the layer's output equals the experts' dequantized weights'
    within the activations' rounding."""
    from minisgl.layers.linear import CpuProjection
    from minisgl.layers.quantized import QuantizedProjection, int8_group, quantize

    path = tiny_model("qwen3-moe")
    config = load_model_config(path)
    with monkeypatch.context() as patch:  # the dense stacks as they are, not packed
        patch.setattr(models_mod, "packs_dense_experts", lambda dtype, kernels: False)
        dense = create_model(config, path, torch.bfloat16, torch.device("cpu"), 64)
    model = create_model(config, path, torch.bfloat16, torch.device("cpu"), 64, quantization)
    layer, dense_layer = model.model.layers[0], dense.model.layers[0]
    assert isinstance(layer.mlp, SparseMoE) and isinstance(dense_layer.mlp, SparseMoE)
    assert isinstance(layer.mlp.gate.cpu_projection, CpuProjection)
    assert isinstance(layer.self_attn.qkv_proj.cpu_projection, QuantizedProjection)
    assert layer.mlp.w_gate_up.numel() == layer.mlp.w_down.numel() == 0
    gate_up, down = layer.mlp.stacks()
    dense_gate_up, dense_down = dense_layer.mlp.stacks()
    assert gate_up.projections is not None and down.projections is not None
    # int8: a byte a weight and a float16 scale per 64 columns (32 here where in_features is;
    # with AMX-INT8 a float32 scale a row); int4 where in_features is a multiple of
    # 64 (gate_up's 64 here; down's 32 keeps its 4-bit values in bytes, which VNNI's tiles hold
    # in 6 bits): half a byte and a float16 scale and offset per 32 columns. Rows this short
    # make the scales weigh more. `.weight` is a QuantizedWeight, or on VNNI a TiledWeight:
    # both dequantize to the same float32 weight.
    assert gate_up.projections[0].weight.bits == (4 if quantization == "int4" else 8)
    for stack, dense_stack in ((gate_up, dense_gate_up), (down, dense_down)):
        nibbles = stack.projections[0].weight.bits == 4
        assert stack.nbytes < (0.33 if nibbles else 0.6) * dense_stack.nbytes
    method = "int4-g32" if quantization == "int4" else quantization
    for stack, dense_stack in ((gate_up, dense_gate_up), (down, dense_down)):
        for expert in (0, config.num_experts - 1):
            group_int8 = int8_group(method, cpu_kernels(), dense_stack.dense.shape[-1])
            want = quantize(dense_stack.dense[expert], method, group_int8)
            got = stack.projections[expert].weight
            assert want is not None and torch.equal(got.dequantize(), want.dequantize())
    # The layer against the same experts dequantized, in float32.
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, config.hidden_size, generator=gen).bfloat16()
    weights, ids = route(layer.mlp.gate(x), config.num_experts_per_tok, config.norm_topk_prob)
    w_gate_up = torch.stack([p.weight.dequantize() for p in gate_up.projections])
    w_down = torch.stack([p.weight.dequantize() for p in down.projections])
    want = naive_experts(x.float(), w_gate_up, w_down, ids, weights.float())
    got = layer.mlp(x).float()
    # bf16 activations and intermediate products: 0.4-0.7% of the largest output here.
    torch.testing.assert_close(got, want, rtol=0, atol=2**-5 * want.abs().max().item())


def test_dense_bf16_experts_are_packed_per_expert(monkeypatch: pytest.MonkeyPatch):
    """bf16 experts on a CPU whose C matmuls take bf16: each expert's packed copy replaces the
    stack (F.linear on bf16 ran PyTorch's reference loop on AVX2, and elsewhere summed one row
    another way than several), the layer's output that of the dense stacks within the
    accumulation's rounding, and a token's output the same bits whichever tokens share its
    experts."""
    from minisgl.layers.linear import CpuProjection, c_matmuls_take
    from minisgl.layers.moe import packs_dense_experts

    kernels = cpu_kernels()
    if not c_matmuls_take(torch.bfloat16, kernels):
        pytest.skip("the C matmuls take no bf16 weight on this CPU")
    assert kernels is not None and packs_dense_experts(torch.bfloat16, kernels)
    path = tiny_model("qwen3-moe")
    config = load_model_config(path)
    model = create_model(config, path, torch.bfloat16, torch.device("cpu"), 64)
    with monkeypatch.context() as patch:
        patch.setattr(models_mod, "packs_dense_experts", lambda dtype, kernels: False)
        dense = create_model(config, path, torch.bfloat16, torch.device("cpu"), 64)
    layer, dense_layer = model.model.layers[0].mlp, dense.model.layers[0].mlp
    assert isinstance(layer, SparseMoE) and isinstance(dense_layer, SparseMoE)
    gate_up, down = layer.stacks()
    assert gate_up.projections is not None and down.projections is not None
    assert all(isinstance(p, CpuProjection) for p in gate_up.projections + down.projections)
    assert layer.w_gate_up.numel() == layer.w_down.numel() == 0
    dense_gate_up, dense_down = dense_layer.stacks()
    assert gate_up.nbytes >= dense_gate_up.nbytes  # (padded to whole 32 x 32 blocks)
    gen = torch.Generator().manual_seed(9)
    for tokens in (1, 9, 70):  # a decode row, a few, a prefill's
        x = torch.randn(tokens, config.hidden_size, generator=gen).bfloat16()
        got, want = layer(x).float(), dense_layer(x).float()
        torch.testing.assert_close(got, want, rtol=0, atol=2**-6 * want.abs().max().item())
        if not kernels.has_amx:  # (with AMX an expert's 5th row leaves the GEMV for the tiles)
            alone = torch.cat([layer(x[i : i + 1]) for i in range(min(tokens, 9))])
            assert torch.equal(layer(x)[: len(alone)], alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tokens_output_does_not_depend_on_the_tokens_sharing_its_experts(dtype) -> None:
    """Each token's MoE output alone equals its row among others (the same bits): speculative
    verify steps and batches give what decoding one by one gives. Dense stacks multiplied by
    F.linear summed one row another way than several (MKL's float32 at 1, 2, 3, 5, 9 rows)."""
    kernels = cpu_kernels()
    if dtype == torch.bfloat16 and kernels is not None and kernels.has_amx:
        pytest.skip("with AMX an expert's 5th bf16 row leaves the GEMV for the tiles")
    path = tiny_model("qwen3-moe")
    model = create_model(load_model_config(path), path, dtype, torch.device("cpu"), 64)
    layer = model.model.layers[0].mlp
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(12, model.config.hidden_size, generator=gen).to(dtype)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
    assert torch.equal(layer(x), alone)


def test_a_checkpoints_quantized_experts_are_split_per_expert() -> None:
    """A quantized checkpoint hands each stack over as every expert's rows stacked: expert e
    gets its own rows, and a stack that arrives dense (no quantization asked) is packed per
    expert where `packs_dense_experts` (float32: oneDNN's copy), else kept as it is."""
    from minisgl.layers.moe import packs_dense_experts
    from minisgl.layers.quant_weight import concat_rows, quantize_int4

    gen = torch.Generator().manual_seed(11)
    experts, hidden, inter = 4, 64, 32
    moe = SparseMoE(hidden, inter, experts, 2, True, grouped_experts)
    parts = [
        quantize_int4(torch.randn(2 * inter, hidden, generator=gen), 32) for _ in range(experts)
    ]
    moe.prepare_for_cpu("w_gate_up", concat_rows(parts), cpu_kernels())
    dense_down = torch.randn(experts, hidden, inter, generator=gen)
    moe.prepare_for_cpu("w_down", dense_down, cpu_kernels())
    gate_up, down = moe.stacks()
    assert gate_up.projections is not None and moe.w_gate_up.numel() == 0
    for expert, part in enumerate(parts):
        assert torch.equal(gate_up.projections[expert].weight.dequantize(), part.dequantize())
    if packs_dense_experts(torch.float32, cpu_kernels()):
        assert down.projections is not None and moe.w_down.numel() == 0
        rows = torch.randn(3, inter, generator=gen)
        for expert in range(experts):
            want = rows @ dense_down[expert].T
            torch.testing.assert_close(down(expert, rows), want, rtol=1e-5, atol=1e-5)
    else:
        assert down.projections is None and torch.equal(moe.w_down, dense_down)
    with pytest.raises(ValueError, match="w_up"):
        moe.prepare_for_cpu("w_up", dense_down, cpu_kernels())


def _saved_copy(tmp_path: Path, edit) -> Path:
    """The top-2 tiny MoE model saved as one file with `edit` applied to its tensors."""
    source = tiny_model("qwen3-moe")
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(source.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    target = tmp_path / "model"
    target.mkdir()
    (target / "config.json").write_text((source / "config.json").read_text())
    save_file(edit(tensors), str(target / "model.safetensors"))
    return target


def test_loader_stacks_every_expert_once(tmp_path: Path) -> None:
    path = _saved_copy(tmp_path, lambda t: t)
    model = create_model(load_model_config(path), path, torch.float32, torch.device("cpu"), 64)
    tensors = load_file(str(path / "model.safetensors"))
    moe = model.model.layers[1].mlp
    assert isinstance(moe, SparseMoE)
    gate_up, down = moe.stacks()

    def weight(stack: ExpertStack, expert: int, in_features: int) -> torch.Tensor:
        """The expert's weight as the stack multiplies it (packed or not): identity rows
        through it, each product exact in float32."""
        return stack(expert, torch.eye(in_features)).T

    for e in range(8):
        prefix = f"model.layers.1.mlp.experts.{e}"
        want = torch.cat(
            [tensors[f"{prefix}.gate_proj.weight"], tensors[f"{prefix}.up_proj.weight"]]
        )
        assert torch.equal(weight(gate_up, e, want.shape[1]), want)
        want = tensors[f"{prefix}.down_proj.weight"]
        assert torch.equal(weight(down, e, want.shape[1]), want)


@pytest.mark.parametrize(
    "edit,error,match",
    [
        (
            lambda t: {k: v for k, v in t.items() if "layers.1.mlp.experts.5.up_proj" not in k},
            ValueError,
            "w_gate_up lacks",
        ),
        (
            lambda t: {**t, "model.layers.0.mlp.experts.8.down_proj.weight": torch.zeros(64, 32)},
            KeyError,
            "experts.8",
        ),
        (
            lambda t: {k: v for k, v in t.items() if "layers.0.mlp.gate.weight" not in k},
            ValueError,
            "lacks 1 tensors",
        ),
    ],
    ids=["expert-part-missing", "expert-past-the-count", "router-missing"],
)
def test_a_moe_checkpoint_that_does_not_fit_names_the_tensor(tmp_path, edit, error, match):
    path = _saved_copy(tmp_path, edit)
    with pytest.raises(error, match=match):
        create_model(load_model_config(path), path, torch.bfloat16, torch.device("cpu"), 64)
