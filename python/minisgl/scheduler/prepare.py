"""Turning requests into tensors: request validation and per-step batch preparation."""

from __future__ import annotations

import torch

from minisgl.core import POOLING_MODES, Batch, Req, RequestError, SamplingParams
from minisgl.engine import Engine, ForwardInput

from .grammar import GrammarQueue
from .logprobs import LogprobPlan, logprob_plan


def validate_request(
    engine: Engine,
    input_ids: list[int] | torch.Tensor,
    sampling_params: SamplingParams,
    clip_to_context: bool = True,
) -> tuple[torch.Tensor, int]:
    """The prompt as a CPU tensor and the length the request may reach (prompt + max_tokens);
    RequestError if it can never run. A max_tokens past the context is cut to what is left
    (`clip_to_context`, as vLLM's offline API) or refused (as its OpenAI server)."""
    ids = torch.as_tensor(input_ids, dtype=torch.int32).flatten().cpu()
    vocab, limit = engine.model_config.vocab_size, engine.max_model_len
    if len(ids) == 0:
        raise RequestError("prompt is empty: give at least one token", "prompt")
    bad = ids[(ids < 0) | (ids >= vocab)]
    if len(bad):
        raise RequestError(
            f"prompt token ids must lie in [0, {vocab}), got {bad[:8].tolist()}", "prompt"
        )
    outside = [t for t in sampling_params.logit_bias if t >= vocab]
    if outside:
        raise RequestError(
            f"logit_bias token ids must lie in [0, {vocab}), got {sorted(outside)[:8]}",
            "logit_bias",
        )
    outside = sorted(t for t in sampling_params.stop_token_ids if not 0 <= t < vocab)
    if outside:
        raise RequestError(
            f"stop_token_ids must lie in [0, {vocab}), got {outside[:8]}", "stop_token_ids"
        )
    if len(ids) >= limit:
        raise RequestError(
            f"this model's maximum context length is {limit} tokens and the prompt has "
            f"{len(ids)}: no room is left to generate a token",
            "prompt",
            "context_length_exceeded",
        )
    max_tokens = sampling_params.max_tokens
    if max_tokens is None or (clip_to_context and len(ids) + max_tokens > limit):
        return ids, limit
    if len(ids) + max_tokens > limit:
        raise RequestError(
            f"this model's maximum context length is {limit} tokens; the prompt has "
            f"{len(ids)} and max_tokens is {max_tokens} ({len(ids) + max_tokens} in all): "
            "shorten the prompt or lower max_tokens",
            "max_tokens",
            "context_length_exceeded",
        )
    return ids, len(ids) + max_tokens


def check_pooling(
    engine: Engine,
    sampling_params: SamplingParams,
    pooling: str | None,
    score_tokens: list[int] | None,
) -> None:
    """RequestError for an embedding or score request that cannot run (None: a generation)."""
    if pooling is None:
        if score_tokens:
            raise RequestError("score_tokens need pooling 'score'", "score_tokens")
        return
    if pooling not in POOLING_MODES:
        raise RequestError(f"pooling must be one of {POOLING_MODES}, got {pooling!r}", "pooling")
    if sampling_params.structured is not None:
        raise RequestError("an embedding request takes no structured output", "pooling")
    vocab = engine.model_config.vocab_size
    if (pooling == "score") != bool(score_tokens) or any(
        not 0 <= t < vocab for t in score_tokens or []
    ):
        raise RequestError(
            f"a score request names its tokens (in [0, {vocab})), got {score_tokens}",
            "score_tokens",
        )
    if pooling == "score" and engine.tp.sharded:
        # its extra output-head product would be rank 0's alone (a collective)
        raise RequestError("scoring is not served under tensor parallelism", "pooling")


def produces_token(req: Req) -> bool:
    """Whether this step samples a token for the request: not a prompt chunk short of its end,
    not an embedding request (its hidden states are pooled instead)."""
    return not req.is_chunked and req.pooling is None


def lora_key_offset(engine: Engine, lora: str) -> int:
    """The prefix-cache key offset of a registered adapter's requests (Req.cache_key)."""
    if engine.lora is None:
        raise RequestError(f"LoRA adapter {lora!r} asked for, but LoRA is not enabled", "lora")
    offset = engine.lora.key_offsets.get(lora)
    if offset is None or lora in engine.lora.unregistering:
        names = sorted(set(engine.lora.adapters) - engine.lora.unregistering)
        raise RequestError(f"no LoRA adapter {lora!r} is loaded (loaded: {names})", "lora")
    return offset


def prepare_forward_input(
    batch: Batch,
    engine: Engine,
    eos_ids: frozenset[int] = frozenset(),
    grammars: GrammarQueue | None = None,
    plan: LogprobPlan | None = None,
    sampled: list[Req] | None = None,
    prefixes: list[list[int]] | None = None,
) -> ForwardInput:
    """Positions, KV slots, logits rows, attention metadata and sampling args of a batch
    (`eos_ids`: the tokens min_tokens keeps from being drawn; `grammars`: the constrained
    requests' token masks; `plan`: the rows that get log-probabilities; `sampled`: one request
    per logits row, by default every request that produces a token, see verify_rows;
    `prefixes`: per row, the drafts its grammar mask follows, see verify_prefixes)."""
    reqs, device = batch.reqs, engine.device
    rows = torch.tensor([r.table_idx for r in reqs], dtype=torch.int64)
    if batch.is_decode and batch.drafts is None:
        positions = torch.tensor([r.cached_len for r in reqs], dtype=torch.int64)
        input_rows = rows
        logits_indices = None
    elif batch.is_decode:  # a verify step: every position's logits
        extend = torch.tensor([r.extend_len for r in reqs], dtype=torch.int64)
        positions = torch.cat([torch.arange(r.cached_len, r.device_len) for r in reqs])
        input_rows = rows.repeat_interleave(extend)
        logits_indices = None
    else:
        extend = torch.tensor([r.extend_len for r in reqs], dtype=torch.int64)
        positions = torch.cat([torch.arange(r.cached_len, r.device_len) for r in reqs])
        input_rows = rows.repeat_interleave(extend)
        last = extend.cumsum(0) - 1
        # Embedding requests produce no token: their rows are pooled instead (pool_spans).
        keep = torch.tensor([produces_token(r) for r in reqs], dtype=torch.bool)
        logits_indices = last[keep].to(device)
    positions, input_rows = positions.to(device), input_rows.to(device)
    batch.positions = positions
    batch.out_loc = engine.page_table[input_rows, positions].long()
    batch.logits_indices = logits_indices
    if engine.lora is not None:
        slots = torch.tensor([r.lora_slot for r in reqs], dtype=torch.int64)
        if batch.is_prefill or batch.drafts is not None:
            slots = slots.repeat_interleave(extend)
        batch.lora_mask = engine.lora.mask(slots)
        if batch.lora_mask is not None:
            batch.lora_slots = slots.to(device)
    engine.attn_backend.prepare_metadata(batch)
    if sampled is None:
        sampled = [r for r in reqs if produces_token(r)]
    pool_spans = None
    if batch.is_prefill and any(r.pooling is not None for r in reqs):
        ends = torch.tensor([r.extend_len for r in reqs]).cumsum(0).tolist()
        pool_spans = [
            (end - r.extend_len, end, r.pooling, r.score_tokens)
            for r, end in zip(reqs, ends)
            if r.pooling is not None
        ]
    plan = plan if plan is not None else logprob_plan(batch, sampled)
    sample_args = engine.sampler.prepare(sampled, eos_ids)
    if grammars is not None:
        sample_args.allowed = grammars.bitmask(sampled, prefixes)
    prompt_rows = plan.prompt_rows(reqs, device)
    tp_message = None
    if engine.tp.sharded:  # described now: with overlap the requests move on before it runs
        rows = None if prompt_rows is None else prompt_rows.rows
        tp_message = engine.tp.describe_step(batch, engine.page_table, rows)
    return ForwardInput(
        batch=batch,
        sample_args=sample_args,
        input_rows=input_rows,
        token_rows=torch.tensor([r.table_idx for r in sampled], dtype=torch.int64).to(device),
        token_cols=torch.tensor([r.device_len for r in sampled], dtype=torch.int64).to(device),
        logprob_rows=plan.token_rows(sampled, device),
        prompt_logprob_rows=prompt_rows,
        tp_message=tp_message,
        pool_spans=pool_spans,
    )
