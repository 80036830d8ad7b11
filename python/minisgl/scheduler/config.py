"""Scheduler settings on top of the engine's."""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.engine import EngineConfig
from minisgl.kvcache import PREFIX_CACHES


@dataclass
class SchedulerConfig(EngineConfig):
    cache_type: str = "radix"
    # Prompt tokens computed per prefill step; longer prompts are prefilled in chunks.
    max_prefill_length: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.cache_type not in PREFIX_CACHES:
            raise ValueError(
                f"unknown cache_type {self.cache_type!r}; choose one of {PREFIX_CACHES.names()}"
            )
        if self.max_prefill_length is None:
            self.max_prefill_length = 2048 if self.device.type == "cpu" else 8192
        if self.max_prefill_length < 1:
            raise ValueError(f"max_prefill_length must be >= 1, got {self.max_prefill_length}")
