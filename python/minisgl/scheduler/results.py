"""The scheduler's results side: a processed step's tokens appended to their requests, finished
and failed requests released (a mixin of Scheduler, as SGLang's output processor is)."""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from minisgl.core import Req
from minisgl.utils import init_logger
from minisgl.utils.faults import inject as inject_fault

from .cache import CacheManager
from .grammar import GrammarQueue
from .logprobs import collect_logprobs
from .output import InFlight, SchedulerStats, TokenOutput, finish_reason
from .speculative import Speculator
from .table import TableManager
from .verify import accepted_length

logger = init_logger(__name__)


class ResultsMixin:
    """What Scheduler does with a step's output; the state it reads is Scheduler's."""

    eos_ids: frozenset[int]
    waiting: deque[Req]
    running: list[Req]
    chunked: Req | None
    stats: SchedulerStats
    cache_manager: CacheManager
    table_manager: TableManager
    _outbox: list[TokenOutput]
    _in_flight: InFlight | None
    speculator: Speculator | None
    grammars: GrammarQueue | None

    def _process(self, step: InFlight) -> None:
        output = step.output()
        if step.pooling:
            assert output.pooled is not None
            for req, pooled in zip(step.pooling, output.pooled):
                if req.finish_reason is None:
                    self._pool(req, pooled)
        tokens = output.next_tokens_cpu.tolist()
        logprobs = collect_logprobs(step, output)
        if step.batch.drafts is not None:
            self._process_verified(step, tokens, logprobs)
        else:
            for i, (req, token) in enumerate(zip(step.sampled, tokens)):
                if req.finish_reason is None:  # else finished or aborted while this step ran
                    self._append_safely(req, token, logprobs.get(i))
        for req in step.batch.reqs:
            if req.finish_reason is not None:
                if not self._is_in_flight(req) and req.cache_handle is not None:
                    self._release(req)
            elif step.batch.is_prefill and req.pooling is None:
                self.cache_manager.cache_req(req, finished=False)

    def _pool(self, req: Req, pooled: torch.Tensor) -> None:
        """An embedding request's chunk: its pooled rows gathered; after its last chunk, the
        vector is its output and the request ends (its KV freed, not cached)."""
        if req.pooling == "mean" and req.pool_sum is not None:
            pooled = req.pool_sum + pooled
        req.pool_sum = pooled
        if req.is_chunked:
            return
        vector = req.pool_sum / req.prompt_len if req.pooling == "mean" else req.pool_sum
        req.finish_reason = "stop"
        self._outbox.append(
            TokenOutput(req.uid, None, "stop", req.prompt_cached_tokens, embedding=vector.tolist())
        )
        self._drop(req)

    def _append_safely(self, req: Req, token: int, logprobs: list[Any] | None) -> None:
        try:
            self._append_token(req, token, logprobs)
        except Exception as exc:  # this request's fault: it alone ends
            logger.exception("processing %s failed", req)
            self._fail(req, f"processing the request failed: {exc}")

    def _process_verified(
        self, step: InFlight, tokens: list[int], logprobs: dict[int, list[Any]]
    ) -> None:
        """A verify step: each request keeps its drafts up to the first that differs from the
        token sampled before it, plus that sampled token (up to where it finishes); the KV of
        the rest is given back."""
        assert step.batch.drafts is not None and self.speculator is not None
        row = 0
        for req, draft in zip(step.sampled, step.batch.drafts):
            sampled = tokens[row : row + len(draft) + 1]
            accepted = accepted_length(draft, sampled)
            # The kept drafts, then the token sampled after them (equal where the rule holds).
            for i, token in enumerate(draft[:accepted] + sampled[accepted : accepted + 1]):
                if req.finish_reason is not None:
                    break  # finished or aborted: nothing after it is sent
                self._append_safely(req, token, logprobs.get(row + i))
            # KV stays for the tokens kept but the last (whose KV the next step computes).
            self.cache_manager.rewind(req, len(req.input_ids) - 1)
            if draft:
                self.speculator.record(req, len(draft), accepted)
            row += len(draft) + 1

    def _append_token(self, req: Req, token: int, logprobs: list[Any] | None = None) -> None:
        inject_fault("schedule", req.sampling_params.stop)
        if token < 0:  # the engine flags a row whose logits were not finite
            if self.grammars is not None and self.grammars.allows_nothing(req):
                # (its mask took every token: the constraint's fault, not the model's)
                self._fail(
                    req,
                    f"the structured output constraint allows no token after the "
                    f"{req.output_len} generated so far: it cannot be completed",
                    "structured",
                    "invalid_value",
                )
                return
            self._fail(req, "the model's logits for this request were not finite (NaN or inf)")
            return
        if req.grammar is not None and not req.grammar.accept_token(token):
            self._fail(req, f"token {token} breaks the request's structured output constraint")
            return
        if logprobs is not None:  # the step computed the batch's most alternatives: its own
            logprobs = [logprobs[0], logprobs[1][: req.sampling_params.logprobs or 0]]
        req.input_ids = torch.cat([req.input_ids, torch.tensor([token], dtype=torch.int32)])
        req.finish_reason = finish_reason(req, token, self.eos_ids)
        self.stats.generated_tokens += 1
        cached = req.prompt_cached_tokens if req.finish_reason else 0
        prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, None
        spec = None if self.speculator is None else self.speculator.state(req)
        out = TokenOutput(
            req.uid,
            token,
            req.finish_reason,
            cached,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            spec_verify_ct=None if spec is None else spec.verify_steps,
            spec_accepted_tokens=0 if spec is None else spec.accepted_tokens,
        )
        self._outbox.append(out)
        if req.finish_reason is not None:
            self._drop(req)

    def _fail(
        self, req: Req, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        """End one request with an error; its pages are released as for an abort. param: the
        parameter at fault (a 400 then), None for the request's own failure; code: the error
        code, where not the default one of either (server/frontend.py `api_error`)."""
        req.finish_reason = "error"
        req.error = message
        self._drop(req)
        if req in self.waiting:
            self.waiting.remove(req)
        cached = req.prompt_cached_tokens
        self._outbox.append(
            TokenOutput(
                req.uid, None, "error", cached, error=message, error_param=param, error_code=code
            )
        )

    def _is_in_flight(self, req: Req) -> bool:
        return self._in_flight is not None and any(r is req for r in self._in_flight.batch.reqs)

    def _drop(self, req: Req) -> None:
        """Stop scheduling the request (it stays allocated until released)."""
        if req is self.chunked:
            self.chunked = None
        elif req in self.running:
            self.running.remove(req)

    def _release(self, req: Req) -> None:
        if self.speculator is not None:
            self.speculator.release(req)
        # What a failed request computed last may be what went wrong; an embedding request's
        # KV serves nobody after it.
        if req.finish_reason == "error" or req.pooling is not None:
            self.cache_manager.release_uncached(req)
        else:
            self.cache_manager.cache_req(req, finished=True)
        self.table_manager.free(req.table_idx)
        if req.lora_slot >= 0:
            assert self.engine.lora is not None
            self.engine.lora.release(req.lora_slot)
            req.lora_slot = -1
