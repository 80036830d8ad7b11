"""Request priority under memory pressure, through the server (`--schedule-policy priority`):
the time to first token of high-priority requests alone (quiet), and again while low-priority
requests fill the KV pool past its size, next to the low-priority ones' own. High priority goes
first in the queue and low priority is retracted first, so the high TTFT should stay near the
quiet figure while the low ones wait. One invocation, figures only:

    python benchmark/priority.py                      # default model (its folder), 2,048-token pool
    python benchmark/priority.py --low 32 --high 8 --num-pages 1536
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import resolve_bench_model  # noqa: E402
from native_generate import greedy_generate_request  # noqa: E402


def ttft(port: int, prompt: str, max_tokens: int, priority: int) -> float:
    """Seconds from sending a streamed /generate to its first event."""
    request = greedy_generate_request(port, max_tokens, text=prompt, priority=priority)
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        first = None
        for line in response:
            if first is None and line.startswith(b"data:"):
                first = time.perf_counter() - start
        assert first is not None, "no event streamed"
        return first


def concurrent_ttfts(port: int, jobs: list[tuple[str, int, int]]) -> list[float]:
    """TTFT of each (prompt, max_tokens, priority), all sent at once."""
    out = [0.0] * len(jobs)

    def run(i: int) -> None:
        out[i] = ttft(port, *jobs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return out


def prompt(i: int, words: int) -> str:
    return f"Request {i}: " + " ".join(f"word{(i * 7 + j) % 997}" for j in range(words))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default (SmolLM2 folder), or a folder")
    p.add_argument("--num-pages", type=int, default=2048, help="the KV pool (pages of 1 token)")
    p.add_argument("--low", type=int, default=24, help="low-priority requests (long outputs)")
    p.add_argument("--high", type=int, default=6, help="high-priority requests")
    p.add_argument("--prompt-words", type=int, default=60)
    p.add_argument("--low-tokens", type=int, default=96)
    p.add_argument("--high-tokens", type=int, default=16)
    p.add_argument("--port", type=int, default=31700)
    args = p.parse_args()
    command = [sys.executable, "-m", "minisgl", "--port", str(args.port), "--log-level", "warning"]
    command += ["--model", str(resolve_bench_model(args.model)), "--num-pages", str(args.num_pages)]
    command += ["--schedule-policy", "priority"]
    server = subprocess.Popen(command, start_new_session=True)
    try:
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None:
                    raise SystemExit("the server exited") from None
                time.sleep(1)
        ttft(args.port, prompt(-1, args.prompt_words), 2, 0)  # warm-up
        quiet = [
            ttft(args.port, prompt(1000 + i, args.prompt_words), args.high_tokens, 1)
            for i in range(4)
        ]
        low_jobs = [(prompt(i, args.prompt_words), args.low_tokens, 0) for i in range(args.low)]
        high_jobs = [
            (prompt(5000 + i, args.prompt_words), args.high_tokens, 1) for i in range(args.high)
        ]
        low_out: list[float] = []
        flood = threading.Thread(
            target=lambda: low_out.extend(concurrent_ttfts(args.port, low_jobs))
        )
        flood.start()
        time.sleep(1.0)  # the pool is full of low-priority requests by now
        high = concurrent_ttfts(args.port, high_jobs)
        flood.join()
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    pool_need = args.low * (args.prompt_words * 2 + args.low_tokens)
    print(
        f"# {args.low} low-priority x {args.low_tokens} tokens (~{pool_need} KV tokens) and "
        f"{args.high} high-priority x {args.high_tokens} on a {args.num_pages}-token pool"
    )
    print("| requests | TTFT median s | TTFT max s | vs quiet high |")
    print("|---|---|---|---|")
    base = statistics.median(quiet)
    for name, values in (("high, quiet", quiet), ("high, under pressure", high), ("low", low_out)):
        median = statistics.median(values)
        print(f"| {name} | {median:.3f} | {max(values):.3f} | {median / base:.2f}x |")


if __name__ == "__main__":
    main()
