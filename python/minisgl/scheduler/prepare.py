"""Turning requests into tensors: request validation and per-step batch preparation."""

from __future__ import annotations

import torch

from minisgl.core import Batch, SamplingParams
from minisgl.engine import Engine, ForwardInput
from minisgl.utils import div_ceil


def validate_request(
    engine: Engine, input_ids: list[int] | torch.Tensor, sampling_params: SamplingParams
) -> tuple[torch.Tensor, int]:
    """The prompt as a CPU tensor and its KV footprint; ValueError if it can never run."""
    ids = torch.as_tensor(input_ids, dtype=torch.int32).flatten().cpu()
    vocab, max_seq_len = engine.model_config.vocab_size, engine.max_seq_len
    if len(ids) == 0:
        raise ValueError("prompt is empty: give at least one token")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise ValueError(f"prompt token ids must lie in [0, {vocab}), got {ids.tolist()}")
    if len(ids) >= max_seq_len:
        raise ValueError(
            f"prompt has {len(ids)} tokens; the context holds {max_seq_len} "
            "(prompt + at least one generated token)"
        )
    max_device_len = min(len(ids) + sampling_params.max_tokens, max_seq_len)
    pool_tokens = engine.num_pages * engine.page_size
    if div_ceil(max_device_len, engine.page_size) > engine.num_pages:
        raise ValueError(
            f"prompt ({len(ids)}) + max_tokens ({sampling_params.max_tokens}) needs "
            f"{max_device_len} KV slots; the pool holds {pool_tokens}"
        )
    return ids, max_device_len


def prepare_forward_input(batch: Batch, engine: Engine) -> ForwardInput:
    """Positions, KV slots, logits rows, attention metadata and sampling args of a batch."""
    reqs, device = batch.reqs, engine.device
    rows = torch.tensor([r.table_idx for r in reqs], dtype=torch.int64)
    if batch.is_decode:
        positions = torch.tensor([r.cached_len for r in reqs], dtype=torch.int64)
        input_rows = rows
        logits_indices = None
    else:
        extend = torch.tensor([r.extend_len for r in reqs], dtype=torch.int64)
        positions = torch.cat([torch.arange(r.cached_len, r.device_len) for r in reqs])
        input_rows = rows.repeat_interleave(extend)
        last = extend.cumsum(0) - 1
        keep = torch.tensor([not r.is_chunked for r in reqs], dtype=torch.bool)
        logits_indices = last[keep].to(device)
    positions, input_rows = positions.to(device), input_rows.to(device)
    batch.positions = positions
    batch.out_loc = engine.page_table[input_rows, positions].long()
    batch.logits_indices = logits_indices
    engine.attn_backend.prepare_metadata(batch)
    sampled = [r for r in reqs if not r.is_chunked]
    return ForwardInput(
        batch=batch,
        sample_args=engine.sampler.prepare(sampled),
        input_rows=input_rows,
        token_rows=torch.tensor([r.table_idx for r in sampled], dtype=torch.int64).to(device),
        token_cols=torch.tensor([r.device_len for r in sampled], dtype=torch.int64).to(device),
    )
