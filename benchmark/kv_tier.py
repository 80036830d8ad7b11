"""The disk KV tier (--kv-cache-dir) across a server restart, and its cost on P3.

Restart, per model: a server with a fresh tier directory gets a ~4,096-token prompt (random
ids, greedy, 8 new tokens; time to first token streamed from /generate): cold, then again (a
radix hit: warm). The server is stopped (SIGTERM: it writes its cache to the tier) and started
again on the same directory, and the prompt sent once more: restored. Prints TTFT and cached
tokens of each, cold / restored, and whether the outputs are equal.

P3 cost: distinct 1,056-token prompts (benchmark/workloads.py, P3) offline on the naive cache
and on the radix cache with the tier on, taking turns (--repeat runs each; fresh ids per run,
a pool that holds one run, so later runs evict to disk): wall time, and the tier's cost over
naive. Figures only: nothing is asserted.

    python benchmark/kv_tier.py                                  # SmolLM2 and the Qwen3-0.6B shape
    python benchmark/kv_tier.py --models default --prompt-len 1024 --p3-prompts 4 --repeat 1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import machine_note, set_threads  # noqa: E402
from models import QWEN3_RANDOM, model_label, resolve_bench_model  # noqa: E402
from native_generate import greedy_generate_request  # noqa: E402
from processes import exit_on_sigterm  # noqa: E402
from runners.minisgl import MinisglRunner  # noqa: E402
from workloads import Distinct, TokenSource  # noqa: E402


def start_server(
    model: Path, port: int, tier_dir: Path, seq_len: int, dtype: str
) -> subprocess.Popen:
    """`python -m minisgl` on `model` with the tier in `tier_dir`; returns once healthy."""
    command = [sys.executable, "-m", "minisgl", "--model", str(model), "--port", str(port)]
    command += ["--dtype", dtype]
    command += ["--log-level", "warning", "--kv-cache-dir", str(tier_dir)]
    command += ["--max-seq-len", str(seq_len), "--num-pages", str(2 * seq_len)]
    server = subprocess.Popen(command, start_new_session=True)
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return server
        except OSError:
            if server.poll() is not None:
                raise SystemExit("the server exited") from None
            time.sleep(0.5)


def stop_server(server: subprocess.Popen) -> float:
    """SIGTERM (the scheduler writes its cache to the tier first); seconds until it exited."""
    start = time.perf_counter()
    os.killpg(server.pid, signal.SIGTERM)
    server.wait(timeout=600)
    return time.perf_counter() - start


def send(port: int, ids: list[int], max_tokens: int) -> tuple[float, int, str]:
    """(TTFT s, cached prompt tokens, text) of one streamed greedy /generate."""
    request = greedy_generate_request(port, max_tokens, input_ids=ids)
    start = time.perf_counter()
    first, last = None, {}
    with urllib.request.urlopen(request, timeout=1200) as response:
        for line in response:
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            first = first or time.perf_counter() - start
            last = json.loads(line[5:])
    assert first is not None, "no event streamed"
    return first, int(last["meta_info"]["cached_tokens"]), last["text"]


def restart_rows(model: Path, args: argparse.Namespace) -> list[list[str]]:
    """cold / warm / restored rows of one model."""
    tokens = TokenSource(model, args.seed)
    ids = tokens.draw(tokens.rng("tier"), args.prompt_len)
    warmup = tokens.draw(tokens.rng("tier-warmup"), 64)  # shares no prefix with `ids`
    seq_len = -(-(args.prompt_len + 64) // 512) * 512
    tier_dir = Path(tempfile.mkdtemp(prefix="minisgl-tier-"))
    runs: dict[str, tuple[float, int, str]] = {}
    try:
        server = start_server(model, args.port, tier_dir, seq_len, args.dtype)
        try:
            send(args.port, warmup, 2)
            runs["cold"] = send(args.port, ids, args.new_tokens)
            runs["warm"] = send(args.port, ids, args.new_tokens)
        finally:
            stop_s = stop_server(server)
        server = start_server(model, args.port, tier_dir, seq_len, args.dtype)
        try:
            send(args.port, warmup, 2)  # a new process's first request pays for its start
            runs["restored"] = send(args.port, ids, args.new_tokens)
        finally:
            stop_server(server)
        disk = sum(f.stat().st_size for f in tier_dir.rglob("*.kv"))
    finally:
        shutil.rmtree(tier_dir, ignore_errors=True)
    cold = runs["cold"][0]
    equal = runs["restored"][2] == runs["cold"][2] == runs["warm"][2]
    print(
        f"# {model_label(model)}: {args.prompt_len}-token prompt; shutdown wrote "
        f"{disk / 2**20:.0f} MiB in {stop_s:.1f} s; outputs equal: {'yes' if equal else 'NO'}"
    )
    return [
        [model_label(model), name, f"{t:.3f}", str(cached), f"{cold / t:.1f}x"]
        for name, (t, cached, _) in runs.items()
    ]


def p3_cost(model: Path, args: argparse.Namespace) -> None:
    """Wall time of P3 on naive vs radix + tier, taking turns."""
    workload = Distinct(prompts=args.p3_prompts)
    tokens = TokenSource(model, args.seed)
    kv_tokens = args.p3_prompts * (workload.length + workload.output) + 64
    tier_dir = Path(tempfile.mkdtemp(prefix="minisgl-tier-p3-"))
    configs = {
        "naive": dict(cache_type="naive"),
        "radix+tier": dict(cache_type="radix", kv_cache_dir=str(tier_dir)),
    }
    walls: dict[str, list[float]] = {name: [] for name in configs}
    runners = {}
    try:
        for name, kwargs in configs.items():
            runners[name] = MinisglRunner(
                model, args.dtype, name=name, max_seq_len=1100, kv_tokens=kv_tokens, **kwargs
            )
            warmup = workload.phases(tokens, "warmup")[0][: min(2, args.p3_prompts)]
            runners[name].run([warmup], "warmup")
        for r in range(args.repeat):
            order = list(runners.items()) if r % 2 == 0 else list(runners.items())[::-1]
            for name, runner in order:
                walls[name].append(runner.run(workload.phases(tokens, r), "P3").wall_s)
        tier = runners["radix+tier"].llm.cache_manager.tier
        written = tier.stats.chunks_written if tier is not None else 0
    finally:
        for runner in runners.values():
            runner.close()
        shutil.rmtree(tier_dir, ignore_errors=True)
    naive, tiered = statistics.median(walls["naive"]), statistics.median(walls["radix+tier"])
    print(
        f"\n# P3 ({args.p3_prompts} x {workload.length} tokens, {workload.output} new), "
        f"{model_label(model)}, {args.repeat} runs each (median); tier wrote {written} chunks"
    )
    print("| engine | wall s (runs) | vs naive |")
    print("|---|---|---|")
    for name, values in walls.items():
        runs = ", ".join(f"{v:.2f}" for v in values)
        print(f"| {name} | {statistics.median(values):.2f} ({runs}) | ", end="")
        print(f"{100 * (statistics.median(values) / naive - 1):+.1f}% |")
    print(f"tier cost over naive: {100 * (tiered / naive - 1):+.1f}% (target <= +3%)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=f"default,{QWEN3_RANDOM}", help="comma-separated")
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--p3-prompts", type=int, default=16, help="0: skip the P3 cost")
    p.add_argument("--repeat", type=int, default=3, help="P3 runs per engine")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=31750)
    args = p.parse_args()
    exit_on_sigterm()
    set_threads(args.threads)
    print(f"# machine: {machine_note()}")
    rows = []
    for name in args.models.split(","):
        rows += restart_rows(resolve_bench_model(name), args)
    print("| model | run | TTFT s | cached tokens | cold / this |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if args.p3_prompts > 0:
        p3_cost(resolve_bench_model(args.models.split(",")[0]), args)


if __name__ == "__main__":
    main()
