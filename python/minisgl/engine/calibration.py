"""SmoothQuant's calibration at start: `int8` projections that round their bf16 input to int8
are smoothed from their inputs in one short prefill (models/smoothing.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from minisgl.core import Batch, Context, Req, SamplingParams, set_global_ctx
from minisgl.env import ENV
from minisgl.kernel.cpu import cpu_kernels
from minisgl.models import CausalLM
from minisgl.models.smoothing import (
    CALIBRATION_TOKENS,
    calibration_ids,
    input_maxima,
    smooth,
    smoothing_plan,
)
from minisgl.models.smoothing_cache import load_scales, save_scales, scales_file
from minisgl.utils import init_logger
from minisgl.utils.memory import freed_memory_returned, release_freed_memory

from .config import EngineConfig

logger = init_logger(__name__)


def run_prefill(model: CausalLM, ctx: Context, input_ids: torch.Tensor) -> torch.Tensor:
    """One prefill of `input_ids` through `model` on KV slots [0, n) of page-table row 0: its
    final hidden states [n, hidden]. Nothing is kept, so it may run only where no request holds
    a page or a row (before the scheduler starts, or between requests offline)."""
    assert ctx.page_table is not None and ctx.attn_backend is not None
    tokens, page_table = len(input_ids), ctx.page_table
    req = Req(-1, input_ids.cpu().to(torch.int32), SamplingParams(), tokens, tokens, 0, 0, tokens)
    batch = Batch([req], "prefill")
    positions = torch.arange(tokens, device=page_table.device)
    page_table[0, :tokens] = positions.to(page_table.dtype)
    batch.positions, batch.out_loc = positions, positions.clone()
    set_global_ctx(ctx)
    try:
        ctx.attn_backend.prepare_metadata(batch)
        ctx.set_batch(batch)
        with torch.inference_mode():
            return model.hidden_states(input_ids.to(page_table.device), positions)
    finally:
        ctx.set_batch(None)
        page_table[0, :tokens] = 0


def smooths(config: EngineConfig) -> bool:
    """Whether this engine's `int8` projections may be smoothed (bf16 on the CPU)."""
    return (
        config.quantization == "int8"
        and ENV.CPU_INT8_SMOOTHING.value
        and config.dtype == torch.bfloat16
        and config.device.type == "cpu"
    )


def cached_scales(
    config: EngineConfig, sharded: bool
) -> tuple[Path | None, dict[str, torch.Tensor] | None]:
    """Where this engine's smoothing scales are cached, and the scales there (None where none
    are yet); (None, None) where it keeps none (not smoothed, or tensor-parallel)."""
    if not smooths(config) or sharded:
        return None, None
    path = scales_file(config.model_path, config.gguf_path, cpu_kernels())
    return path, load_scales(path)


def smooth_int8(
    model: CausalLM,
    ctx: Context,
    max_tokens: int,
    model_dir: str | Path,
    quantization: str,
    gguf_path: str | Path | None,
    cache_to: Path | None = None,
) -> dict[str, torch.Tensor]:
    """Calibrate and smooth what `smoothing_plan` finds (nothing off VNNI, or on AMX-INT8): a
    prefill of min(CALIBRATION_TOKENS, max_tokens) seeded token ids; the scales applied, by
    projection name (written to `cache_to`, where given)."""
    plan = smoothing_plan(model)
    if not plan:
        return {}
    ids = calibration_ids(model.config.vocab_size, min(CALIBRATION_TOKENS, max_tokens))
    maxima = input_maxima(plan, lambda: run_prefill(model, ctx, ids))
    with freed_memory_returned():  # the replaced weights and the dense temporaries
        scales = smooth(model, plan, maxima, cpu_kernels(), model_dir, quantization, gguf_path)
    release_freed_memory()
    planned = sum(len(layer.projections()) for layer in plan)
    logger.info("int8: %d of %d projections smoothed (SmoothQuant)", len(scales), planned)
    if cache_to is not None and scales:
        save_scales(cache_to, scales)
    return scales
