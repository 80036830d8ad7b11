"""What quantization costs in quality, per weight format: top-1 next-token agreement with a
reference model at every position of a fixed text (teacher-forced), the mean KL divergence of
each position's distribution from minisgl bf16's (over the whole vocabulary, the text in one
prefill) and the text's perplexity.

The reference is HF transformers in float32 on the model's dense checkpoint (for the default
model: its Q4_1 GGUF dequantized by transformers, the same weight values the "gguf" format
keeps quantized) and, for formats quantized at load, also minisgl bf16 (their own starting
point). The text is prefilled whole (past 128 rows a weight-only format's weights are
dequantized: exact arithmetic; `int8` is W8A8 at every row count where the CPU has VNNI or
AMX-INT8) and in chunks of --chunks tokens (the row counts decode batches take: where the CPU
has VNNI, activations rounded to int8 per 32 columns but `int8-wo`'s). Figures only:

    python benchmark/quantized_quality.py                         # the default model
    python benchmark/quantized_quality.py --formats bf16,int8,int4,int4-g32,gguf
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import paths  # noqa: E402, F401  (before minisgl: a checkout without `pip install -e .`)
import torch  # noqa: E402
from models import resolve_bench_model  # noqa: E402

from minisgl.core import SamplingParams  # noqa: E402
from minisgl.engine.calibration import run_prefill  # noqa: E402
from minisgl.llm import LLM  # noqa: E402
from minisgl.utils.hf import default_gguf_path  # noqa: E402

# A fixed text of plain prose and code, ~600 tokens with the default tokenizer.
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden press adapted from "
    "wine making. Within fifty years printing shops had spread to more than two hundred "
    "cities across Europe, and the number of books in circulation grew from thousands to "
    "millions. Scholars could now compare identical copies of a text, which changed how "
    "knowledge was checked and shared. Religious reformers, merchants and scientists all "
    "used the new medium: pamphlets carried arguments quickly, price lists travelled between "
    "ports, and printed tables of numbers let astronomers build on each other's work.\n\n"
    "def merge_sorted(left, right):\n"
    '    """Merge two sorted lists into one sorted list."""\n'
    "    result = []\n"
    "    i = j = 0\n"
    "    while i < len(left) and j < len(right):\n"
    "        if left[i] <= right[j]:\n"
    "            result.append(left[i])\n"
    "            i += 1\n"
    "        else:\n"
    "            result.append(right[j])\n"
    "            j += 1\n"
    "    result.extend(left[i:])\n"
    "    result.extend(right[j:])\n"
    "    return result\n\n"
    "Photosynthesis converts light energy into chemical energy. In the chloroplasts of plant "
    "cells, chlorophyll absorbs mostly blue and red light, and the energy drives the "
    "splitting of water molecules. Oxygen is released as a by-product, while the hydrogen "
    "and the captured energy are used to turn carbon dioxide from the air into sugars. "
    "These sugars feed the plant and, through food chains, almost every other living thing. "
    "The overall reaction can be summarised as six molecules of carbon dioxide and six of "
    "water becoming one molecule of glucose and six molecules of oxygen."
)


def hf_reference(model: Path, ids: list[int]) -> tuple[list[int], float]:
    """HF float32's argmax at each position and the text's perplexity under it."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = hf(torch.tensor([ids])).logits[0, :-1].float()
    logprobs = logits.log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return logits.argmax(-1).tolist(), math.exp(-logprobs.mean().item())


def ours(
    path: Path, kwargs: dict, ids: list[int], chunk: int
) -> tuple[list[int], float, torch.Tensor | None]:
    """minisgl's top-1 at each position and the text's perplexity (teacher-forced), prefilled
    `chunk` tokens a step; for the whole text in one prefill also every position's
    log-probabilities over the vocabulary [positions, vocab] (else None)."""
    llm = LLM(
        str(path), dtype="bfloat16", num_page_override=2048, max_prefill_length=chunk, **kwargs
    )
    try:
        logprobs = None
        if chunk >= len(ids):  # the same prefill with its logits kept, before any request
            hidden = run_prefill(llm.engine.model, llm.engine.ctx, torch.tensor(ids))[:-1]
            with torch.inference_mode():
                rows = [llm.engine.model.logits(h).float() for h in hidden.split(64)]
            logprobs = torch.cat(rows).log_softmax(-1)
        params = SamplingParams(max_tokens=1, prompt_logprobs=1)
        out = llm.generate([ids], params, use_tqdm=False)[0]["prompt_logprobs"][1:]
    finally:
        llm.shutdown()
    top1 = [top[0][0] for _, _, top in out]
    nll = -sum(logprob for _, logprob, _ in out) / len(out)
    return top1, math.exp(nll), logprobs


def kl_divergence(ref: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over positions of KL(ref || other), each over the whole vocabulary."""
    return float((ref.exp() * (ref - other)).sum(-1).mean())


def agreement(a: list[int], b: list[int]) -> float:
    return sum(x == y for x, y in zip(a, b)) / len(a)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default, qwen3-0.6b-random, a folder")
    p.add_argument("--formats", default="bf16,int8,int4,int4-g32,gguf")
    p.add_argument("--chunks", default="16,64", help="chunk sizes, tokens per prefill step")
    args = p.parse_args()
    model = resolve_bench_model(args.model)
    gguf = default_gguf_path() if args.model in (None, "default") else None
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(model))(TEXT).input_ids
    ref_top1, ref_ppl = hf_reference(model, ids)
    print(f"# {model.name}: {len(ids)} tokens; HF float32 perplexity {ref_ppl:.3f}")
    chunks = [int(c) for c in args.chunks.split(",") if c]
    print(
        "| format | top-1 vs HF fp32 | top-1 vs minisgl bf16 | KL from minisgl bf16 | perplexity "
        "| vs HF fp32 |"
        + "".join(f" {c}-token chunks: top-1, perplexity vs HF fp32 |" for c in chunks)
    )
    print("|---|---|---|---|---|---|" + "---|" * len(chunks))
    bf16_top1 = bf16_logprobs = None
    for fmt in args.formats.split(","):
        if fmt == "gguf" and gguf is None:
            continue
        path = gguf if fmt == "gguf" else model
        kwargs = {} if fmt == "bf16" else {"quantization": fmt}
        top1, ppl, logprobs = ours(path, kwargs, ids, len(ids))
        chunked = [ours(path, kwargs, ids, c) for c in chunks]
        if fmt == "bf16":
            bf16_top1, bf16_logprobs = top1, logprobs
        vs_bf16 = "" if bf16_top1 is None else f"{agreement(bf16_top1, top1):.1%}"
        kl = ""
        if bf16_logprobs is not None and logprobs is not None:
            kl = f"{kl_divergence(bf16_logprobs, logprobs):.2e}"
        print(
            f"| {fmt} | {agreement(ref_top1, top1):.1%} | {vs_bf16} | {kl} | {ppl:.3f} | "
            f"{(ppl / ref_ppl - 1):+.1%} |"
            + "".join(
                f" {agreement(ref_top1, c_top1):.1%}, {(c_ppl / ref_ppl - 1):+.1%} |"
                for c_top1, c_ppl, _ in chunked
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
