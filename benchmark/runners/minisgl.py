"""minisgl's offline engine (`minisgl.llm.LLM`) in this process, counting the prompt tokens
each prefill computes and timing every decode step."""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

import paths  # noqa: F401  (before minisgl: a checkout without `pip install -e .`)
from phases import Request
from results import RunResult

from minisgl.core import SamplingParams
from minisgl.llm import LLM
from runners.base import PhaseOutput, PhaseRunner


class MinisglRunner(PhaseRunner):
    """An in-process `minisgl.llm.LLM` that counts the prompt tokens each prefill computes."""

    def __init__(
        self,
        model_path: Path,
        dtype: str,
        name: str = "minisgl",
        max_seq_len: int = 2048,
        kv_tokens: int | None = None,
        **llm_kwargs: Any,
    ) -> None:
        self.name = name
        page_size = int(llm_kwargs.get("page_size", 1))
        num_pages = None if kv_tokens is None else -(-kv_tokens // page_size)
        # Headroom over the longest request, rounded to 64: a modest KV/page-table footprint
        # that does not sit exactly on the engine's length limit.
        self.llm = LLM(
            str(model_path),
            dtype=dtype,
            max_seq_len_override=-(-(max_seq_len + 1) // 64) * 64,
            num_page_override=num_pages,
            **llm_kwargs,
        )
        # (phase, start, end, prompt tokens computed, batch size) of every forward step.
        self.events: list[tuple[str, float, float, int, int]] = []
        orig = self.llm._forward

        def spy(forward_input: Any) -> Any:
            batch = forward_input.batch
            computed = 0
            if batch.is_prefill:
                # One position per prompt token computed. Read from the prepared batch, not
                # from `extend_len`: with overlap scheduling this runs on a worker thread while
                # the scheduler already moves each request's `cached_len` on.
                positions = getattr(batch, "positions", None)
                computed = (
                    sum(r.extend_len for r in batch.reqs)
                    if positions is None
                    else int(positions.numel())
                )
            start = time.perf_counter()
            out = orig(forward_input)
            self.events.append((batch.phase, start, time.perf_counter(), computed, len(batch.reqs)))
            return out

        self.llm._forward = spy  # type: ignore[method-assign]

    def start_run(self) -> None:
        """Forget the forward steps of earlier runs."""
        self.events.clear()

    def run_phase(self, phase: list[Request], prompts: list[list[int]]) -> PhaseOutput:
        """One `generate` call with every prompt of the phase; the engine reports the counts."""
        params = [
            SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in phase
        ]
        start = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        return PhaseOutput(
            outputs=[o["token_ids"] for o in outs],
            wall_s=wall,
            prompt_tokens=sum(o["prompt_tokens"] for o in outs),
            output_tokens=sum(len(o["token_ids"]) for o in outs),
            bad_lengths=sum(len(o["token_ids"]) != r.max_tokens for o, r in zip(outs, phase)),
            cached_tokens=sum(o["cached_tokens"] for o in outs),
        )

    def finish_run(self, result: RunResult) -> None:
        """Prompt tokens computed and the decode span, from the forward steps recorded."""
        decodes = [e for e in self.events if e[0] == "decode"]
        result.prefill_computed = sum(e[3] for e in self.events)
        result.decode_steps = len(decodes) or None
        # From the start of the first decode forward to the end of the last one: includes
        # the scheduler's work between steps, not just the model.
        result.decode_s = (decodes[-1][2] - decodes[0][1]) if decodes else None

    def close(self) -> None:
        """Shut the engine down and free its memory."""
        self.llm.shutdown()
        del self.llm
        gc.collect()
