"""Requests in: queued after their checks (validation, LoRA adapter, pooling, grammar), or
stopped wherever they are (a mixin of Scheduler)."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from minisgl.core import Req, RequestError, SamplingParams
from minisgl.engine import Engine

from .grammar import GrammarQueue
from .output import InFlight, TokenOutput
from .prepare import check_pooling, lora_key_offset, validate_request


class RequestsMixin:
    """add_request / abort_request / has_work; the state they use is Scheduler's."""

    engine: Engine
    config: Any
    device: torch.device
    waiting: deque[Req]
    running: list[Req]
    chunked: Req | None
    grammars: GrammarQueue | None
    _tokenizer: Any
    _uids: itertools.count
    _outbox: list[TokenOutput]
    _in_flight: InFlight | None

    # Scheduler's methods (annotations only: a stub here would shadow the other mixins').
    _admitted: Callable[[], list[Req]]
    _drop: Callable[[Req], None]
    _release: Callable[[Req], None]
    _is_in_flight: Callable[[Req], bool]

    def add_request(
        self,
        input_ids: list[int] | torch.Tensor,
        sampling_params: SamplingParams,
        clip_to_context: bool = True,
        lora: str | None = None,
        pooling: str | None = None,
        score_tokens: list[int] | None = None,
    ) -> int:
        """Queue a request (under the LoRA adapter `lora`, None: the base model); raises
        RequestError naming the parameter when it can never run (with `clip_to_context` False
        also when prompt + max_tokens exceed max_model_len)."""
        ids, max_device_len = validate_request(
            self.engine, input_ids, sampling_params, clip_to_context
        )
        key_offset = 0 if lora is None else lora_key_offset(self.engine, lora)
        check_pooling(self.engine, sampling_params, pooling, score_tokens)
        uid = next(self._uids)
        req = Req(uid, ids, sampling_params, prompt_len=len(ids), max_device_len=max_device_len)
        req.lora, req.cache_key_offset = lora, key_offset
        req.pooling, req.score_tokens = pooling, score_tokens
        if sampling_params.structured is None:
            self.waiting.append(req)
            return uid
        if self.grammars is None:
            if self._tokenizer is None:
                raise RequestError("structured output needs the model's tokenizer", "structured")
            vocab = self.engine.model_config.vocab_size
            timeout = self.config.grammar_compile_timeout_s
            self.grammars = GrammarQueue(self._tokenizer, vocab, timeout)
        self.grammars.add(req)  # queued once its grammar is compiled (RequestError: busy)
        return uid

    def abort_request(self, uid: int) -> bool:
        """Stop a request wherever it is and release what it holds; False if unknown/finished."""
        req = next((r for r in self.waiting if r.uid == uid), None)
        if req is not None:
            self.waiting.remove(req)
        elif self.grammars is not None and (req := self.grammars.remove(uid)) is not None:
            pass  # still compiling: holds nothing yet
        else:
            req = next((r for r in self._admitted() if r.uid == uid), None)
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
        queued = self.waiting or (self.grammars is not None and self.grammars.pending)
        return bool(queued or self.running or self.chunked or self._outbox or self._in_flight)
