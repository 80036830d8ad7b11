"""Radix eviction policies on a skewed prefix workload: hit rate and wall time per policy.

Workload (random token ids, never special tokens, the same for every policy): --prefixes shared
prefixes of --prefix-len tokens, each request one of them picked with Zipf popularity
(P(rank k) ~ 1 / k^--zipf) plus a fresh --suffix-len-token suffix, --max-tokens new tokens
(greedy, EOS ignored). Requests arrive in waves of --wave (one `generate` call each), so the
cache evolves along the stream. The KV pool holds --pool-fraction of the distinct prefix tokens
(default a third) plus one wave's suffixes and outputs, so prefixes must be evicted. For the
`priority` policy the requests of the two most popular prefixes carry priority 1 (a premium
tenant), all others 0; the other policies ignore it.

Per policy it prints the hit rate (prompt tokens served from the cache / prompt tokens) and the
wall time of the whole stream (engine load and one warm-up request excluded). Figures only:
nothing is asserted.

    python benchmark/eviction.py                          # every policy, default model
    python benchmark/eviction.py --policies lru,lfu --requests 400 --zipf 1.2
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
from cli import base_parser
from machine import machine_note, set_threads
from models import model_label, resolve_bench_model
from workloads import TokenSource

from minisgl.core import SamplingParams
from minisgl.kvcache import EVICTION_POLICIES
from minisgl.llm import LLM


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see --help)."""
    p = base_parser(__doc__)
    p.add_argument("--policies", default=",".join(EVICTION_POLICIES.names()))
    p.add_argument("--requests", type=int, default=128, help="requests in the stream")
    p.add_argument("--prefixes", type=int, default=12, help="distinct shared prefixes")
    p.add_argument("--prefix-len", type=int, default=128, help="tokens per shared prefix")
    p.add_argument("--suffix-len", type=int, default=16, help="fresh tokens per request")
    p.add_argument("--max-tokens", type=int, default=2, help="new tokens per request")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of prefix popularity")
    p.add_argument("--pool-fraction", type=float, default=1 / 3, help="pool / prefix tokens")
    p.add_argument("--wave", type=int, default=2, help="requests per generate call")
    p.add_argument("--seed", type=int, default=0, help="seed of the token ids and the stream")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    args = p.parse_args(argv)
    unknown = set(args.policies.split(",")) - set(EVICTION_POLICIES.names())
    if unknown:
        p.error(f"unknown policies {sorted(unknown)}; choose from {EVICTION_POLICIES.names()}")
    return args


def make_stream(args: argparse.Namespace, model: Path) -> list[tuple[list[int], int]]:
    """(prompt, priority) per request, in arrival order."""
    tokens = TokenSource(model, args.seed)
    prefixes = [tokens.draw(tokens.rng("prefix", i), args.prefix_len) for i in range(args.prefixes)]
    popularity = 1.0 / np.arange(1, args.prefixes + 1) ** args.zipf
    rng = tokens.rng("stream")
    ranks = rng.choice(args.prefixes, size=args.requests, p=popularity / popularity.sum())
    return [(prefixes[k] + tokens.draw(rng, args.suffix_len), int(k < 2)) for k in ranks.tolist()]


def run_policy(
    policy: str, args: argparse.Namespace, model: Path, stream: list[tuple[list[int], int]]
) -> dict[str, Any]:
    """Load an engine with `policy`, warm it up, run the stream; its figures."""
    request_len = args.suffix_len + args.max_tokens
    pool = int(args.pool_fraction * args.prefixes * args.prefix_len) + args.wave * request_len
    llm = LLM(
        str(model),
        dtype=args.dtype,
        num_page_override=pool,
        max_running_req=args.wave,
        radix_eviction_policy=policy,
    )
    llm.generate([stream[0][0][-8:]], SamplingParams(max_tokens=1))  # warm-up, barely cached
    llm.cache_manager.flush()
    prompt_tokens = cached_tokens = 0
    start = time.perf_counter()
    for i in range(0, len(stream), args.wave):
        wave = stream[i : i + args.wave]
        params = [
            SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, priority=p) for _, p in wave
        ]
        for out in llm.generate([prompt for prompt, _ in wave], params):
            prompt_tokens += out["prompt_tokens"]
            cached_tokens += out["cached_tokens"]
    wall = time.perf_counter() - start
    llm.shutdown()
    return dict(
        policy=policy, hit_rate=cached_tokens / prompt_tokens, wall_s=wall, pool_tokens=pool
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    threads = set_threads(args.threads)
    model = resolve_bench_model(args.model)
    stream = make_stream(args, model)
    print(
        f"# {model_label(model)}, {args.dtype}, {threads} threads; {args.requests} requests over "
        f"{args.prefixes} prefixes x {args.prefix_len} tokens (Zipf {args.zipf}) + "
        f"{args.suffix_len}-token suffixes, {args.max_tokens} new tokens, waves of {args.wave}",
        flush=True,
    )
    print(f"# {machine_note()}", flush=True)
    results = []
    for policy in args.policies.split(","):
        results.append(run_policy(policy, args, model, stream))
        r = results[-1]
        print(
            f"  {policy:<9} hit rate {100 * r['hit_rate']:5.1f}%  {r['wall_s']:6.2f} s", flush=True
        )
    print(f"\nKV pool: {results[0]['pool_tokens']} tokens\n")
    print("| policy | hit rate | wall s |")
    print("|---|---:|---:|")
    for r in results:
        print(f"| {r['policy']} | {100 * r['hit_rate']:.1f}% | {r['wall_s']:.2f} |")


if __name__ == "__main__":
    main()
