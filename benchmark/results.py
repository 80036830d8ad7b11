"""What one timed run of a workload on one engine measured (`RunResult`), and the median of
repeated runs."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RunResult:
    """One timed run of a workload on one engine."""

    engine: str
    workload: str
    wall_s: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    # Prompt tokens the engine actually ran through the model (None when unknown).
    prefill_computed: int | None = None
    # Decode phase only: steps and their time (None when not measured).
    decode_steps: int | None = None
    decode_s: float | None = None
    # Requests whose output length differed from max_tokens (should be 0).
    bad_lengths: int = 0
    # Busy-loop processes spinning beside the engine during this run (benchmark/contention.py).
    contention: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tps(self) -> float:
        """Generated tokens per second of wall time."""
        return self.output_tokens / self.wall_s

    @property
    def total_tps(self) -> float:
        """Prompt and generated tokens per second of wall time."""
        return (self.prompt_tokens + self.output_tokens) / self.wall_s

    @property
    def hit_rate(self) -> float:
        """The share of prompt tokens served from the prefix cache."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def decode_steps_per_s(self) -> float | None:
        """Decode steps per second of decode time (None when not measured)."""
        if not self.decode_steps or not self.decode_s:
            return None
        return self.decode_steps / self.decode_s

    def to_json(self) -> dict[str, Any]:
        """The fields and the derived rates, for the JSON output."""
        data = asdict(self)
        data.update(output_tps=self.output_tps, total_tps=self.total_tps, hit_rate=self.hit_rate)
        return data


def median_run(runs: Sequence[RunResult], upper: bool = False) -> RunResult:
    """The run with the median wall time (for an even count the lower middle one, or with
    `upper` the higher: the slower of the two)."""
    ordered = sorted(runs, key=lambda r: r.wall_s)
    chosen = ordered[len(ordered) // 2 if upper else (len(ordered) - 1) // 2]
    chosen.extra["repeats"] = len(runs)
    chosen.extra["wall_s_all"] = [round(r.wall_s, 4) for r in runs]
    if len(runs) > 1:
        chosen.extra["wall_s_stdev"] = statistics.stdev(r.wall_s for r in runs)
    return chosen
