"""The parallelism options of the CLI: data parallelism behind a router, tensor parallelism
within and across machines (SGLang's names)."""

from __future__ import annotations

import argparse

from .arg_types import positive_int


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("parallelism")
    group.add_argument(
        "--dp",
        "--dp-size",
        dest="dp_size",
        type=positive_int,
        default=1,
        metavar="N",
        help="N replicas, each on its share of the cores and its own port (--port + 1..N), "
        "behind sglang-router on --port (scripts/setup_sglang_router.sh installs it)",
    )
    group.add_argument(
        "--tp",
        "--tp-size",
        dest="tp_size",
        type=positive_int,
        default=1,
        metavar="N",
        help="tensor parallelism: the scheduler process is rank 0 and starts N-1 more ranks, "
        "each holding a shard of the weights and KV heads (gloo on CPU, NCCL on CUDA)",
    )
    group.add_argument(
        "--nnodes",
        type=positive_int,
        default=1,
        metavar="N",
        help="machines the --tp ranks split over (equally); node 0 serves, the others only run "
        "their ranks; needs --dist-init-addr and --num-pages on every node",
    )
    group.add_argument("--node-rank", type=int, default=0, metavar="I", help="this machine's index")
    group.add_argument(
        "--dist-init-addr",
        default=None,
        metavar="HOST:PORT",
        help="where the ranks of every node meet (a free port of node 0)",
    )
    group.add_argument(
        "--router-policy",
        default="cache_aware",
        choices=["cache_aware", "round_robin", "random", "power_of_two"],
        help="how the router picks a replica with --dp (cache_aware: the one whose radix cache "
        "likely holds the prompt's prefix, balanced against load)",
    )
