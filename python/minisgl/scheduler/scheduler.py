"""Scheduler: continuous batching over one engine (prefill first, chunked; else decode all)."""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

import torch

from minisgl.core import Batch, FinishReason, Req, SamplingParams
from minisgl.engine import Engine, ForwardInput, ForwardOutput
from minisgl.kvcache import create_prefix_cache
from minisgl.utils import div_ceil, init_logger

from .cache import CacheManager
from .config import SchedulerConfig
from .table import TableManager

logger = init_logger(__name__)


@dataclass(frozen=True)
class TokenOutput:
    """One generated token of one request; `finish_reason` is set on its last token."""

    uid: int
    token: int | None  # None only for an aborted request's closing output
    finish_reason: FinishReason | None
    # Prompt tokens that came from the prefix cache (reported with the last token).
    cached_tokens: int = 0


@dataclass
class CacheStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class Scheduler:
    """Admits requests, builds each step's batch, runs it and hands tokens back."""

    def __init__(self, config: SchedulerConfig, extra_eos_ids: tuple[int, ...] = ()) -> None:
        self.config = config
        self.engine = Engine(config)
        self.device = self.engine.device
        self.page_size = config.page_size
        self.eos_ids = frozenset(self.engine.model_config.eos_token_ids + tuple(extra_eos_ids))
        self.table_manager = TableManager(config.max_running_req)
        self.cache_manager = CacheManager(
            self.engine.num_pages,
            config.page_size,
            self.engine.page_table,
            create_prefix_cache(config.cache_type, self.device),
        )
        self.waiting: deque[Req] = deque()
        self.chunked: Req | None = None
        self.running: list[Req] = []
        self.stats = CacheStats()
        self._uids = itertools.count()
        self._aborted: list[TokenOutput] = []

    # ---------------------------------------------------------------- requests in
    def add_request(
        self, input_ids: list[int] | torch.Tensor, sampling_params: SamplingParams
    ) -> int:
        """Queue a request; raises ValueError naming the parameter when it can never run."""
        ids = torch.as_tensor(input_ids, dtype=torch.int32).flatten().cpu()
        vocab, max_seq_len = self.engine.model_config.vocab_size, self.engine.max_seq_len
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
        pool_tokens = self.engine.num_pages * self.page_size
        if div_ceil(max_device_len, self.page_size) > self.engine.num_pages:
            raise ValueError(
                f"prompt ({len(ids)}) + max_tokens ({sampling_params.max_tokens}) needs "
                f"{max_device_len} KV slots; the pool holds {pool_tokens}"
            )
        uid = next(self._uids)
        req = Req(uid, ids, sampling_params, prompt_len=len(ids), max_device_len=max_device_len)
        if sampling_params.seed is not None:
            req.generator = torch.Generator(self.device).manual_seed(sampling_params.seed)
        self.waiting.append(req)
        return uid

    def abort_request(self, uid: int) -> bool:
        """Stop a request wherever it is and release what it holds; False if unknown/finished."""
        req = next((r for r in self.waiting if r.uid == uid), None)
        if req is not None:
            self.waiting.remove(req)
        else:
            held = self.running + ([self.chunked] if self.chunked else [])
            req = next((r for r in held if r.uid == uid), None)
            if req is None:
                return False
            if req is self.chunked:
                self.chunked = None
            self._release(req)
        req.finish_reason = "abort"
        self._aborted.append(TokenOutput(uid, None, "abort", req.prompt_cached_tokens))
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self._aborted)

    # ---------------------------------------------------------------- one step
    def step(self) -> list[TokenOutput]:
        """Schedule, run and process one batch; when idle, check the page accounting."""
        aborted, self._aborted = self._aborted, []
        batch = self._schedule_prefill() or self._schedule_decode()
        if batch is None:
            if self.waiting:
                raise RuntimeError(f"{len(self.waiting)} queued requests cannot be admitted")
            self.cache_manager.check_integrity()
            return aborted
        forward_input = self._prepare(batch)
        sampled = [r for r in batch.reqs if not r.is_chunked]
        output = self._forward(forward_input)
        return aborted + self._process(batch, sampled, output)

    def _forward(self, forward_input: ForwardInput) -> ForwardOutput:
        return self.engine.forward(forward_input)

    def _reserved_pages(self) -> int:
        """Pages admitted requests may still claim to reach their max length."""
        held = self.running + ([self.chunked] if self.chunked else [])
        return sum(self.cache_manager.pages_to_grow(r, r.max_device_len) for r in held)

    def _schedule_prefill(self) -> Batch | None:
        budget = self.config.max_prefill_length
        assert budget is not None
        reqs: list[Req] = []
        new_lens: list[int] = []
        if self.chunked is not None:
            req, self.chunked = self.chunked, None
            extend = min(len(req.input_ids) - req.device_len, budget)
            reqs.append(req)
            new_lens.append(req.device_len + extend)
            budget -= extend
        reserved = self._reserved_pages()
        while self.waiting and budget > 0 and self.table_manager.available > 0:
            req = self.waiting[0]
            handle = self.cache_manager.match_req(req)
            self.cache_manager.lock(handle)
            need = (
                div_ceil(req.max_device_len, self.page_size) - handle.cached_len // self.page_size
            )
            free_pages = self.cache_manager.available_size // self.page_size - reserved
            if need > free_pages:
                self.cache_manager.unlock(handle)
                break
            self.waiting.popleft()
            reserved += need
            req.table_idx = self.table_manager.allocate()
            self.engine.token_pool[req.table_idx, : len(req.input_ids)] = req.input_ids.to(
                self.device
            )
            self.cache_manager.attach(req, handle)
            if req.output_len == 0:
                req.prompt_cached_tokens = handle.cached_len
                self.stats.prompt_tokens += req.prompt_len
                self.stats.cached_tokens += handle.cached_len
            extend = min(len(req.input_ids) - req.cached_len, budget)
            reqs.append(req)
            new_lens.append(req.cached_len + extend)
            budget -= extend
        if not reqs:
            return None
        self.cache_manager.allocate(reqs, new_lens)
        for req, new_len in zip(reqs, new_lens):
            req.device_len = new_len
        return Batch(reqs, "prefill")

    def _schedule_decode(self) -> Batch | None:
        if not self.running:
            return None
        reqs = list(self.running)
        self.cache_manager.allocate(reqs, [r.device_len + 1 for r in reqs])
        for req in reqs:
            req.device_len += 1
        return Batch(reqs, "decode")

    def _prepare(self, batch: Batch) -> ForwardInput:
        reqs, device = batch.reqs, self.device
        rows = torch.tensor([r.table_idx for r in reqs], dtype=torch.int64)
        if batch.is_decode:
            positions = torch.tensor([r.cached_len for r in reqs], dtype=torch.int64)
            token_rows = rows
            logits_indices = None
        else:
            extend = torch.tensor([r.extend_len for r in reqs], dtype=torch.int64)
            positions = torch.cat([torch.arange(r.cached_len, r.device_len) for r in reqs])
            token_rows = rows.repeat_interleave(extend)
            last = extend.cumsum(0) - 1
            keep = torch.tensor([not r.is_chunked for r in reqs], dtype=torch.bool)
            logits_indices = last[keep].to(device)
        positions, token_rows = positions.to(device), token_rows.to(device)
        batch.positions = positions
        batch.input_ids = self.engine.token_pool[token_rows, positions]
        batch.out_loc = self.engine.page_table[token_rows, positions].long()
        batch.logits_indices = logits_indices
        self.engine.attn_backend.prepare_metadata(batch)
        sampled = [r for r in reqs if not r.is_chunked]
        return ForwardInput(
            batch=batch,
            sample_args=self.engine.sampler.prepare(sampled),
            token_rows=torch.tensor([r.table_idx for r in sampled], dtype=torch.int64).to(device),
            token_cols=torch.tensor([r.device_len for r in sampled], dtype=torch.int64).to(device),
        )

    # ---------------------------------------------------------------- results out
    def _finish_reason(self, req: Req, token: int) -> FinishReason | None:
        params = req.sampling_params
        if (token in self.eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return "stop"
        if len(req.input_ids) >= req.max_device_len:
            return "length"
        return None

    def _process(
        self, batch: Batch, sampled: list[Req], output: ForwardOutput
    ) -> list[TokenOutput]:
        for req in batch.reqs:
            req.cached_len = req.device_len
        results = []
        for req, token in zip(sampled, output.next_tokens_cpu.tolist()):
            req.input_ids = torch.cat([req.input_ids, torch.tensor([token], dtype=torch.int32)])
            req.finish_reason = self._finish_reason(req, token)
            cached = req.prompt_cached_tokens if req.finish_reason else 0
            results.append(TokenOutput(req.uid, token, req.finish_reason, cached))
        for req in batch.reqs:
            if req.finish_reason is not None:
                self._release(req)
            elif batch.is_prefill:
                self.cache_manager.cache_req(req, finished=False)
                if req not in sampled:  # a chunk: the prompt is not done yet
                    self.chunked = req
                else:
                    self.running.append(req)
        return results

    def _release(self, req: Req) -> None:
        self.cache_manager.cache_req(req, finished=True)
        self.table_manager.free(req.table_idx)
        if req in self.running:
            self.running.remove(req)
