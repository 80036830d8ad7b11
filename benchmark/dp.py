"""Data parallelism behind sglang-router: the prefix hit rate and wall time of P1-like traffic
(several system prompts, each followed by many different questions, sent by concurrent
clients in random order) through `python -m minisgl --dp 2`, per routing policy, one
invocation. Cache-aware routing keeps a system prompt on the replica that cached it;
round-robin spreads it over both, each computing it again.

    python benchmark/dp.py                                   # cache_aware vs round_robin
    python benchmark/dp.py --systems 8 --questions 16 --dp 2

Needs scripts/setup_sglang_router.sh. Figures only. On a 2-core machine each replica has one
core: the wall time shows what routing saves, not a speed-up over one server.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import resolve_bench_model  # noqa: E402

WORDS = (
    "system policy answer question detail reason careful short example table list item "
    "step result value price city train museum code test error line chemistry reaction"
).split()


def system_prompt(rng: random.Random, words: int) -> str:
    return "You are assistant " + " ".join(rng.choice(WORDS) for _ in range(words)) + ".\n"


def post(port: int, prompt: str, max_tokens: int) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def wait_ready(port: int, proc: subprocess.Popen) -> None:
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                if json.loads(r.read())["data"]:
                    return
        except OSError:
            pass
        if proc.poll() is not None:
            raise SystemExit("the --dp launcher exited")
        time.sleep(1)


def run_policy(policy: str, args: argparse.Namespace, prompts: list[str]) -> tuple[float, float]:
    """(hit rate, wall seconds) of the prompts through --dp replicas with this policy."""
    port = args.port
    command = [sys.executable, "-m", "minisgl", "--dp", str(args.dp), "--port", str(port)]
    command += ["--router-policy", policy, "--served-model-name", "m", "--log-level", "warning"]
    command += ["--model", str(resolve_bench_model(args.model))]
    proc = subprocess.Popen(command, start_new_session=True)
    try:
        wait_ready(port, proc)
        start = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            outs = list(pool.map(lambda p: post(port, p, args.output_len), prompts))
        wall = time.perf_counter() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
    cached = sum(o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in outs)
    return cached / sum(o["usage"]["prompt_tokens"] for o in outs), wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default (SmolLM2 folder), or a folder")
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--policies", default="cache_aware,round_robin")
    p.add_argument("--systems", type=int, default=4, help="distinct system prompts")
    p.add_argument("--system-words", type=int, default=300)
    p.add_argument("--questions", type=int, default=12, help="questions per system prompt")
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--port", type=int, default=31800)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    systems = [system_prompt(rng, args.system_words) for _ in range(args.systems)]
    prompts = [
        f"{system}Question {q}: {' '.join(rng.choice(WORDS) for _ in range(12))}?"
        for system in systems
        for q in range(args.questions)
    ]
    rng.shuffle(prompts)
    print(
        f"# --dp {args.dp}: {args.systems} system prompts x {args.questions} questions, "
        f"{args.concurrency} concurrent clients, {args.output_len} tokens each"
    )
    print("| policy | hit rate (cached / prompt tokens) | wall s |")
    print("|---|---|---|")
    for policy in args.policies.split(","):
        hit_rate, wall = run_policy(policy, args, prompts)
        print(f"| {policy} | {hit_rate:.2f} | {wall:.2f} |", flush=True)


if __name__ == "__main__":
    main()
