"""Online serving: streaming latency (TTFT, TPOT, ITL) and throughput of the OpenAI server.

Workload: --num-prompts requests of --input-len random token ids (never special tokens), each
sent to `POST /v1/completions` as a list of token ids with `max_tokens=--output-len`,
`ignore_eos`, `temperature=0` and `stream=true`, so every request streams exactly
--output-len tokens. Arrivals are Poisson at --request-rate req/s (`inf`: all at once);
--max-concurrency C caps the requests in flight, so `--max-concurrency C` alone is a closed loop
with C streams busy at all times. A short untimed warm-up (fresh ids, 4 tokens each) comes first.

The benchmark starts `python -m minisgl` itself on a free port (its KV pool and context sized
to the workload; --server-args adds flags) and always stops it, or it uses a running server
(--url). Per request it records TTFT (send to the first streamed text), TPOT ((e2e - TTFT) /
(output tokens - 1)), ITL (every gap between streamed text chunks; a chunk that carries k
tokens counts as k gaps of 1/k each) and e2e latency; it prints p50/p90/p99, request and token
throughput as a Markdown table and writes a PNG of the latency CDFs and a JSON under
benchmark/out/. --rounds R repeats the timed run R times against the same server (fresh
prompts each time; the tables pool them). With --compare-offline (3 rounds unless --rounds) it
measures the decode step time of the offline `LLM` at batch size --max-concurrency on the same
shapes before the server starts, between rounds (the server idle beside it) and after it
stops. The machine's speed drifts over minutes, so each round's TPOT p50 is divided by the
offline step measured just before and after it (the median over both, the faster middle run
for an even count, so drift never flatters the server), and the median of those ratios is
printed (issue 6, acceptance 4). Figures only: nothing is asserted.

With --contention N the --rounds quiet rounds are followed by as many rounds (fresh prompts)
with N busy-loop processes spinning on the last N CPUs of this process's affinity set
(benchmark/contention.py); the loops run during those rounds only (the server's start-up and
the warm-up are quiet). It prints their latency table too and a table of TTFT, TPOT, ITL, E2E
and throughput quiet against contended, with the ratio; the JSON holds both.

    python benchmark/serving.py --quick                      # smoke test, < 1 minute
    python benchmark/serving.py --max-concurrency 8 --num-prompts 32 --compare-offline
    python benchmark/serving.py --request-rate 4             # Poisson arrivals, 4 req/s
    python benchmark/serving.py --url http://127.0.0.1:1919  # a server that is running
    python benchmark/serving.py --max-concurrency 8 --num-prompts 32 --contention 1
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cli import base_parser  # noqa: E402
from contention import BusyLoops, add_contention_option, check_contention  # noqa: E402
from machine import machine_note  # noqa: E402
from models import model_label, resolve_bench_model  # noqa: E402
from paths import OUT_DIR  # noqa: E402
from processes import exit_on_sigterm  # noqa: E402
from report import log, save_json, stamp  # noqa: E402
from serving_client import (  # noqa: E402
    WARMUP_TOKENS,
    RequestResult,
    arrival_offsets,
    run_async,
    run_load,
    served_model,
)
from serving_metrics import summarize  # noqa: E402
from serving_offline import OfflineStep, offline_batch, offline_decode_step  # noqa: E402
from serving_report import (  # noqa: E402
    contended_json,
    contention_table,
    describe_summary,
    latency_table,
    plot_cdfs,
    print_offline_comparison,
    summary_json,
)
from serving_server import Server  # noqa: E402
from workloads import TokenSource  # noqa: E402


def parse_rate(text: str) -> float:
    """Requests per second: a positive number or `inf`."""
    rate = float(text)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"bad request rate {text!r}: want > 0 or inf")
    return rate


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see --help), with --quick's and the dependent defaults filled in."""
    p = base_parser(__doc__)
    p.add_argument(
        "--url",
        default=None,
        help="benchmark this running server (e.g. http://127.0.0.1:1919) instead of starting one",
    )
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument(
        "--server-args",
        default="",
        help="extra flags for the server this script starts: --server-args='--page-size 16'",
    )
    p.add_argument("--num-prompts", type=int, default=None, help="requests (default 64)")
    p.add_argument("--input-len", type=int, default=None, help="prompt tokens (default 128)")
    p.add_argument("--output-len", type=int, default=None, help="new tokens (default 64)")
    p.add_argument(
        "--request-rate",
        type=parse_rate,
        default=math.inf,
        help="Poisson arrival rate in requests/s; inf (default) sends all at once",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        metavar="C",
        help="at most C requests in flight (with the default rate: a closed loop of C streams)",
    )
    p.add_argument(
        "--warmup-requests",
        type=int,
        default=None,
        help=f"untimed requests of {WARMUP_TOKENS} tokens first (default: the concurrency, <= 8)",
    )
    p.add_argument(
        "--compare-offline",
        action="store_true",
        help="then measure the offline LLM's decode step at batch --max-concurrency; print ratio",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="timed runs against the same server (default 1; 3 with --compare-offline, which "
        "then measures the offline step before, between and after them)",
    )
    p.add_argument("--repeat", type=int, default=3, help="offline decode runs (median)")
    p.add_argument("--seed", type=int, default=0, help="seed of the token ids and arrivals")
    p.add_argument(
        "--startup-timeout", type=float, default=600.0, help="seconds to wait for /health"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 8 requests of 32 tokens, 16 new tokens each, < 1 minute",
    )
    p.add_argument("--out", type=Path, default=OUT_DIR, help="where the PNG, JSON and log go")
    add_contention_option(p, "run the --rounds timed rounds")
    args = p.parse_args(argv)
    check_contention(p, args.contention)
    if args.contention and args.compare_offline:
        p.error("--contention and --compare-offline: run them separately")
    # --quick only changes what the user did not set.
    quick = (8, 32, 16) if args.quick else (64, 128, 64)
    for name, default in zip(("num_prompts", "input_len", "output_len"), quick):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.quick and args.repeat == 3:
        args.repeat = 1
    if args.rounds is None:
        args.rounds = 3 if args.compare_offline and not args.quick else 1
    if min(args.num_prompts, args.input_len, args.repeat, args.rounds) < 1 or args.output_len < 2:
        p.error("--num-prompts, --input-len, --repeat and --rounds must be >= 1, --output-len >= 2")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be >= 1")
    if args.compare_offline and offline_batch(args) is None:
        p.error("--compare-offline needs --max-concurrency (or the default rate, inf)")
    return args


def describe_load(args: argparse.Namespace) -> str:
    """Requests, their lengths, arrivals and concurrency cap, in one line."""
    rate = "all at once" if math.isinf(args.request_rate) else f"Poisson {args.request_rate} req/s"
    cap = "" if args.max_concurrency is None else f", <= {args.max_concurrency} in flight"
    return (
        f"{args.num_prompts} requests x {args.input_len} prompt tokens -> "
        f"{args.output_len} new tokens, {rate}{cap}"
    )


def warm_up(
    url: str,
    model_name: str,
    tokens: TokenSource,
    args: argparse.Namespace,
    headers: dict[str, str],
) -> None:
    """A few untimed short requests (fresh ids), so the timed runs see a warm server."""
    warmup_n = args.warmup_requests
    if warmup_n is None:
        warmup_n = min(8, args.max_concurrency or args.num_prompts)
    if not warmup_n:
        return
    rng = tokens.rng("serving-warmup")
    prompts = [tokens.draw(rng, args.input_len) for _ in range(warmup_n)]
    log(f"warm-up: {warmup_n} requests of {WARMUP_TOKENS} tokens")
    warm, _ = run_async(
        run_load(url, model_name, prompts, WARMUP_TOKENS, [0.0] * warmup_n, None, headers)
    )
    bad = [r.error for r in warm if not r.ok]
    if bad:
        raise RuntimeError(f"warm-up failed ({len(bad)} of {warmup_n}): {bad[0]}")


def timed_run(
    url: str,
    model_name: str,
    tokens: TokenSource,
    args: argparse.Namespace,
    headers: dict[str, str],
    round_index: int,
    contended: bool = False,
) -> tuple[list[RequestResult], float]:
    """One timed run of the load (fresh prompts each round, contended or not); (results, wall s)."""
    stream: tuple[int | str, ...] = () if round_index == 0 else (round_index,)
    if contended:
        stream = ("contended", round_index)
    rng = tokens.rng("serving", args.num_prompts, args.input_len, *stream)
    prompts = [tokens.draw(rng, args.input_len) for _ in range(args.num_prompts)]
    offsets = arrival_offsets(args.num_prompts, args.request_rate, tokens.rng("arrivals", *stream))
    label = "contended run" if contended else "timed run"
    if args.rounds > 1:
        label += f" {round_index + 1}/{args.rounds}"
    log(f"{label}: {describe_load(args)}")
    results, wall = run_async(
        run_load(url, model_name, prompts, args.output_len, offsets, args.max_concurrency, headers)
    )
    log(f"{label}: {wall:.2f} s")
    return results, wall


def main(argv: list[str] | None = None) -> None:
    """Start (or find) the server, run the load, print the tables, write the PNG and JSON."""
    args = parse_args(argv)
    exit_on_sigterm()  # SIGTERM unwinds like Ctrl-C, so `finally` stops the server
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # Against a running server, its own folder (from /v1/models) is the model, unless --model.
    model = resolve_bench_model(args.model) if args.url is None or args.model else None
    server: Server | None = None
    batch = offline_batch(args)
    # Offline decode steps by position: i is measured just before round i (0-based), so round
    # k is compared with measurements k and k + 1, taken seconds before and after it.
    offline_at: dict[int, OfflineStep] = {}

    def measure_offline(position: int, when: str) -> None:
        assert model is not None and batch is not None  # parse_args checked
        log(f"offline: decode step of minisgl.llm.LLM at batch {batch}, {when}")
        offline_at[position] = offline_decode_step(
            model, TokenSource(model, args.seed), args, batch
        )

    if args.compare_offline and args.url is None:
        measure_offline(0, "before the server")
    runs: list[tuple[list[RequestResult], float]] = []
    contended_runs: list[tuple[list[RequestResult], float]] = []
    try:
        if args.url is None:
            assert model is not None
            server = Server.start(model, args)
            log("server: waiting for /health")
            server.wait_healthy(args.startup_timeout)
            url = server.url
        else:
            url = args.url.rstrip("/")
        model_name, root = served_model(url, headers)
        if model is None:
            if root is None or not Path(root).exists():
                sys.exit("the server does not name a local model folder: pass --model")
            model = Path(root)
        tokens = TokenSource(model, args.seed)
        print(f"# serving benchmark: {model_label(model)} ({model}), {args.dtype}")
        print(f"# machine: {machine_note()}")
        print(f"# server: {url}" + (" (started here)" if server else " (running already)"))
        print(
            f"# load: {describe_load(args)}"
            + (f", {args.rounds} rounds" if args.rounds > 1 else "")
        )
        warm_up(url, model_name, tokens, args, headers)
        for k in range(args.rounds):
            runs.append(timed_run(url, model_name, tokens, args, headers, k))
            if args.compare_offline and k + 1 < args.rounds:
                # The machine's speed drifts over minutes: each round gets its own neighbours.
                measure_offline(k + 1, "between rounds (the server idles)")
        if args.contention:
            with BusyLoops(args.contention) as busy:
                log(f"contention: {busy.describe()}")
                for k in range(args.rounds):
                    contended_runs.append(
                        timed_run(url, model_name, tokens, args, headers, k, contended=True)
                    )
    except (RuntimeError, httpx.HTTPError) as exc:  # the server failed: say why, no traceback
        sys.exit(f"error: {exc}")
    finally:
        if server is not None:
            server.stop()
    if args.compare_offline:
        if args.url is not None:
            log("note: the running server shares the cores with the offline engine")
        measure_offline(args.rounds, "after the server" if server else "after the runs")

    # Token counting needs the tokenizer; done now that the runs are over.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    summaries = [summarize(results, wall, tokenizer) for results, wall in runs]
    all_results = [r for results, _ in runs for r in results]
    summary = summarize(all_results, sum(wall for _, wall in runs), tokenizer)
    print(latency_table(summary))
    print(describe_summary(summary))
    busy_results = [r for results, _ in contended_runs for r in results]
    busy_summary = None
    if contended_runs:
        busy_summary = summarize(busy_results, sum(wall for _, wall in contended_runs), tokenizer)
        print(f"\n## contended: {BusyLoops(args.contention).describe()}")
        print(latency_table(busy_summary))
        print(describe_summary(busy_summary))
        print(contention_table(summary, busy_summary, args.contention))

    offline: OfflineStep | None = None
    ratio: float | None = None
    if offline_at:
        assert batch is not None
        offline, ratio = print_offline_comparison(summaries, offline_at, batch, args.rounds)

    png = args.out / f"serving-{model_label(model)}-{stamp()}.png"
    title = f"{model_label(model)} {args.dtype}: {describe_load(args)}"
    if plot_cdfs(png, title, summary, offline):
        print(f"plot: {png}")
    save_json(
        png.with_suffix(".json"),
        {
            "args": {k: str(v) for k, v in vars(args).items()},
            "summary": summary_json(summary),
            "rounds_tpot_p50_ms": [s.stat("TPOT", 50) for s in summaries],
            "offline": None if offline is None else asdict(offline),
            "offline_by_position": {str(i): asdict(step) for i, step in offline_at.items()},
            "tpot_p50_over_step": ratio,
            "requests": [asdict(r) for r in all_results],
            # The rounds with busy loops spinning on `cpus` (None without --contention).
            "contended": None
            if busy_summary is None
            else contended_json(
                args.contention,
                busy_summary,
                [summarize(results, wall, tokenizer) for results, wall in contended_runs],
                busy_results,
            ),
        },
    )


if __name__ == "__main__":
    main()
