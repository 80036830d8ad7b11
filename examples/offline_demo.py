"""Offline generation on the default model: prints each prompt and its completion."""

from __future__ import annotations

import argparse

from minisgl.core import SamplingParams
from minisgl.llm import LLM

PROMPTS = [
    "The capital of France is",
    "The three primary colors are",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF folder, .gguf file or hub id")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("prompts", nargs="*", help="prompts (default: a few examples)")
    args = parser.parse_args()
    llm = LLM(args.model, dtype=args.dtype)
    prompts = args.prompts or PROMPTS
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    for prompt, out in zip(prompts, outputs):
        print(f"--- prompt: {prompt!r}\n    completion: {out['text']!r}")
    llm.shutdown()


if __name__ == "__main__":
    main()
