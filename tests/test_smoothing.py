"""SmoothQuant's smoothing for `int8` (models/smoothing.py): the scales' formula, and on a
model whose norms feed outlier channels (an equivalent rewrite of a tiny model, the shape
trained LLMs take) bf16 logits closer to the dense model's than unsmoothed W8A8 where the CPU
rounds activations to int8 per 32 columns (VNNI); elsewhere nothing changes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers import MIXED_PROMPTS, assert_all_pages_free, greedy, spy_logits, tiny_model
from safetensors.torch import load_file, save_file

from minisgl.env import ENV
from minisgl.kernel.cpu import cpu_kernels
from minisgl.llm import LLM
from minisgl.models.smoothing import smoothing_scales
from minisgl.models.smoothing_cache import load_scales, save_scales, scales_file
from minisgl.scheduler.tier import tier_fingerprint

KERNELS = cpu_kernels()
# The channels made outliers, and by how much: the norm's weight times OUTLIER, the columns it
# feeds divided by it (the same model in exact arithmetic).
OUTLIER_CHANNELS = (5, 40)
OUTLIER = 40.0


def test_smoothing_scales_are_smoothquants_and_one_where_nothing_balances() -> None:
    input_max = torch.tensor([4.0, 0.0, float("nan"), 1.0, 9.0])
    weight_max = torch.tensor([1.0, 1.0, 1.0, 0.0, 4.0])
    assert smoothing_scales(input_max, weight_max, 0.5).tolist() == [2.0, 1.0, 1.0, 1.0, 1.5]
    assert smoothing_scales(input_max, weight_max, 1.0).tolist() == [4.0, 1.0, 1.0, 1.0, 9.0]
    with pytest.raises(ValueError, match="alpha"):
        smoothing_scales(input_max, weight_max, 1.5)


def _outlier_model(target: Path) -> Path:
    """Tiny qwen3 rewritten so that every layer's norms, and its up rows (down's input, silu(gate)
    * up), put OUTLIER_CHANNELS OUTLIER times above the rest, the projections they feed scaled
    back."""
    source = tiny_model("qwen3")
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors*"))
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(source.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    channels = list(OUTLIER_CHANNELS)
    for name, tensor in tensors.items():
        if name.endswith(("input_layernorm.weight", "post_attention_layernorm.weight")):
            tensor[channels] *= OUTLIER
        elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            tensor[:, channels] /= OUTLIER
        elif name.endswith("gate_proj.weight"):
            tensor[:, channels] /= OUTLIER
        elif name.endswith("up_proj.weight"):
            tensor[:, channels] /= OUTLIER
            tensor[channels] *= OUTLIER
        elif name.endswith("down_proj.weight"):
            tensor[:, channels] /= OUTLIER
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def _prefill_logits(
    path: Path,
    quantization: str | None,
    tp_size: int = 1,
    fingerprints: list[str] | None = None,
    adapter: Path | None = None,
) -> tuple[torch.Tensor, int]:
    """bf16 prefill logits of MIXED_PROMPTS (one batch; every prompt under `adapter` where
    given) and the projections rank 0 smoothed."""
    lora = {} if adapter is None else {"lora_modules": {"adapter": str(adapter)}}
    llm = LLM(
        str(path),
        device="cpu",
        dtype=torch.bfloat16,
        quantization=quantization,
        tp_size=tp_size,
        num_page_override=4096,
        max_seq_len_override=512,
        max_running_req=len(MIXED_PROMPTS),
        **lora,
    )
    prefill = spy_logits(llm, "prefill")
    llm.generate(MIXED_PROMPTS, greedy(1), lora=None if adapter is None else "adapter")
    assert len(prefill) == 1, len(prefill)
    assert llm.generate(MIXED_PROMPTS[:3], greedy(6))[0]["token_ids"]  # decode runs after it
    assert_all_pages_free(llm)
    smoothed = llm.engine.smoothed
    if fingerprints is not None:  # the disk KV tier's key: never KV of other scales, or none
        fingerprints.append(tier_fingerprint(llm.config, llm.engine))
    llm.shutdown()
    return prefill[0].float(), smoothed


def test_int8_smooths_outlier_channels_where_activations_are_rounded_to_int8(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.set_num_threads(2)
    path = _outlier_model(tmp_path / "qwen3-outliers")
    monkeypatch.setattr(ENV.CACHE_DIR, "value", tmp_path / "cache")  # the scales' cache
    dense, _ = _prefill_logits(path, None)
    fingerprints: list[str] = []
    smoothed, projections = _prefill_logits(path, "int8", fingerprints=fingerprints)
    # The next start applies the cached scales as the weights load, calibrating nothing: the
    # same integers, the same logits.
    import minisgl.engine.calibration as calibration

    monkeypatch.setattr(calibration, "run_prefill", None)
    from_cache, cached_projections = _prefill_logits(path, "int8", fingerprints=fingerprints)
    monkeypatch.undo()
    monkeypatch.setattr(ENV.CACHE_DIR, "value", tmp_path / "cache")
    assert cached_projections == projections and torch.equal(from_cache, smoothed)
    monkeypatch.setattr(ENV.CPU_INT8_SMOOTHING, "value", False)
    plain, none = _prefill_logits(path, "int8", fingerprints=fingerprints)
    assert none == 0 and fingerprints[0] == fingerprints[1]
    assert (fingerprints[0] != fingerprints[2]) == (projections > 0), fingerprints
    # AVX2 keeps an 8-bit weight's activations to 16 bits; AMX-INT8 rounds them per row beside
    # outlier columns against per-row weights, where smoothing measured no gain.
    if KERNELS is None or not KERNELS.has_vnni or KERNELS.has_amx_int8:
        assert projections == 0 and torch.equal(smoothed, plain)
        return
    assert projections == 2 * 3  # qkv, gate_up and down of both layers

    def error(logits: torch.Tensor) -> float:
        return ((logits - dense).norm() / dense.norm()).item()

    # Unsmoothed, the outliers' 32-column groups round the other channels to a few levels.
    assert error(smoothed) < 0.5 * error(plain), (error(smoothed), error(plain))
    same = (smoothed.argmax(-1) == dense.argmax(-1)).float().mean().item()
    assert same >= (plain.argmax(-1) == dense.argmax(-1)).float().mean().item(), same

    # Two tensor-parallel ranks calibrate together once connected (the prefill's all-reduces
    # pair up), each smoothing its own shard of qkv and gate_up.
    monkeypatch.setattr(ENV.CPU_INT8_SMOOTHING, "value", True)
    monkeypatch.setenv("MINISGL_NUM_THREADS", "1")
    monkeypatch.setenv("MINISGL_TP_TIMEOUT", "60")
    torch.set_num_threads(1)
    sharded, sharded_projections = _prefill_logits(path, "int8", tp_size=2)
    assert sharded_projections == 2 * 3
    assert error(sharded) < 0.5 * error(plain), (error(sharded), error(plain))


def test_lora_adapters_read_the_smoothed_inputs_with_their_scales(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A LoRA adapter of smoothed projections (v, gate, up and down) reads their divided
    inputs: its A's columns take the scales as it loads, calibrated or from the cache, so the
    adapted model stays as close to the dense one under the adapter as smoothing keeps it
    without one."""
    from test_lora import adapter_dir

    torch.set_num_threads(2)
    path = _outlier_model(tmp_path / "qwen3-outliers")
    adapter = adapter_dir("qwen3", "b")
    monkeypatch.setattr(ENV.CACHE_DIR, "value", tmp_path / "cache")
    dense, _ = _prefill_logits(path, None, adapter=adapter)
    base, _ = _prefill_logits(path, None)
    assert ((dense - base).norm() / base.norm()).item() > 0.1  # the adapter matters
    smoothed, projections = _prefill_logits(path, "int8", adapter=adapter)
    import minisgl.engine.calibration as calibration

    monkeypatch.setattr(calibration, "run_prefill", None)  # the cached scales, as they load
    from_cache, _ = _prefill_logits(path, "int8", adapter=adapter)
    monkeypatch.undo()
    assert torch.equal(from_cache, smoothed)
    monkeypatch.setattr(ENV.CPU_INT8_SMOOTHING, "value", False)
    plain, _ = _prefill_logits(path, "int8", adapter=adapter)
    if KERNELS is None or not KERNELS.has_vnni or KERNELS.has_amx_int8:
        assert projections == 0 and torch.equal(smoothed, plain)
        return
    assert projections == 2 * 3

    def error(logits: torch.Tensor) -> float:
        return ((logits - dense).norm() / dense.norm()).item()

    # (Zen 4: 0.17 against 0.30 unsmoothed; with A as it was 1.26, with A scaled but gate_up's
    # up rows of B not divided by down's scales 0.80: worse than not smoothing.)
    assert error(smoothed) < 0.75 * error(plain), (error(smoothed), error(plain))


def test_writing_a_folders_scales_removes_its_older_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ENV.CACHE_DIR, "value", tmp_path)
    path = scales_file(tiny_model("qwen3"), None, KERNELS)
    assert path.parent == tmp_path / "smoothing"
    older = path.with_name(path.name[: -len("0123abcd.safetensors")] + "0123abcd.safetensors")
    other = path.with_name("another-0123abcd0123abcd.safetensors")
    path.parent.mkdir()
    older.write_bytes(b"stale")
    other.write_bytes(b"kept")
    scales = {"model.layers.0.self_attn.qkv_proj": torch.tensor([0.5, 2.0])}
    save_scales(path, scales)
    assert not older.exists() and other.exists()
    loaded = load_scales(path)
    assert loaded is not None and torch.equal(
        loaded["model.layers.0.self_attn.qkv_proj"], scales["model.layers.0.self_attn.qkv_proj"]
    )
    path.write_bytes(b"truncated")  # unreadable: calibrated again, not an error
    assert load_scales(path) is None
