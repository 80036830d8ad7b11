"""Hugging Face transformers `generate` in this process: the baseline minisgl is compared with."""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

import paths  # noqa: F401  (before minisgl: a checkout without `pip install -e .`)
import torch
from machine import engine_threads
from phases import Request
from results import RunResult

from minisgl.llm.llm import parse_dtype
from runners.base import PhaseOutput, PhaseRunner


class HFRunner(PhaseRunner):
    """Hugging Face transformers `generate`: static batches, left padding, greedy."""

    def __init__(self, model_path: Path, dtype: str, batch_size: int | None = None) -> None:
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        self.name = "HF transformers"
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_path), dtype=parse_dtype(dtype)
        ).to(self.device)
        self.model.eval()
        # The same thread count minisgl got (the minisgl engine sets it process-wide too).
        torch.set_num_threads(engine_threads())
        tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (tokenizer.eos_token_id or 0)
        self.batch_size = batch_size
        self.decode_steps = 0
        self.decode_s = 0.0

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def start_run(self) -> None:
        """Zero the decode step count and time."""
        self.decode_steps, self.decode_s = 0, 0.0

    def run_phase(self, phase: list[Request], prompts: list[list[int]]) -> PhaseOutput:
        """The phase in batches of `batch_size` (default: the whole phase at once).

        A batch generates max(max_tokens) for every row (HF has no per-row length in one batch);
        only the requested tokens are counted as output.
        """
        from transformers import StoppingCriteria, StoppingCriteriaList

        stamps: list[float] = []

        class _Stamp(StoppingCriteria):
            """Never stops; records when each generation step ends."""

            def __call__(self, input_ids: torch.Tensor, scores: Any, **kw: Any) -> torch.Tensor:
                stamps.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        size = self.batch_size or len(phase)
        done = PhaseOutput(outputs=[], wall_s=0.0, prompt_tokens=0, output_tokens=0, bad_lengths=0)
        for lo in range(0, len(phase), size):
            chunk, reqs = prompts[lo : lo + size], phase[lo : lo + size]
            width = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, p in enumerate(chunk):
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            ids, mask = ids.to(self.device), mask.to(self.device)
            new = max(r.max_tokens for r in reqs)
            stamps.clear()
            self._sync()
            start = time.perf_counter()
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    do_sample=False,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    pad_token_id=self.pad_id,
                    stopping_criteria=StoppingCriteriaList([_Stamp()]),
                )
            self._sync()
            done.wall_s += time.perf_counter() - start
            if len(stamps) > 1:  # stamp 0 ends the prefill step
                self.decode_steps += len(stamps) - 1
                self.decode_s += stamps[-1] - stamps[0]
            gen = out[:, width:].tolist()
            for r, toks, p in zip(reqs, gen, chunk):
                done.bad_lengths += len(toks) != new
                done.outputs.append(toks[: r.max_tokens])
                done.prompt_tokens += len(p)
                done.output_tokens += r.max_tokens
        return done

    def finish_run(self, result: RunResult) -> None:
        """Every prompt token is computed (no prefix cache); the decode steps recorded."""
        result.prefill_computed = result.prompt_tokens
        result.decode_steps = self.decode_steps or None
        result.decode_s = self.decode_s or None

    def close(self) -> None:
        """Free the model."""
        del self.model
        gc.collect()
