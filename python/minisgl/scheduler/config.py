"""Scheduler settings on top of the engine's."""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.engine import EngineConfig


@dataclass
class SchedulerConfig(EngineConfig):
    cache_type: str = "radix"
    # Prompt tokens computed per prefill step; longer prompts are prefilled in chunks.
    max_prefill_length: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_prefill_length is None:
            self.max_prefill_length = 2048 if self.device.type == "cpu" else 8192
        if self.max_prefill_length < 1:
            raise ValueError(f"max_prefill_length must be >= 1, got {self.max_prefill_length}")
