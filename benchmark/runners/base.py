"""What the in-process engines share: running a workload's phases in order, each phase's prompts
built from the previous phase's, and adding up what every phase measured."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from phases import Phases, Request, next_prompts
from results import RunResult


@dataclass
class PhaseOutput:
    """What an engine measured on one phase: the tokens each request generated and the counts."""

    outputs: list[list[int]]
    wall_s: float
    prompt_tokens: int
    output_tokens: int
    bad_lengths: int
    cached_tokens: int = 0


class PhaseRunner(ABC):
    """An engine in this process that runs a workload phase by phase (`run`)."""

    name: str

    @abstractmethod
    def run_phase(self, phase: list[Request], prompts: list[list[int]]) -> PhaseOutput:
        """Run one phase, whose actual prompts are `prompts`; time only the engine's work."""

    @abstractmethod
    def start_run(self) -> None:
        """Forget what an earlier run recorded."""

    @abstractmethod
    def finish_run(self, result: RunResult) -> None:
        """Fill in what the engine recorded over the whole run (prefill and decode figures)."""

    def run(self, phases: Phases, workload: str = "") -> RunResult:
        """Run the phases in order; wall time is the sum of the phases' timed work."""
        self.start_run()
        outputs: list[list[list[int]]] = []
        prompts_done: list[list[list[int]]] = []
        result = RunResult(self.name, workload, 0.0, 0, 0, extra={"outputs": outputs})
        for k, phase in enumerate(phases):
            prompts = next_prompts(phase, prompts_done[-1] if k else [], outputs[-1] if k else [])
            prompts_done.append(prompts)
            done = self.run_phase(phase, prompts)
            outputs.append(done.outputs)
            result.wall_s += done.wall_s
            result.prompt_tokens += done.prompt_tokens
            result.output_tokens += done.output_tokens
            result.cached_tokens += done.cached_tokens
            result.bad_lengths += done.bad_lengths
        self.finish_run(result)
        return result

    @abstractmethod
    def close(self) -> None:
        """Shut the engine down and free its memory."""
