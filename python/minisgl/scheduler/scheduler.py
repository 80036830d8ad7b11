"""Scheduler: continuous batching with chunked prefill, retraction and overlap scheduling."""

from __future__ import annotations

import itertools
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from minisgl.core import Batch, FinishReason, Req, SamplingParams
from minisgl.engine import Engine, ForwardInput, ForwardOutput
from minisgl.env import ENV
from minisgl.kvcache import BaseCacheHandle, create_prefix_cache
from minisgl.utils import div_ceil, init_logger

from .cache import CacheManager
from .config import SchedulerConfig
from .output import SchedulerStats, TokenOutput
from .policy import SCHEDULE_POLICIES
from .prepare import prepare_forward_input, validate_request
from .table import TableManager

logger = init_logger(__name__)

# Admission reserves this share of each running request's remaining output (SGLang's
# new_token_ratio): it starts cautious, decays while decode runs fine, and jumps after a
# retraction. Retraction is what keeps an optimistic estimate safe.
_RATIO_INIT, _RATIO_MIN, _RATIO_DECAY = 0.7, 0.1, 0.001


@dataclass
class InFlight:
    """A launched step whose tokens have not been processed yet."""

    batch: Batch
    sampled: list[Req]
    result: ForwardOutput | Future[ForwardOutput]

    def output(self) -> ForwardOutput:
        result = self.result
        return (result.result() if isinstance(result, Future) else result).wait()


class Scheduler:
    """Admits requests, builds each step's batch, runs it and hands tokens back.

    With overlap scheduling, step N+1 is scheduled and launched before step N's tokens are
    processed; a request therefore learns it finished one step late, and nothing it holds is
    released while a launched step still uses it.
    """

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
        self.order_queue = SCHEDULE_POLICIES[config.schedule_policy]
        self.waiting: deque[Req] = deque()
        self.chunked: Req | None = None
        self.running: list[Req] = []
        self.stats = SchedulerStats()
        self.new_token_ratio = _RATIO_INIT
        self._uids = itertools.count()
        self._outbox: list[TokenOutput] = []
        self._in_flight: InFlight | None = None
        self._last_was_prefill = False
        self._executor: ThreadPoolExecutor | None = None

    @property
    def overlap(self) -> bool:
        return not ENV.DISABLE_OVERLAP_SCHEDULING.value and self.config.overlap_schedule

    # ---------------------------------------------------------------- requests in
    def add_request(
        self, input_ids: list[int] | torch.Tensor, sampling_params: SamplingParams
    ) -> int:
        """Queue a request; raises ValueError naming the parameter when it can never run."""
        ids, max_device_len = validate_request(self.engine, input_ids, sampling_params)
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
            self._drop(req)
            if not self._is_in_flight(req):  # else released once its step is processed
                self._release(req)
        req.finish_reason = "abort"
        self._outbox.append(TokenOutput(uid, None, "abort", req.prompt_cached_tokens))
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self._outbox or self._in_flight)

    # ---------------------------------------------------------------- one step
    def step(self) -> list[TokenOutput]:
        """Launch the next batch and process the previous one (overlap) or this one."""
        if self._in_flight is not None and not self._decode_fits():
            # Decode would need retraction, which must not touch a step still running.
            self._process(self._in_flight)
            self._in_flight = None
        batch = self._schedule()
        launched = self._launch(batch) if batch is not None else None
        previous, self._in_flight = self._in_flight, launched if self.overlap else None
        if previous is not None:
            self._process(previous)
        if launched is not None and not self.overlap:
            self._process(launched)
        if batch is None and previous is None:  # nothing ran, nothing was pending
            if self.waiting:
                raise RuntimeError(f"{len(self.waiting)} queued requests cannot be admitted")
            self.cache_manager.check_integrity()
        outputs, self._outbox = self._outbox, []
        return outputs

    def _forward(self, forward_input: ForwardInput) -> ForwardOutput:
        return self.engine.forward(forward_input)

    def _launch(self, batch: Batch) -> InFlight:
        forward_input = prepare_forward_input(batch, self.engine)
        sampled = [r for r in batch.reqs if not r.is_chunked]
        result: ForwardOutput | Future[ForwardOutput]
        if self.overlap and self.device.type == "cpu":
            # PyTorch releases the GIL inside ops, so the next step is scheduled meanwhile.
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="minisgl-forward")
            result = self._executor.submit(self._forward, forward_input)
        else:
            result = self._forward(forward_input)
        for req in batch.reqs:  # steps run in order: later steps see this step's KV
            req.cached_len = req.device_len
        return InFlight(batch, sampled, result)

    # ---------------------------------------------------------------- scheduling
    def _schedule(self) -> Batch | None:
        # Prefill first (whole prompts waiting are admitted back to back: fewer, fuller decode
        # steps), but alternate while a long prompt is chunked, so running decodes are not
        # starved.
        chunking = self._last_was_prefill and self.chunked is not None
        prefill_first = not (chunking and self.running)
        batch = None
        if prefill_first:
            batch = self._schedule_prefill()
        if batch is None:
            batch = self._schedule_decode()
        if batch is None and not prefill_first:
            batch = self._schedule_prefill()
        self._last_was_prefill = batch is not None and batch.is_prefill
        return batch

    def _reserved_pages(self) -> int:
        """Pages admitted requests are expected to claim before they finish."""
        reserved = 0.0
        for req in self.running:
            remaining = req.max_device_len - req.device_len
            reserved += div_ceil(int(remaining * self.new_token_ratio), self.page_size)
        if self.chunked is not None:
            chunked = self.chunked
            reserved += self.cache_manager.pages_to_grow(chunked, len(chunked.input_ids))
            remaining_out = chunked.max_device_len - len(chunked.input_ids)
            reserved += div_ceil(int(remaining_out * self.new_token_ratio), self.page_size)
        return int(reserved)

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
        if self.waiting and budget > 0:
            self.order_queue(self.waiting, lambda r: self.cache_manager.match_req(r).cached_len)
        reserved = self._reserved_pages()
        while self.waiting and budget > 0 and self.table_manager.available > 0:
            req = self.waiting[0]
            handle = self.cache_manager.match_req(req)
            self.cache_manager.lock(handle)
            remaining_out = req.max_device_len - len(req.input_ids)
            prompt_pages = div_ceil(len(req.input_ids), self.page_size)
            need = prompt_pages - handle.cached_len // self.page_size
            need += div_ceil(int(remaining_out * self.new_token_ratio), self.page_size)
            if need > self.cache_manager.available_size // self.page_size - reserved:
                self.cache_manager.unlock(handle)
                break
            self.waiting.popleft()
            reserved += need
            self._admit(req, handle)
            extend = min(len(req.input_ids) - req.cached_len, budget)
            reqs.append(req)
            new_lens.append(req.cached_len + extend)
            budget -= extend
        if not reqs:
            return None
        self.cache_manager.allocate(reqs, new_lens)
        for req, new_len in zip(reqs, new_lens):
            req.device_len = new_len
            if req.is_chunked:
                self.chunked = req
            else:
                self.running.append(req)
        return Batch(reqs, "prefill")

    def _admit(self, req: Req, handle: BaseCacheHandle) -> None:
        req.table_idx = self.table_manager.allocate()
        self.engine.token_pool[req.table_idx, : len(req.input_ids)] = req.input_ids.to(self.device)
        self.cache_manager.attach(req, handle)
        if req.output_len == 0:  # not a resumed (retracted) request
            req.prompt_cached_tokens = handle.cached_len
            self.stats.prompt_tokens += req.prompt_len
            self.stats.cached_tokens += handle.cached_len

    def _decode_reqs(self) -> list[Req]:
        # With overlap, a request whose last token is still being sampled is not decoded again.
        return [r for r in self.running if r.device_len + 1 < r.max_device_len]

    def _decode_fits(self) -> bool:
        need = sum(
            self.cache_manager.pages_to_grow(r, r.device_len + 1) for r in self._decode_reqs()
        )
        return need * self.page_size <= self.cache_manager.available_size

    def _schedule_decode(self) -> Batch | None:
        while self.running and not self._decode_fits():
            self._retract(self.running[-1])
        reqs = self._decode_reqs()
        if not reqs:
            return None
        self.cache_manager.allocate(reqs, [r.device_len + 1 for r in reqs])
        for req in reqs:
            req.device_len += 1
        self.new_token_ratio = max(_RATIO_MIN, self.new_token_ratio - _RATIO_DECAY)
        return Batch(reqs, "decode")

    def _retract(self, req: Req) -> None:
        """Send the most recently admitted request back to the queue; its KV stays cached."""
        assert not self._is_in_flight(req), "retracting a request of a running step"
        self._drop(req)
        self._release(req)
        req.cached_len = req.device_len = 0
        req.table_idx = -1
        self.waiting.appendleft(req)
        self.stats.retractions += 1
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.2)
        logger.debug("retracted %s", req)

    # ---------------------------------------------------------------- results out
    def _finish_reason(self, req: Req, token: int) -> FinishReason | None:
        params = req.sampling_params
        if (token in self.eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return "stop"
        if len(req.input_ids) >= req.max_device_len:
            return "length"
        return None

    def _process(self, step: InFlight) -> None:
        tokens = step.output().next_tokens_cpu.tolist()
        for req, token in zip(step.sampled, tokens):
            if req.finish_reason is not None:
                continue  # finished or aborted while this step ran: its token is not sent
            req.input_ids = torch.cat([req.input_ids, torch.tensor([token], dtype=torch.int32)])
            req.finish_reason = self._finish_reason(req, token)
            self.stats.generated_tokens += 1
            cached = req.prompt_cached_tokens if req.finish_reason else 0
            self._outbox.append(TokenOutput(req.uid, token, req.finish_reason, cached))
            if req.finish_reason is not None:
                self._drop(req)
        for req in step.batch.reqs:
            if req.finish_reason is not None:
                if not self._is_in_flight(req) and req.cache_handle is not None:
                    self._release(req)
            elif step.batch.is_prefill:
                self.cache_manager.cache_req(req, finished=False)

    def _is_in_flight(self, req: Req) -> bool:
        return self._in_flight is not None and any(r is req for r in self._in_flight.batch.reqs)

    def _drop(self, req: Req) -> None:
        """Stop scheduling the request (it stays allocated until released)."""
        if req is self.chunked:
            self.chunked = None
        elif req in self.running:
            self.running.remove(req)

    def _release(self, req: Req) -> None:
        self.cache_manager.cache_req(req, finished=True)
        self.table_manager.free(req.table_idx)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
