"""Scheduler settings on top of the engine's."""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.engine import EngineConfig
from minisgl.kvcache import EVICTION_POLICIES, PREFIX_CACHES
from minisgl.layers.quantized import QUANTIZATIONS
from minisgl.utils.hf import gguf_source

# Chosen by measurement (benchmark/overlap.py, docs/cpu-fast-path.md): on a 2-core CPU the
# worker thread competes with the forward for the cores and W1 ran ~20% slower with overlap.
OVERLAP_DEFAULT = {"cpu": False, "cuda": True}
# Speculative decoding's draft sources (SGLang's names): n-grams, a draft model.
SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE")


@dataclass
class SchedulerConfig(EngineConfig):
    cache_type: str = "radix"
    # Which unlocked radix leaf is evicted first (kvcache/eviction.py): lru, lfu, fifo, mru,
    # filo, priority or slru.
    radix_eviction_policy: str = "lru"
    schedule_policy: str = "fcfs"
    # Overlap scheduling (prepare step N+1 while step N runs); None picks the device default.
    overlap_schedule: bool | None = None
    # Prompt tokens computed per prefill step; longer prompts are prefilled in chunks.
    max_prefill_length: int | None = None
    # The disk KV tier (kvcache/disk_tier.py): where evicted KV is kept across restarts
    # (None: no tier), and how many GiB of files it may hold there.
    kv_cache_dir: str | None = None
    kv_cache_disk_gb: float = 16.0
    # Seconds one structured-output constraint may compile (scheduler/grammar.py) before its
    # request fails; None or <= 0: no limit (the offline LLM's default; the server's is 10).
    grammar_compile_timeout_s: float | None = None
    # Speculative decoding (scheduler/speculative.py), SGLang's flags: "NGRAM" drafts from the
    # request's own tokens and recent requests', "STANDALONE" from a small model of the same
    # vocabulary (None: off); the most positions a request verifies per step, its last token
    # included (None: 8, or speculative_num_steps + 1); the draft model's folder or .gguf, its
    # quantization (QUANTIZATIONS; None: the target's load-time method, else as its checkpoint
    # holds it), and its steps (draft tokens) per verify step (None: num_draft_tokens - 1); the
    # n-gram lengths matched (longest first), the tokens the shared cache keeps after each
    # n-gram, and its size in n-grams.
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_draft_model_path: str | None = None
    speculative_draft_model_quantization: str | None = None
    speculative_num_steps: int | None = None
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 6
    speculative_ngram_branch_length: int = 12
    speculative_ngram_capacity: int = 200_000

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.cache_type not in PREFIX_CACHES:
            raise ValueError(
                f"unknown cache_type {self.cache_type!r}; choose one of {PREFIX_CACHES.names()}"
            )
        if self.radix_eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"unknown radix_eviction_policy {self.radix_eviction_policy!r}; "
                f"choose one of {EVICTION_POLICIES.names()}"
            )
        from .policy import SCHEDULE_POLICIES

        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"unknown schedule_policy {self.schedule_policy!r}; "
                f"choose one of {SCHEDULE_POLICIES.names()}"
            )
        if self.overlap_schedule is None:
            self.overlap_schedule = OVERLAP_DEFAULT[self.device.type]
        if self.max_prefill_length is None:
            self.max_prefill_length = 2048 if self.device.type == "cpu" else 8192
        if self.max_prefill_length < 1:
            raise ValueError(f"max_prefill_length must be >= 1, got {self.max_prefill_length}")
        if not self.kv_cache_disk_gb > 0:
            raise ValueError(f"kv_cache_disk_gb must be > 0, got {self.kv_cache_disk_gb}")
        self._check_speculative()
        if self.kv_cache_dir is not None:
            self.kv_cache_dir = str(self.kv_cache_dir)
            if self.cache_type != "radix":
                raise ValueError(f"kv_cache_dir needs cache_type 'radix', got {self.cache_type!r}")
            if self.tp_size > 1:
                # Every rank holds its own KV heads: a load would have to reach all of them.
                raise ValueError(f"kv_cache_dir is not supported with tp_size > 1 ({self.tp_size})")

    def _check_draft_quantization(self) -> None:
        quantization, draft = (
            self.speculative_draft_model_quantization,
            self.speculative_draft_model_path,
        )
        if quantization is None:
            return
        if quantization not in QUANTIZATIONS:
            raise ValueError(
                f"unknown speculative_draft_model_quantization {quantization!r}; choose one of "
                f"{list(QUANTIZATIONS)}"
            )
        if draft is None:
            raise ValueError(
                f"speculative_draft_model_quantization={quantization!r} needs a draft model "
                "(speculative_algorithm STANDALONE and speculative_draft_model_path)"
            )
        if quantization == "gguf" and gguf_source(draft) is None:
            raise ValueError(
                "speculative_draft_model_quantization='gguf' needs a .gguf file as "
                f"speculative_draft_model_path, got {draft!r}"
            )

    def _check_speculative(self) -> None:
        algorithm = self.speculative_algorithm
        if algorithm is not None and algorithm.upper() not in SPECULATIVE_ALGORITHMS:
            raise ValueError(
                f"unknown speculative_algorithm {algorithm!r}; choose one of "
                f"{list(SPECULATIVE_ALGORITHMS)}"
            )
        self.speculative_algorithm = algorithm = None if algorithm is None else algorithm.upper()
        draft = self.speculative_draft_model_path
        if algorithm == "STANDALONE" and draft is None:
            raise ValueError(
                "speculative_algorithm STANDALONE needs speculative_draft_model_path (the draft "
                "model's folder or .gguf)"
            )
        if algorithm != "STANDALONE" and draft is not None:
            raise ValueError(
                f"speculative_draft_model_path={str(draft)!r} is used by speculative_algorithm "
                f"STANDALONE only, got speculative_algorithm={algorithm!r}"
            )
        self.speculative_draft_model_path = None if draft is None else str(draft)
        self._check_draft_quantization()
        steps, tokens = self.speculative_num_steps, self.speculative_num_draft_tokens
        if tokens is not None and tokens < 2:
            raise ValueError(f"invalid speculative_num_draft_tokens={tokens!r}: at least 2")
        if steps is not None and steps < 1:
            raise ValueError(f"invalid speculative_num_steps={steps!r}: at least 1")
        tokens = self.speculative_num_draft_tokens = tokens or (8 if steps is None else steps + 1)
        steps = self.speculative_num_steps = steps or tokens - 1
        if steps > tokens - 1:
            raise ValueError(
                f"invalid speculative_num_steps={steps}: more draft tokens than "
                f"speculative_num_draft_tokens={tokens} verifies (its last token included)"
            )
        checks = [
            (
                "speculative_ngram_min_match_window_size",
                self.speculative_ngram_min_match_window_size >= 1,
            ),
            (
                "speculative_ngram_max_match_window_size",
                self.speculative_ngram_max_match_window_size
                >= self.speculative_ngram_min_match_window_size,
            ),
            ("speculative_ngram_branch_length", self.speculative_ngram_branch_length >= 1),
            ("speculative_ngram_capacity", self.speculative_ngram_capacity >= 0),
        ]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"invalid {name}={getattr(self, name)!r}")
