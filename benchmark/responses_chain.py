"""A conversation over the Responses API chained with previous_response_id: per turn the input
tokens, the tokens the radix cache served and the turn's latency, against the same turns with
the cache flushed before each (every turn prefills its whole conversation), in one run.

`python benchmark/responses_chain.py` (the default model, a ~1,500-token document as the
instructions, 5 turns of 32 tokens). Figures only.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import httpx
import openai
import paths  # noqa: F401  (before minisgl: a checkout without `pip install -e .`)
from models import model_label, resolve_bench_model
from paths import OUT_DIR
from serving_server import Server

QUESTIONS = [
    "Summarise the document in one sentence.",
    "Which commands does it name first?",
    "What does it say about the KV cache?",
    "Which endpoints are listed?",
    "What would you read next, and why?",
    "Name one limit it states.",
    "Which machines does it mention?",
]


def document(words: int) -> str:
    """The first `words` words of benchmark/data/document.md: real prose with code and tables."""
    text = (Path(__file__).resolve().parent / "data" / "document.md").read_text()
    return " ".join(text.split()[:words])


def run_chain(client: openai.OpenAI, server: Server, args: argparse.Namespace, cold: bool):
    """Per turn (input tokens, cached tokens, seconds, text)."""
    rows, previous = [], None
    instructions = f"Answer from this document.\n\n{document(args.document_words)}"
    for turn in range(args.turns):
        if cold:  # nothing cached: the turn prefills its whole conversation
            httpx.post(f"{server.url}/flush_cache", timeout=60).raise_for_status()
        start = time.perf_counter()
        response = client.responses.create(
            model=client.models.list().data[0].id,
            instructions=instructions,
            input=QUESTIONS[turn % len(QUESTIONS)],
            previous_response_id=previous,
            max_output_tokens=args.output_tokens,
            temperature=0.0,
        )
        seconds = time.perf_counter() - start
        usage = response.usage
        cached = usage.input_tokens_details.cached_tokens
        rows.append((usage.input_tokens, cached, seconds, response.output_text))
        previous = response.id
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the default model")
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--document-words", type=int, default=1000)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--server-args", default="")
    p.add_argument("--out", type=Path, default=OUT_DIR, help="where the server's log goes")
    args = p.parse_args()
    model = resolve_bench_model(args.model)
    sizing = argparse.Namespace(
        input_len=4096,
        output_len=args.output_tokens * args.turns,
        num_prompts=1,
        max_concurrency=1,
        warmup_requests=0,
        dtype=args.dtype,
        server_args=args.server_args,
        out=args.out,
    )
    server = Server.start(model, sizing)
    try:
        server.wait_healthy(600)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        run_chain(client, server, args, cold=False)  # warm-up: load, compile, first pages
        httpx.post(f"{server.url}/flush_cache", timeout=60).raise_for_status()
        chained = run_chain(client, server, args, cold=False)
        cold = run_chain(client, server, args, cold=True)
    finally:
        server.stop()
    print(f"# {model_label(model)}, {args.turns} turns of {args.output_tokens} tokens")
    print("| turn | input tokens | cached (chained) | chained s | cold s | cold / chained |")
    print("|---|---|---|---|---|---|")
    for turn, (warm, flushed) in enumerate(zip(chained, cold)):
        print(
            f"| {turn + 1} | {warm[0]} | {warm[1]} | {warm[2]:.2f} | {flushed[2]:.2f} "
            f"| {flushed[2] / warm[2]:.2f}x |"
        )
    total_warm, total_cold = sum(r[2] for r in chained), sum(r[2] for r in cold)
    print(f"| all | | | {total_warm:.2f} | {total_cold:.2f} | {total_cold / total_warm:.2f}x |")
    same = sum(w[3] == c[3] for w, c in zip(chained, cold))
    print(f"# texts equal chained vs cold: {same}/{len(chained)}")


if __name__ == "__main__":
    main()
