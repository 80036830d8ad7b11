"""Engine: one per rank. Owns the model, KV pool, page table, attention backend and sampler."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import psutil
import torch

from minisgl.attention import ATTN_BACKENDS, default_attn_backend
from minisgl.core import Batch, Context, set_global_ctx
from minisgl.distributed import ReplicaStep, StepMessage, TPGroup
from minisgl.env import ENV
from minisgl.kernel.ops import ops_for
from minisgl.kvcache import MHAKVCache
from minisgl.layers.linear import decode_row_bounds
from minisgl.models import create_model, load_model_config
from minisgl.utils import div_ceil, init_logger
from minisgl.utils.memory import bound_onednn_caches, keep_freed_memory

from .calibration import cached_scales, smooth_int8, smooths
from .config import EngineConfig
from .cpu_threads import CpuThreads
from .logprobs import (
    LogprobRows,
    TokenLogprobs,
    processed_logits,
    prompt_token_logprobs,
    token_logprobs,
)
from .lora import LoraManager
from .sample import SampleArgs, Sampler

logger = init_logger(__name__)


def pool(
    hidden: torch.Tensor,
    spans: list[tuple[int, int, str, list[int] | None]],
    head: Callable[[torch.Tensor], torch.Tensor],
) -> list[torch.Tensor]:
    """Each embedding request's rows pooled (float32): their sum (mean), the last one (last), or
    the head's logits of its score tokens at the last one (score: one head product for all)."""
    scored = [end - 1 for _, end, mode, _ in spans if mode == "score"]
    logits = iter(head(hidden[scored]) if scored else ())
    pooled = []
    for start, end, mode, tokens in spans:
        if mode == "mean":
            pooled.append(hidden[start:end].float().sum(0))
        elif mode == "score":
            pooled.append(next(logits)[tokens].float())
        else:
            pooled.append(hidden[end - 1].float())
    return pooled


@dataclass
class ForwardInput:
    """Everything one forward step needs: the prepared batch and its sampling settings."""

    batch: Batch
    sample_args: SampleArgs
    # Table row of every input token; its id is read from the token pool when the step runs,
    # so a token sampled by the previous, still-running step is seen (overlap scheduling).
    input_rows: torch.Tensor
    # Where the sampled tokens go in the token pool: (table rows, positions).
    token_rows: torch.Tensor
    token_cols: torch.Tensor
    # Rows that want log-probabilities: of their sampled token / of their next prompt token.
    logprob_rows: LogprobRows | None = None
    prompt_logprob_rows: LogprobRows | None = None
    # Tensor parallelism: the step as the other ranks replay it (TPGroup.describe_step).
    tp_message: StepMessage | None = None
    # Embedding requests: per request its rows [start, end), pooling mode (Req.pooling) and
    # the tokens whose logits a "score" request wants.
    pool_spans: list[tuple[int, int, str, list[int] | None]] | None = None


@dataclass
class ForwardOutput:
    next_tokens: torch.Tensor  # on device
    next_tokens_cpu: torch.Tensor
    # [sampled requests, vocab] (see CausalLM), before sampling; valid until the next forward.
    logits: torch.Tensor
    copy_done: torch.cuda.Event | None = None
    # For ForwardInput.logprob_rows / prompt_logprob_rows, row for row.
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: TokenLogprobs | None = None
    # For ForwardInput.pool_spans, span for span: float32 [hidden], the rows' sum (mean) or
    # the last row (last).
    pooled: list[torch.Tensor] | None = None

    def wait(self) -> ForwardOutput:
        """Block until `next_tokens_cpu` holds the step's tokens."""
        if self.copy_done is not None:
            self.copy_done.synchronize()
        return self


def flag_non_finite(
    logits: torch.Tensor, sampled: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens with -1 where the row's chosen logit is NaN or infinite, tokens safe to feed
    back as input). A row that went non-finite fails its request alone; reading only the
    chosen logit of each row costs nothing next to a scan of the vocabulary."""
    return ops_for(logits).flag_non_finite(logits, sampled)


class Engine:
    """One rank's model, KV pool, page table, attention backend and sampler."""

    def __init__(
        self,
        config: EngineConfig,
        extra_kv_bytes_per_slot: int = 0,
        cpu_threads: CpuThreads | None = None,
    ) -> None:
        """extra_kv_bytes_per_slot: the KV bytes per token slot of another pool with as many
        pages as this one's (a draft model's), paid from the same memory budget; cpu_threads:
        those of an engine this one runs beside in the same thread (a draft model's target)."""
        self.config = config
        self.extra_kv_bytes_per_slot = extra_kv_bytes_per_slot
        self.device = config.device
        if self.device.type == "cuda" and config.tp_size > 1:
            self.device = torch.device("cuda", config.tp_rank)  # one GPU per rank
        self.tp = TPGroup(config.tp_rank, config.tp_size, self.device)
        self.cpu_threads: CpuThreads | None = cpu_threads
        if self.device.type == "cpu" and cpu_threads is None:
            # At most one thread per available core (MINISGL_NUM_THREADS: at most that many),
            # fewer while other processes keep cores busy (MINISGL_ADAPTIVE_THREADS=0: never);
            # tensor-parallel ranks on one machine split them (and MINISGL_NUM_THREADS).
            total = ENV.NUM_THREADS.value or len(os.sched_getaffinity(0))
            max_threads = max(1, total // (config.tp_size // config.nnodes))
            self.cpu_threads = CpuThreads(max_threads, adaptive=ENV.ADAPTIVE_THREADS.value)
            keep_freed_memory()
            bound_onednn_caches()
        self.model_config = load_model_config(config.model_path)
        model_max = self.model_config.max_position_embeddings
        self.max_seq_len = min(config.max_seq_len_override or model_max, model_max)
        # `int8` smoothing's scales from an earlier start, applied as the weights load.
        self._scales_path, cached = cached_scales(config, self.tp.sharded)
        self.model = create_model(
            self.model_config,
            config.model_path,
            config.dtype,
            self.device,
            self.max_seq_len,
            config.quantization,
            config.gguf_path,
            self.tp,
            cached,
        )
        # `int8` smoothing's scales by projection name (models/smoothing.py); without cached
        # ones a tensor-parallel rank's once the group is connected (the calibration prefill
        # all-reduces).
        self.smoothing_scales: dict[str, torch.Tensor] = cached or {}
        self.lora: LoraManager | None = None
        if config.enable_lora:  # before the KV budget: the slots' memory is the model's
            self.lora = LoraManager(
                self.model, config.max_loras, config.max_lora_rank, config.dtype, self.device
            )
            for name, path in (config.lora_modules or {}).items():
                self.lora.register(name, path)
            self.lora.smoothed(self.smoothing_scales)
        # This rank's KV heads (all of them without tensor parallelism).
        self.num_kv_heads = self.model.shard.kv_heads
        self.page_size = config.page_size
        self.num_pages = config.num_page_override or self._pages_from_memory_budget()
        # The longest sequence a request may reach: its page-table row, and all of the pool.
        self.max_model_len = min(self.max_seq_len, self.num_pages * self.page_size)
        mc = self.model_config
        self.kv_cache = MHAKVCache(
            mc.num_layers,
            self.num_pages * self.page_size,
            self.num_kv_heads,
            mc.head_dim,
            config.dtype,
            self.device,
        )
        table_shape = (config.max_running_req, self.max_seq_len)
        self.page_table = torch.zeros(table_shape, dtype=torch.int32, device=self.device)
        self.token_pool = torch.zeros(table_shape, dtype=torch.int32, device=self.device)
        backend = config.attention_backend
        if backend == "auto":
            backend = default_attn_backend(self.device)
        self.attn_backend = ATTN_BACKENDS[backend](
            self.kv_cache, self.page_table, mc.sliding_windows
        )
        self.ctx = Context(
            page_size=self.page_size,
            page_table=self.page_table,
            kv_cache=self.kv_cache,
            attn_backend=self.attn_backend,
        )
        set_global_ctx(self.ctx)
        self.sampler = Sampler(mc.vocab_size, self.device)
        if not self.tp.sharded:
            self.smooth_int8()
        logger.info(
            "engine ready: %s %s on %s, %d KV pages x %d tokens, max_model_len %d "
            "(model context %d, page-table row %d, KV pool %d tokens)",
            mc.architecture,
            str(config.dtype).removeprefix("torch."),
            self.device,
            self.num_pages,
            self.page_size,
            self.max_model_len,
            model_max,
            self.max_seq_len,
            self.num_pages * self.page_size,
        )

    def smooth_int8(self) -> None:
        """SmoothQuant's calibration and smoothing for `int8` (see calibration.smooth_int8):
        at start, before any request; every tensor-parallel rank at once."""
        config = self.config
        if self.smoothing_scales or not smooths(config):  # done as it loaded, or nothing to do
            return
        self.smoothing_scales = smooth_int8(
            self.model,
            self.ctx,
            self.max_model_len - 1,
            config.model_path,
            config.quantization,
            config.gguf_path,
            self._scales_path,
        )
        if self.lora is not None:
            self.lora.smoothed(self.smoothing_scales)

    @property
    def smoothed(self) -> int:
        """How many projections `int8` smoothing rewrote (0: none)."""
        return len(self.smoothing_scales)

    def decode_row_bounds(self) -> list[int]:
        """Row counts past which a decode step multiplies a row another way (the quantized
        projections' kernel paths change): within them a row's result does not depend on the
        step's row count."""
        return decode_row_bounds(self.model)

    def _pages_from_memory_budget(self) -> int:
        mc = self.model_config
        per_token = self.extra_kv_bytes_per_slot + MHAKVCache.bytes_per_slot(
            mc.num_layers, self.num_kv_heads, mc.head_dim, self.config.dtype
        )
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * ENV.MEMORY_RATIO.value
        else:
            available = psutil.virtual_memory().available * ENV.MEMORY_RATIO.value
            budget = min(ENV.CPU_KV_CACHE_GB.value * 2**30, available)
        budget_pages = int(budget // (per_token * self.page_size))
        # More pages than every slot filled to max_seq_len can never be used.
        useful_pages = self.config.max_running_req * div_ceil(self.max_seq_len, self.page_size)
        num_pages = min(budget_pages, useful_pages)
        if num_pages < div_ceil(self.max_seq_len, self.page_size) // 8 or num_pages < 1:
            raise RuntimeError(
                f"KV memory budget {budget / 2**30:.2f} GiB fits only {num_pages} pages; "
                "raise MINISGL_CPU_KV_CACHE_GB / MINISGL_MEMORY_RATIO or set num_page_override"
            )
        return num_pages

    def _run_model(
        self,
        batch: Batch,
        prompt_rows: LogprobRows | None,
        pool_spans: list[tuple[int, int, str, list[int] | None]] | None = None,
    ) -> tuple[torch.Tensor, TokenLogprobs | None, list[torch.Tensor] | None]:
        """The step's logits (and prompt rows' log-probabilities, embedding requests' pooled
        hidden states) with the batch set."""
        assert batch.input_ids is not None and batch.positions is not None
        if pool_spans:
            hidden = self.model.hidden_states(batch.input_ids, batch.positions)
            pooled = pool(hidden, pool_spans, self.model.logits)
            indices = batch.logits_indices
            logits = self.model.logits(hidden if indices is None else hidden[indices], True)
            prompt = (
                None
                if prompt_rows is None
                else prompt_token_logprobs(hidden, prompt_rows, self.model.logits)
            )
            return logits, prompt, pooled
        if prompt_rows is None:
            # Sampled right after, before the next step can run: its buffer may be reused.
            logits = self.model(
                batch.input_ids, batch.positions, batch.logits_indices, reuse_logits=True
            )
            return logits, None, None
        hidden = self.model.hidden_states(batch.input_ids, batch.positions)
        indices = batch.logits_indices
        logits = self.model.logits(hidden if indices is None else hidden[indices], True)
        return logits, prompt_token_logprobs(hidden, prompt_rows, self.model.logits), None

    @torch.inference_mode()
    def replay(self, step: ReplicaStep) -> None:
        """A worker rank: run rank 0's step on this rank's shard (the same collectives in the
        same order); its logits are rank 0's to sample."""
        if self.cpu_threads is not None:
            self.cpu_threads.update()
        set_global_ctx(self.ctx)
        batch = step.batch
        self.attn_backend.prepare_metadata(batch)
        self.ctx.set_batch(batch)
        try:
            prompt_rows = None
            if step.prompt_rows is not None:  # targets only matter to rank 0's log-softmax
                rows = step.prompt_rows
                prompt_rows = LogprobRows(rows, 0, torch.zeros_like(rows))
            self._run_model(batch, prompt_rows)
        finally:
            self.ctx.set_batch(None)

    @torch.inference_mode()
    def forward(self, forward_input: ForwardInput) -> ForwardOutput:
        """Run the model on the batch, sample, and record the tokens in the token pool."""
        batch = forward_input.batch
        if self.cpu_threads is not None:
            self.cpu_threads.update()
        set_global_ctx(self.ctx)  # several engines may live in one process (tests, benchmarks)
        self.ctx.set_batch(batch)
        try:
            assert batch.positions is not None
            batch.input_ids = self.token_pool[forward_input.input_rows, batch.positions]
            prompt_rows = forward_input.prompt_logprob_rows
            if forward_input.tp_message is not None:  # the other ranks run the same forward
                self.tp.send_step(forward_input.tp_message, batch.input_ids)
            logits, prompt_logprobs, pooled = self._run_model(
                batch, prompt_rows, forward_input.pool_spans
            )
        finally:
            self.ctx.set_batch(None)
        wanted = forward_input.logprob_rows
        # Before sampling, which may change the logits in place.
        raw = None
        if wanted is not None and self.config.logprobs_mode == "processed_logprobs":
            args = forward_input.sample_args
            adjusted = self.sampler.adjusted_logits(logits, args, self.token_pool)
            raw = processed_logits(adjusted, args).index_select(0, wanted.rows)
        elif wanted is not None:
            raw = logits.index_select(0, wanted.rows).float()
        sampled = self.sampler.sample(logits, forward_input.sample_args, self.token_pool)
        next_tokens, pool_tokens = flag_non_finite(logits, sampled)
        self.token_pool[forward_input.token_rows, forward_input.token_cols] = pool_tokens
        logprobs = None
        if wanted is not None and raw is not None:
            logprobs = token_logprobs(raw, next_tokens.index_select(0, wanted.rows), wanted.top_k)
        out = ForwardOutput(
            next_tokens, next_tokens, logits, None, logprobs, prompt_logprobs, pooled
        )
        if self.device.type == "cuda":
            out.next_tokens_cpu = next_tokens.to("cpu", non_blocking=True)
            out.copy_done = torch.cuda.Event()
            out.copy_done.record()
        return out
