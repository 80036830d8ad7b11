"""Cache hit rate and wall time of `fcfs` vs `lpm` on shuffled prefix groups.

Workload: G groups x R requests; each group shares a P-token prefix, each request adds a
Q-token suffix; the requests arrive shuffled, all at once. The running batch and the KV pool
are small enough that the order of admission decides what stays cached.
"""

from __future__ import annotations

import argparse
import random
import time

import paths  # noqa: F401  (before minisgl: a checkout without `pip install -e .`)

from minisgl.core import SamplingParams
from minisgl.llm import LLM


def shuffled_groups(
    groups: int, per_group: int, prefix: int, suffix: int, seed: int
) -> list[list[int]]:
    """`groups` x `per_group` prompts, a shared prefix per group, in a shuffled order."""
    rng = random.Random(seed)
    heads = [[rng.randrange(1000, 40000) for _ in range(prefix)] for _ in range(groups)]
    prompts = [
        head + [rng.randrange(1000, 40000) for _ in range(suffix)]
        for head in heads
        for _ in range(per_group)
    ]
    rng.shuffle(prompts)
    return prompts


def main() -> None:
    """Run the workload under each policy and print hit rate and wall time."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF folder (default: the default model)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=256)
    parser.add_argument("--suffix-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--max-running-req", type=int, default=8)
    parser.add_argument("--pool-tokens", type=int, default=2048, help="KV pool size in tokens")
    args = parser.parse_args()
    prompts = shuffled_groups(args.groups, args.per_group, args.prefix_len, args.suffix_len, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    print(f"{'policy':<6} {'hit rate':>9} {'wall s':>8}")
    for policy in ("fcfs", "lpm"):
        llm = LLM(
            args.model,
            dtype=args.dtype,
            schedule_policy=policy,
            max_running_req=args.max_running_req,
            num_page_override=args.pool_tokens,
            max_seq_len_override=args.prefix_len + args.suffix_len + args.output_len + 1,
        )
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        print(f"{policy:<6} {llm.stats.hit_rate:>9.1%} {wall:>8.2f}")
        llm.shutdown()


if __name__ == "__main__":
    main()
