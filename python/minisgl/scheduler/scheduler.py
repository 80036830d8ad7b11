"""Scheduler: continuous batching with chunked prefill, retraction and overlap scheduling."""

from __future__ import annotations

import itertools
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from minisgl.core import Batch, Req
from minisgl.distributed.worker import TPWorkerError, TPWorkers, prepare_workers
from minisgl.engine import Engine, ForwardInput, ForwardOutput
from minisgl.env import ENV
from minisgl.kvcache import BaseCacheHandle, create_prefix_cache
from minisgl.utils import init_logger

from .adapters import AdaptersMixin
from .budget import PageBudget
from .cache import CacheManager
from .config import SchedulerConfig
from .draft_plan import DraftModelPlan
from .grammar import GrammarQueue
from .logprobs import logprob_plan
from .output import InFlight, SchedulerStats, TokenOutput
from .policy import SCHEDULE_POLICIES
from .preemption import PreemptionMixin
from .prepare import prepare_forward_input, produces_token
from .requests import RequestsMixin
from .results import ResultsMixin
from .speculative import Speculator
from .table import TableManager
from .tier import open_disk_tier
from .verify import verify_prefixes, verify_rows

logger = init_logger(__name__)


class Scheduler(RequestsMixin, PreemptionMixin, ResultsMixin, AdaptersMixin):
    """Admits requests, builds each step's batch, runs it and hands tokens back.

    With overlap scheduling, step N+1 is scheduled and launched before step N's tokens are
    processed; a request therefore learns it finished one step late, and nothing it holds is
    released while a launched step still uses it.
    """

    def __init__(
        self, config: SchedulerConfig, extra_eos_ids: tuple[int, ...] = (), tokenizer: Any = None
    ) -> None:
        """tokenizer: the model's (HF); without it structured output is refused."""
        self.config = config
        # A draft model (STANDALONE) is checked first and its KV paid from the target's budget.
        draft = DraftModelPlan.from_config(config) if config.speculative_draft_model_path else None
        extra_kv = 0 if draft is None else draft.kv_bytes_per_slot
        if config.tp_size > 1:
            prepare_workers()  # the other ranks' imports, while this process loads rank 0
        self.engine = Engine(config, extra_kv_bytes_per_slot=extra_kv)
        # Rank 0 of a tensor-parallel engine: the other ranks replay its steps on their shards.
        self.tp_workers = TPWorkers.start(config, self.engine) if config.tp_size > 1 else None
        self.device = self.engine.device
        self.page_size = config.page_size
        self.eos_ids = frozenset(self.engine.model_config.eos_token_ids + tuple(extra_eos_ids))
        self.max_model_len = self.engine.max_model_len
        self.table_manager = TableManager(config.max_running_req)
        self.cache_manager = CacheManager(
            self.engine.num_pages,
            config.page_size,
            self.engine.page_table,
            create_prefix_cache(config.cache_type, self.device, config.radix_eviction_policy),
            open_disk_tier(config, self.engine),
        )
        self.cache_manager.adapter_keys = self.engine.lora
        self.order_queue = SCHEDULE_POLICIES[config.schedule_policy]
        self.waiting: deque[Req] = deque()
        self.chunked: Req | None = None
        self.running: list[Req] = []
        self.stats = SchedulerStats()
        self.budget = PageBudget(config.page_size)
        self._uids = itertools.count()
        self._outbox: list[TokenOutput] = []
        self._in_flight: InFlight | None = None
        self._last_was_prefill = False
        self._executor: ThreadPoolExecutor | None = None
        # Made at the first constrained request (building xgrammar's vocabulary takes ~0.6 s).
        self.grammars: GrammarQueue | None = None
        self._tokenizer = tokenizer
        self.speculator: Speculator | None = None
        if config.speculative_algorithm is not None:
            assert config.max_prefill_length is not None
            drafter = None if draft is None else draft.build(self.engine, config.max_prefill_length)
            row_bounds = self.engine.decode_row_bounds()
            self.speculator = Speculator.from_config(config, drafter, row_bounds)

    @property
    def overlap(self) -> bool:
        # Drafts follow a request's last token, so speculation needs it processed: no overlap.
        if self.speculator is not None:
            return False
        return not ENV.DISABLE_OVERLAP_SCHEDULING.value and bool(self.config.overlap_schedule)

    # ---------------------------------------------------------------- one step
    def step(self) -> list[TokenOutput]:
        """Launch the next batch and process the previous one (overlap) or this one."""
        self._queue_compiled()
        if self.engine.lora is not None and self.engine.lora.unregistering:
            self.forget_unused_adapters()
        # A constrained request's next token mask needs its last token: no overlap then.
        overlap = self.overlap and not any(r.grammar is not None for r in self._admitted())
        if self._in_flight is not None and not (
            overlap and self._decode_fits() and self._chunk_fits() and not self._may_preempt()
        ):
            # Short of pages (or about to preempt): retraction must not touch a step still
            # running, and what that step finishes is released once it is processed.
            self._process(self._in_flight)
            self._in_flight = None
        batch = self._schedule()
        started = time.perf_counter()
        launched = self._launch(batch) if batch is not None else None
        previous, self._in_flight = self._in_flight, launched if overlap else None
        if previous is not None:
            self._process(previous)
        if launched is not None and not overlap:
            reqs = launched.batch.reqs
            speculator = self.speculator if launched.batch.is_decode else None
            lengths = [len(req.input_ids) for req in reqs] if speculator is not None else []
            self._process(launched)
            if speculator is not None:
                rows = len(launched.batch.out_loc) if launched.batch.out_loc is not None else 0
                speculator.cost.observe(rows, time.perf_counter() - started)
                emitted = [len(req.input_ids) - length for req, length in zip(reqs, lengths)]
                speculator.settle(reqs, emitted, rows)
        if batch is None and previous is None:  # nothing ran, nothing was pending
            if self.grammars is not None and self.grammars.pending:
                pass  # constraints still compiling
            elif self.waiting:
                # Idle, so the head fits by validation: reaching this is a bug, which must cost
                # that request only, never the engine.
                head = self.waiting.popleft()
                logger.error("cannot admit %s on an idle engine; failing it", head)
                self._fail(head, "the request could not be scheduled (internal error)")
            else:
                self.cache_manager.check_integrity()
                if self.speculator is not None:
                    self.speculator.check_integrity()
        outputs, self._outbox = self._outbox, []
        return outputs

    def _queue_compiled(self) -> None:
        """Queue the requests whose constraint compiled (waiting a little when idle)."""
        if self.grammars is None or not self.grammars.pending:
            return
        idle = not (self.waiting or self.running or self.chunked or self._in_flight)
        compiled, failed = self.grammars.ready(0.05 if idle else 0.0)
        self.waiting.extend(compiled)
        for req, why, code in failed:
            self._fail(req, why, "structured", code)

    def _forward(self, forward_input: ForwardInput) -> ForwardOutput:
        if self.tp_workers is None:
            return self.engine.forward(forward_input)
        self.tp_workers.check("before a step")
        try:
            return self.engine.forward(forward_input)
        except Exception as e:  # a collective failed: say which rank, where one is gone
            self.tp_workers.check("during a step", grace_s=2.0)
            raise TPWorkerError(f"a tensor-parallel step failed: {e}") from e

    def _launch(self, batch: Batch) -> InFlight:
        sampled = [r for r in batch.reqs if produces_token(r)]
        # A verify step samples every query position (before the step moves cached_len).
        rows, prefixes = sampled, None
        if batch.drafts is not None:
            rows, prefixes = verify_rows(sampled, batch.drafts), verify_prefixes(batch.drafts)
        plan = logprob_plan(batch, rows)
        forward_input = prepare_forward_input(
            batch, self.engine, self.eos_ids, self.grammars, plan, rows, prefixes
        )
        result: ForwardOutput | Future[ForwardOutput]
        if self.overlap and self.device.type == "cpu":
            # PyTorch releases the GIL inside ops, so the next step is scheduled meanwhile.
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="minisgl-forward")
            result = self._executor.submit(self._forward, forward_input)
        else:
            result = self._forward(forward_input)
        pooling = [r for r in batch.reqs if r.pooling is not None and batch.is_prefill]
        step = InFlight(batch, sampled, result, plan.indices, plan.spans, pooling)
        for req in batch.reqs:  # steps run in order: later steps see this step's KV
            req.cached_len = req.device_len
        return step

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

    def _admitted(self) -> list[Req]:
        """Requests holding KV pages: running, and the one being chunked."""
        return self.running + ([self.chunked] if self.chunked is not None else [])

    def _next_chunk(self, budget: int) -> tuple[int, int]:
        """The chunked request's next extent within `budget` tokens, and the pages it needs."""
        assert self.chunked is not None
        req = self.chunked
        new_len = req.device_len + min(len(req.input_ids) - req.device_len, budget)
        return new_len, self.cache_manager.pages_to_grow(req, new_len)

    def _chunk_fits(self) -> bool:
        """Whether the chunked request's next chunk (a whole budget's worth) has its pages."""
        if self.chunked is None:
            return True
        assert self.config.max_prefill_length is not None
        _, pages = self._next_chunk(self.config.max_prefill_length)
        return pages * self.page_size <= self.cache_manager.available_size

    def _schedule_prefill(self) -> Batch | None:
        budget = self.config.max_prefill_length
        assert budget is not None
        reqs: list[Req] = []
        new_lens: list[int] = []
        # What every admitted request still needs, the chunked one's rest of prompt included;
        # a newcomer is admitted only if its own need fits beside it.
        reserved = self.budget.reserved(self._admitted())
        if self.chunked is not None:
            if not self._chunk_fits():
                # Decode runs meanwhile and frees pages (or retracts); alone, the chunk fits.
                return None
            new_len, _ = self._next_chunk(budget)
            req, self.chunked = self.chunked, None
            reqs.append(req)
            new_lens.append(new_len)
            budget -= new_len - req.device_len
        if self.waiting and budget > 0:
            self.order_queue(self.waiting, lambda r: self.cache_manager.match_req(r).cached_len)
        while self.waiting and budget > 0 and self.table_manager.available > 0:
            req = self.waiting[0]
            # The disk tier may load pages beside what admitted requests reserve.
            spare = self.cache_manager.available_size // self.page_size - reserved
            handle = self.cache_manager.match_req(req, tier_pages=spare)
            self.cache_manager.lock(handle)  # its pages stop counting as evictable
            need = self.budget.pages_to_claim(req, handle.cached_len)
            if need > self.cache_manager.available_size // self.page_size - reserved:
                # This step's admissions are not running yet: their pages stay reserved.
                claimed = reserved - self.budget.reserved(self._admitted())
                if not self._preempt_for(req, need + claimed):
                    self.cache_manager.unlock(handle)
                    break
                reserved = self.budget.reserved(self._admitted()) + claimed
            if req.lora is not None and not self._take_adapter_slot(req):
                self.cache_manager.unlock(handle)  # every slot holds another adapter in use
                break
            self._dequeue(req)
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
            self._retract(self._retraction_victim())
        reqs = self._decode_reqs()
        if not reqs:
            return None
        drafts = self._drafts(reqs)
        new_lens = [r.device_len + 1 + len(d) for r, d in zip(reqs, drafts)]
        self.cache_manager.allocate(reqs, new_lens)
        for req, new_len, draft in zip(reqs, new_lens, drafts):
            if draft:  # the inputs of the positions after the last token
                start = req.device_len + 1
                self.engine.token_pool[req.table_idx, start : start + len(draft)] = torch.tensor(
                    draft, dtype=torch.int32
                ).to(self.device)
            req.device_len = new_len
        self.budget.on_decode()
        return Batch(reqs, "decode", drafts=drafts if any(drafts) else None)

    def _drafts(self, reqs: list[Req]) -> list[list[int]]:
        """Each decode request's draft tokens this step (none without speculation), cut to the
        room its max length leaves and dropped where their pages are not free (a draft never
        evicts cached KV)."""
        if self.speculator is None:
            return [[] for _ in reqs]
        # device_len is the last token's position: the step may emit 1 + drafts tokens.
        room = [r.max_device_len - r.device_len - 2 for r in reqs]
        drafts = self.speculator.propose(reqs, room)
        need = sum(
            self.cache_manager.pages_to_grow(r, r.device_len + 1 + len(d))
            for r, d in zip(reqs, drafts)
        )
        if any(drafts) and need > self.cache_manager.num_free_pages:
            return [[] for _ in reqs]
        return drafts

    def _retract(self, req: Req) -> None:
        """Send a running request back to the queue; its KV stays cached."""
        assert not self._is_in_flight(req), "retracting a request of a running step"
        self._drop(req)
        self._release(req)
        req.cached_len = req.device_len = 0
        req.table_idx = -1
        self.waiting.appendleft(req)
        self.stats.retractions += 1
        self.budget.on_retraction()
        logger.debug("retracted %s", req)

    def shutdown(self) -> None:
        if self.grammars is not None:
            self.grammars.close()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self.cache_manager.close()  # the tree's KV to the disk tier, if there is one
        if self.speculator is not None:
            self.speculator.close()
        if self.tp_workers is not None:
            self.tp_workers.shutdown(self.engine)
            self.tp_workers = None
        if self.engine.cpu_threads is not None:
            self.engine.cpu_threads.close()
