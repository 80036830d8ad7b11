"""Core data model: sampling parameters, requests, batches and the per-process context."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch


class CacheHandle(Protocol):
    """What a request keeps of its prefix-cache match (see kvcache.base.BaseCacheHandle)."""

    cached_len: int

    def get_matched_indices(self) -> torch.Tensor: ...


class KVPool(Protocol):
    """The KV storage layers write to (see kvcache.base.BaseKVCache)."""

    def k_cache(self, layer_id: int) -> torch.Tensor: ...

    def v_cache(self, layer_id: int) -> torch.Tensor: ...

    def store_kv(
        self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor, layer_id: int
    ) -> None: ...


class AttentionSpec(Protocol):
    """What a backend's fused attention block reads of a layer (layers.AttentionLayer)."""

    layer_id: int
    num_qo_heads: int
    num_kv_heads: int
    sliding_window: int | None

    def qk_norms(self) -> tuple[torch.Tensor, torch.Tensor, float] | None: ...

    def rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]: ...


class AttentionBackend(Protocol):
    """Computes attention for one layer of the current batch (see attention.base)."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch
    ) -> torch.Tensor: ...

    def attention_block(
        self, layer: AttentionSpec, qkv: torch.Tensor, positions: torch.Tensor, batch: Batch
    ) -> torch.Tensor | None: ...

    def paged_decode_args(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor] | None: ...

    def cascade_decode_args(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor] | None: ...

    def shared_prefix_state(
        self, q: torch.Tensor, layer_id: int, batch: Batch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None: ...


class TensorParallel(Protocol):
    """The collectives a sharded layer runs (distributed.comm.TPGroup); size 1: none."""

    rank: int
    size: int

    @property
    def sharded(self) -> bool: ...

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]: ...

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor: ...


class RequestError(ValueError):
    """A request that can never run; `param` names the field at fault, `code` is the OpenAI
    error code the API server reports (e.g. "context_length_exceeded")."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.param = param
        self.code = code


# The most alternatives a request may ask log-probabilities of per token (vLLM's default).
MAX_LOGPROBS = 20
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")


@dataclass
class StructuredOutput:
    """A constraint on the output's text: kind "json" (spec: a JSON schema as a string, or
    "" for any JSON object), "regex", "choice" (spec: a JSON list of the allowed strings) or
    "grammar" (spec: an EBNF grammar)."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(
                f"invalid sampling parameter structured={self.kind!r}: choose one of "
                f"{list(STRUCTURED_KINDS)}"
            )


class GrammarState(Protocol):
    """A request's position in its structured-output grammar (an xgrammar GrammarMatcher)."""

    def accept_token(self, token_id: int) -> bool: ...

    def rollback(self, num_tokens: int = 1) -> None: ...

    def is_terminated(self) -> bool: ...

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> Any: ...


# Temperatures below this sample greedily (SGLang's bound): dividing logits by a smaller one
# overflows float32 (1e-45 made every logit infinite and the draw NaN).
GREEDY_TEMPERATURE = 1e-6


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop. Greedy when temperature is below
    GREEDY_TEMPERATURE (0) or top_k is 1."""

    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # None: as many as the context leaves after the prompt.
    max_tokens: int | None = 1024
    # Log-probabilities (the model's raw distribution): None off; k >= 0 the chosen token's
    # and its k most likely alternatives, of each generated token / of each prompt token.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None
    # EOS and stop_token_ids neither end the request nor are sampled before this many tokens.
    min_tokens: int = 0
    # Token id -> value added to its logit (OpenAI's logit_bias), before temperature.
    logit_bias: dict[int, float] = field(default_factory=dict)
    # A matched stop string (or stop token) stays at the end of the text.
    include_stop_str_in_output: bool = False
    # SGLang's request priority, larger = more important: `--schedule-policy priority` admits
    # it first, retraction takes lower ones first, the `priority` eviction policy keeps its
    # prefixes longer.
    priority: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first out-of-range parameter."""
        checks = [
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0.0),
            ("top_k", self.top_k == -1 or self.top_k >= 1),
            ("top_p", 0.0 < self.top_p <= 1.0),
            ("min_p", 0.0 <= self.min_p <= 1.0),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0),
            (
                "repetition_penalty",
                math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0,
            ),
            ("seed", self.seed is None or -(2**63) <= self.seed < 2**63),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
            ),
            (
                "max_tokens",
                self.max_tokens is None
                or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            ),
            ("min_tokens", isinstance(self.min_tokens, int) and self.min_tokens >= 0),
            (
                "priority",
                isinstance(self.priority, int)
                and not isinstance(self.priority, bool)
                and -(2**63) <= self.priority < 2**63,
            ),
        ]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"invalid sampling parameter {name}={getattr(self, name)!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"invalid sampling parameter min_tokens={self.min_tokens}: more than "
                f"max_tokens={self.max_tokens}"
            )
        for token, bias in self.logit_bias.items():
            ok = isinstance(bias, (int, float)) and -100.0 <= bias <= 100.0
            if not (isinstance(token, int) and token >= 0 and ok):
                raise ValueError(
                    f"invalid sampling parameter logit_bias={{{token!r}: {bias!r}}}: token ids "
                    "are integers >= 0, biases lie in [-100, 100]"
                )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


# "error": the request alone failed (its processing raised, or its logits were not finite).
FinishReason = Literal["stop", "length", "abort", "error"]


# How an embedding request pools its prompt's final hidden states (Req.pooling); "score": the
# next-token logits of Req.score_tokens at the prompt's end (a reranker's yes / no).
POOLING_MODES = ("last", "mean", "score")


@dataclass(eq=False)
class Req:
    """One running request and where its KV lives.

    `input_ids` holds the prompt plus the tokens generated so far (CPU). Tokens [0, cached_len)
    have KV in the pool; this step computes [cached_len, device_len).
    """

    uid: int
    input_ids: torch.Tensor
    sampling_params: SamplingParams
    prompt_len: int
    max_device_len: int
    table_idx: int = -1
    cached_len: int = 0
    device_len: int = 0
    cache_handle: CacheHandle | None = None
    # Prompt tokens served from the prefix cache at admission (for hit-rate accounting).
    prompt_cached_tokens: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None  # why it failed, with finish_reason "error"
    # Where the output is constrained: the grammar's state, advanced by each token.
    grammar: GrammarState | None = None
    # Prompt log-probabilities gathered chunk by chunk until the first token carries them:
    # [token id, logprob, [[alternative id, logprob], ...]] per prompt token (the first's
    # logprob None: nothing precedes it).
    prompt_logprobs: list[list[Any]] | None = None
    # The LoRA adapter it runs under (None: the base model) and, while it holds one, the
    # adapter's slot (engine/lora.py).
    lora: str | None = None
    lora_slot: int = -1
    # Its tokens' prefix-cache keys are -(id + cache_key_offset) under an adapter, so that no
    # prefix computed under one adapter (or none) is ever matched under another (0: the ids).
    cache_key_offset: int = 0
    # An embedding request (POOLING_MODES): its prompt's final hidden states pooled, no token
    # generated; pool_sum gathers them chunk by chunk (mean: their sum, last: the last one).
    pooling: str | None = None
    pool_sum: torch.Tensor | None = None
    score_tokens: list[int] | None = None

    def cache_key(self, end: int) -> torch.Tensor:
        """The prefix-cache key of tokens [0, end)."""
        ids = self.input_ids[:end]
        return ids if self.cache_key_offset == 0 else -(ids + self.cache_key_offset)

    @property
    def extend_len(self) -> int:
        return self.device_len - self.cached_len

    @property
    def output_len(self) -> int:
        return len(self.input_ids) - self.prompt_len

    @property
    def is_chunked(self) -> bool:
        """A prefill that stops short of the known tokens: its step produces no token."""
        return self.device_len < len(self.input_ids)

    def __repr__(self) -> str:
        return (
            f"Req(uid={self.uid}, table_idx={self.table_idx}, cached_len={self.cached_len}, "
            f"device_len={self.device_len}, prompt_len={self.prompt_len}, "
            f"output_len={self.output_len})"
        )


@dataclass(eq=False)
class Batch:
    """The requests of one forward step and the tensors prepared for it."""

    reqs: list[Req]
    phase: Literal["prefill", "decode"]
    input_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    out_loc: torch.Tensor | None = None
    attn_metadata: Any = None
    # Rows of the logits to sample from (one per request that produces a token this step).
    logits_indices: torch.Tensor | None = None
    # Speculative decoding (decode only): each request's draft tokens, verified in this step at
    # the positions after its last token (None: one position per request).
    drafts: list[list[int]] | None = None
    # Per input row its adapter's scaling on its slot's columns (layers/lora.py); None: no row
    # runs under an adapter.
    lora_mask: torch.Tensor | None = None
    lora_slots: torch.Tensor | None = None  # per input row its adapter's slot (-1: none)

    @property
    def is_prefill(self) -> bool:
        return self.phase == "prefill"

    @property
    def is_decode(self) -> bool:
        return self.phase == "decode"


@dataclass
class Context:
    """Per-process engine state shared by layers, backends and caches."""

    page_size: int = 1
    page_table: torch.Tensor | None = None
    kv_cache: KVPool | None = None
    attn_backend: AttentionBackend | None = None
    _batch: Batch | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")

    @property
    def batch(self) -> Batch:
        if self._batch is None:
            raise RuntimeError("no batch is being run: the engine sets it per forward")
        return self._batch

    def set_batch(self, batch: Batch | None) -> None:
        self._batch = batch

    @property
    def lora_mask(self) -> torch.Tensor | None:
        """The running batch's adapter mask (None: no batch, or no adapter in it)."""
        return None if self._batch is None else self._batch.lora_mask


_GLOBAL_CTX: Context | None = None


def set_global_ctx(ctx: Context) -> None:
    global _GLOBAL_CTX
    _GLOBAL_CTX = ctx


def get_global_ctx() -> Context:
    if _GLOBAL_CTX is None:
        raise RuntimeError("global context is not set: call set_global_ctx(Context(...)) first")
    return _GLOBAL_CTX


def reset_global_ctx() -> None:
    global _GLOBAL_CTX
    _GLOBAL_CTX = None
