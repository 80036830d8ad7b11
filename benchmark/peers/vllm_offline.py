"""Run benchmark workloads through vLLM's CPU backend, inside the `.peers/vllm` venv.

Started by `benchmark/runners/vllm.py:run_vllm_peer` as
`.peers/vllm/bin/python benchmark/peers/vllm_offline.py SPEC.json RESULT.json`
with PEERS.md's environment (LD_PRELOAD of tcmalloc + libiomp5, VLLM_CPU_KVCACHE_SPACE,
VLLM_CPU_OMP_THREADS_BIND). Standalone: needs only the standard library and vllm.

SPEC.json: {"model", "dtype", "max_model_len", "enable_prefix_caching", "block_size",
"speculative_config" (vLLM's, or null), "warmup": PHASES, "runs": [{"name", "repeat",
"phases": PHASES}]}, where PHASES is a list of phases, each a list of {"ids", "max_tokens",
"base"}: a request's prompt is the prompt and generated tokens of request `base` of the
previous phase (when not null) followed by `ids`.
Each phase is submitted at once; its wall time is the `generate` call. RESULT.json gets the
per-run wall time and token counts.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def run_phases(llm: Any, phases: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Run the phases in order and return wall time and token counts."""
    from vllm import SamplingParams

    prompts: list[list[int]] = []
    outputs: list[list[int]] = []
    wall = 0.0
    prompt_tokens = output_tokens = bad = 0
    cached: int | None = 0
    for phase in phases:
        prompts = [
            ([] if r["base"] is None else prompts[r["base"]] + outputs[r["base"]]) + r["ids"]
            for r in phase
        ]
        params = [
            SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True)
            for r in phase
        ]
        inputs = [{"prompt_token_ids": p} for p in prompts]
        start = time.perf_counter()
        results = llm.generate(inputs, params, use_tqdm=False)
        wall += time.perf_counter() - start
        outputs = [list(res.outputs[0].token_ids) for res in results]
        prompt_tokens += sum(len(p) for p in prompts)
        output_tokens += sum(len(o) for o in outputs)
        bad += sum(len(o) != r["max_tokens"] for o, r in zip(outputs, phase))
        for res in results:
            hit = getattr(res, "num_cached_tokens", None)
            cached = None if hit is None or cached is None else cached + hit
    return dict(
        wall_s=wall,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        cached_tokens=cached,
        bad_lengths=bad,
    )


def main(spec_path: str, result_path: str) -> None:
    """Start vLLM once, warm it up, run every run of the spec and write the results."""
    import vllm

    with open(spec_path) as f:
        spec = json.load(f)
    kwargs: dict[str, Any] = dict(
        model=spec["model"],
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
        enable_prefix_caching=spec["enable_prefix_caching"],
    )
    if spec.get("block_size"):
        kwargs["block_size"] = spec["block_size"]
    if spec.get("speculative_config"):
        kwargs["speculative_config"] = spec["speculative_config"]
    start = time.perf_counter()
    llm = vllm.LLM(**kwargs)
    startup = time.perf_counter() - start
    if spec["warmup"]:
        run_phases(llm, spec["warmup"])
    runs = []
    for run in spec["runs"]:
        result = run_phases(llm, run["phases"])
        result.update(name=run["name"], repeat=run["repeat"])
        print(f"{run['name']} #{run['repeat']}: {result['wall_s']:.2f} s", flush=True)
        runs.append(result)
    with open(result_path, "w") as f:
        json.dump(dict(vllm_version=vllm.__version__, startup_s=startup, runs=runs), f)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
