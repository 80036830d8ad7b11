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
import asyncio
import json
import math
import shlex
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Coroutine
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    OUT_DIR,
    MinisglRunner,
    TokenSource,
    base_parser,
    exit_on_sigterm,
    format_table,
    machine_note,
    median_run,
    model_label,
    pyplot_or_none,
    resolve_bench_model,
    save_json,
    single_phase,
    stamp,
    stop_process_group,
)
from contention import (  # noqa: E402
    BusyLoops,
    add_contention_option,
    busy_cpus,
    check_contention,
    slowdown_rows,
)

PERCENTILES = (50, 90, 99)
WARMUP_TOKENS = 4
T = TypeVar("T")
# Read timeout of one stream: a request queued behind many others may wait long for its first
# token on a slow CPU, and the benchmark should measure that rather than give up.
STREAM_TIMEOUT_S = 900.0


def log(message: str) -> None:
    """Progress on stderr, so stdout holds only the results."""
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- arguments
def parse_rate(text: str) -> float:
    """Requests per second: a positive number or `inf`."""
    rate = float(text)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"bad request rate {text!r}: want > 0 or inf")
    return rate


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
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


def offline_batch(args: argparse.Namespace) -> int | None:
    """The batch size the server runs at steadily: the concurrency cap, or every request when
    all arrive at once; None for an uncapped Poisson rate (the batch size then wanders)."""
    if args.max_concurrency is not None:
        return min(args.max_concurrency, args.num_prompts)
    return args.num_prompts if math.isinf(args.request_rate) else None


# ---------------------------------------------------------------------------- server process
def free_port() -> int:
    """A port nobody listens on now (the server binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_sizes(args: argparse.Namespace) -> tuple[int, int]:
    """(max sequence length, KV tokens) that hold the whole workload at once, with headroom.

    The started server and the offline engine get the same figures, so that neither pays for a
    KV pool or page table the other does not have; sized like offline.py sizes its engine.
    """
    seq = args.input_len + args.output_len
    in_flight = args.num_prompts if args.max_concurrency is None else args.max_concurrency
    warmup = args.warmup_requests or 0
    kv_tokens = int(1.25 * max(in_flight, warmup, 1) * seq) + 64
    return seq, kv_tokens


@dataclass
class Server:
    """A `python -m minisgl` child in its own process group (so its workers stop with it)."""

    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path

    @classmethod
    def start(cls, model: Path, args: argparse.Namespace) -> Server:
        seq, kv_tokens = engine_sizes(args)
        port = free_port()
        # The same rounding MinisglRunner applies, so the offline engine matches exactly.
        max_seq = -(-(seq + 1) // 64) * 64
        cmd = [
            sys.executable,
            "-m",
            "minisgl",
            "--model",
            str(model),
            "--port",
            str(port),
            "--dtype",
            args.dtype,
            "--max-seq-len",
            str(max_seq),
            "--num-pages",
            str(kv_tokens),
            "--log-level",
            "warning",
            *shlex.split(args.server_args),  # last, so they override the flags above
        ]
        args.out.mkdir(parents=True, exist_ok=True)
        log_path = args.out / f"serving-server-{stamp()}.log"
        log(f"server: {shlex.join(cmd)} (log {log_path})")
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(
                cmd, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
            )
        return cls(proc, f"http://127.0.0.1:{port}", log_path)

    def wait_healthy(self, timeout: float) -> None:
        """Poll /health; fail early, with the log's tail, if the server exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"server not healthy after {timeout:.0f} s:\n{self.tail()}")

    def tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the whole process group, SIGKILL it if it does not exit in `timeout` s."""
        if self.proc.poll() is not None:
            return
        stop_process_group(self.proc, timeout)
        log(f"server: stopped (exit {self.proc.returncode})")


# ---------------------------------------------------------------------------- client
@dataclass
class RequestResult:
    """One streamed request, as the client saw it (times in seconds)."""

    prompt_len: int
    sent: float = 0.0  # perf_counter when the request went out
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int = 0  # from the final usage chunk: the server's exact count
    # Arrival time (since `sent`) and text of every chunk that carried text.
    chunk_times: list[float] = field(default_factory=list)
    chunk_texts: list[str] = field(default_factory=list)
    error: str | None = None
    # Arrival time and raw payload of every SSE event, parsed once the run is over.
    events: list[tuple[float, bytes]] = field(default_factory=list, repr=False)

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft is not None and self.e2e is not None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        assert self.e2e is not None and self.ttft is not None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def parse_events(self) -> None:
        """Fill TTFT, chunk times and texts and the token count from the raw events (a
        request that failed on the way keeps its error and drops them)."""
        if self.error is not None:
            self.events.clear()
            return
        try:
            for at, data in self.events:
                event = json.loads(data)
                if "error" in event:  # the server reports mid-stream failures in-band
                    self.error = str(event["error"].get("message", event["error"]))
                    return
                if event.get("usage"):
                    self.output_tokens = int(event["usage"]["completion_tokens"])
                for choice in event.get("choices", []):
                    # Chunks with no text (the finish reason) mark no new token.
                    if choice.get("text"):
                        if self.ttft is None:
                            self.ttft = at
                        self.chunk_times.append(at)
                        self.chunk_texts.append(choice["text"])
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            self.error = f"bad stream event: {type(exc).__name__}: {exc}"
            return
        finally:
            self.events.clear()
        if self.output_tokens == 0:
            self.error = "no usage chunk in the stream"


async def stream_one(
    session: aiohttp.ClientSession,
    url: str,
    model_name: str,
    ids: list[int],
    max_tokens: int,
) -> RequestResult:
    """Send one streaming completion; record when each SSE event arrives.

    Only arrival times and raw payloads are kept here: JSON parsing waits until the run is
    over, since anything heavier would compete with the server for the same cores while it is
    being measured.
    """
    result = RequestResult(prompt_len=len(ids))
    body = {
        "model": model_name,
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result.sent = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                text = (await response.read()).decode(errors="replace")
                result.error = f"HTTP {response.status}: {text[:200]}"
                return result
            async for line in response.content:  # one SSE line at a time
                if not line.startswith(b"data: "):
                    continue  # blank separators between SSE events
                data = line[6:].rstrip()
                if data == b"[DONE]":
                    break
                result.events.append((time.perf_counter() - result.sent, data))
        result.e2e = time.perf_counter() - result.sent
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def arrival_offsets(n: int, rate: float, rng: np.random.Generator) -> list[float]:
    """Send times (s after the start) of a Poisson process at `rate` req/s; 0s when inf."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = rng.exponential(1.0 / rate, n)
    gaps[0] = 0.0  # the first request opens the run instead of waiting a random gap
    return np.cumsum(gaps).tolist()


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` on uvloop where installed: the client's own CPU time per streamed chunk
    competes with the server it measures."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


async def run_load(
    url: str,
    model_name: str,
    prompts: list[list[int]],
    max_tokens: int,
    offsets: list[float],
    concurrency: int | None,
    headers: dict[str, str],
) -> tuple[list[RequestResult], float]:
    """Send every prompt at its offset, at most `concurrency` in flight; (results, wall s)."""
    gate = asyncio.Semaphore(concurrency or len(prompts))
    # No connection limit below the concurrency: queueing inside the client would count as
    # server latency.
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=STREAM_TIMEOUT_S)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, headers=headers
    ) as session:
        start = time.perf_counter()

        async def one(ids: list[int], offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            # TTFT counts from when the request is sent, not from when it was due: time spent
            # waiting here for a free slot is the closed loop's, not the server's.
            async with gate:
                return await stream_one(session, url, model_name, ids, max_tokens)

        results = await asyncio.gather(*(one(p, o) for p, o in zip(prompts, offsets)))
        wall = time.perf_counter() - start
    for result in results:
        result.parse_events()
    return list(results), wall


def served_model(url: str, headers: dict[str, str]) -> tuple[str, str | None]:
    """The model name the server expects in requests, and its folder (if it says)."""
    reply = httpx.get(f"{url}/v1/models", headers=headers, timeout=10.0)
    reply.raise_for_status()
    card = reply.json()["data"][0]
    return card["id"], card.get("root")


# ---------------------------------------------------------------------------- metrics
def tokens_per_chunk(texts: list[str], total: int, tokenizer: Any) -> list[int]:
    """How many of the `total` output tokens each text chunk carried.

    The server streams text only. A chunk holds several tokens when the detokenizer held text
    back (half a UTF-8 character) or took several decode steps at once; the exact total comes
    from the usage chunk. Every chunk has at least one token; the surplus is spread by largest
    remainder in proportion to what re-tokenizing each chunk's text suggests beyond one token
    (evenly when it suggests nothing). With one token per chunk, the common case, it is exact.
    """
    n = len(texts)
    if n == 0:
        return []
    surplus = total - n
    if surplus <= 0:
        return [1] * n
    extra = [max(0, len(tokenizer.encode(t, add_special_tokens=False)) - 1) for t in texts]
    if sum(extra) == 0:
        extra = [1] * n
    shares = [surplus * e / sum(extra) for e in extra]
    counts = [1 + int(s) for s in shares]
    left = total - sum(counts)
    by_remainder = sorted(range(n), key=lambda i: shares[i] - int(shares[i]), reverse=True)
    for i in by_remainder[:left]:
        counts[i] += 1
    return counts


def inter_token_latencies(result: RequestResult, counts: list[int]) -> list[float]:
    """Every gap between text chunks; a chunk of k tokens gives k gaps of (its gap / k), so
    the mean ITL and the TPOT measure the same per-token time."""
    itl: list[float] = []
    times = result.chunk_times
    for i in range(1, len(times)):
        gap = times[i] - times[i - 1]
        itl += [gap / counts[i]] * counts[i]
    return itl


@dataclass
class Summary:
    """What one run measured: latencies in ms per metric, throughput, counts."""

    completed: int
    failed: int
    wall_s: float
    prompt_tokens: int
    output_tokens: int
    chunks: int
    samples_ms: dict[str, list[float]]
    mean_in_flight: float
    first_error: str | None = None

    @property
    def request_throughput(self) -> float:
        return self.completed / self.wall_s

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def total_throughput(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s

    def stat(self, metric: str, q: float | None = None) -> float | None:
        """The q-th percentile of a metric in ms (None: the mean); None without samples."""
        values = self.samples_ms[metric]
        if not values:
            return None
        return statistics.fmean(values) if q is None else float(np.percentile(values, q))


def summarize(results: list[RequestResult], wall: float, tokenizer: Any) -> Summary:
    ok = [r for r in results if r.ok]
    samples: dict[str, list[float]] = {"TTFT": [], "TPOT": [], "ITL": [], "E2E": []}
    chunks = 0
    for r in ok:
        assert r.ttft is not None and r.e2e is not None
        counts = tokens_per_chunk(r.chunk_texts, r.output_tokens, tokenizer)
        chunks += len(counts)
        samples["TTFT"].append(1e3 * r.ttft)
        samples["E2E"].append(1e3 * r.e2e)
        if r.tpot is not None:
            samples["TPOT"].append(1e3 * r.tpot)
        samples["ITL"] += [1e3 * x for x in inter_token_latencies(r, counts)]
    failed = [r for r in results if not r.ok]
    return Summary(
        completed=len(ok),
        failed=len(failed),
        wall_s=wall,
        prompt_tokens=sum(r.prompt_len for r in ok),
        output_tokens=sum(r.output_tokens for r in ok),
        chunks=chunks,
        samples_ms=samples,
        # Little's law: the average number of requests the server held during the run.
        mean_in_flight=sum(r.e2e or 0.0 for r in ok) / wall,
        first_error=next((r.error for r in failed), None),
    )


def latency_table(summary: Summary) -> str:
    rows = []
    for metric, values in summary.samples_ms.items():
        stats = [summary.stat(metric)] + [summary.stat(metric, q) for q in PERCENTILES]
        rows.append([metric, *stats, len(values)])
    headers = ["metric", "mean ms", *(f"p{q} ms" for q in PERCENTILES), "samples"]
    return format_table(headers, rows)


# ---------------------------------------------------------------------------- offline
@dataclass
class OfflineStep:
    """The offline engine's decode step at one batch size (median of the runs)."""

    batch: int
    step_s: float
    runs_s: list[float]

    @property
    def tok_per_s(self) -> float:
        return self.batch / self.step_s

    @staticmethod
    def merged(*measures: OfflineStep) -> OfflineStep:
        """One measure from several sessions: the median step over all their runs (the faster
        middle one for an even count)."""
        runs = [step for measure in measures for step in measure.runs_s]
        return OfflineStep(measures[0].batch, sorted(runs)[(len(runs) - 1) // 2], runs)


def offline_decode_step(
    model: Path, tokens: TokenSource, args: argparse.Namespace, batch: int
) -> OfflineStep:
    """Decode step time of `minisgl.llm.LLM` with `batch` requests of the served shape.

    All requests are submitted at once, so after their prefill every decode step runs at
    exactly `batch`; the step time is the decode forwards' span (first start to last end, the
    scheduler's work between steps included, as in a server step) over their count. The
    engine is sized like the server this script starts (same context length and KV pool).
    """
    seq, kv_tokens = engine_sizes(args)
    runner = MinisglRunner(model, args.dtype, max_seq_len=seq, kv_tokens=kv_tokens)
    try:

        def phases(*stream: int | str) -> Any:
            rng = tokens.rng("offline", *stream)
            prompts = [tokens.draw(rng, args.input_len) for _ in range(batch)]
            return single_phase(prompts, [args.output_len] * batch)

        warm = phases("warmup")
        for r in warm[0]:
            r.max_tokens = WARMUP_TOKENS + 4  # a few decode steps at the batch size
        runner.run(warm, "warmup")
        runs = [runner.run(phases(k), f"offline batch {batch}") for k in range(args.repeat)]
    finally:
        runner.close()
    steps = [r.decode_s / r.decode_steps for r in runs if r.decode_s and r.decode_steps]
    if not steps:
        raise RuntimeError("the offline run had no decode steps")
    best = median_run(runs)
    assert best.decode_s and best.decode_steps
    return OfflineStep(batch, best.decode_s / best.decode_steps, steps)


# ---------------------------------------------------------------------------- plot
def plot_cdfs(path: Path, title: str, summary: Summary, offline: OfflineStep | None) -> bool:
    """One CDF panel per latency metric; the offline step time marked on TPOT and ITL.

    Returns False when matplotlib is missing (the tables still print).
    """
    plt = pyplot_or_none()
    if plt is None:
        return False
    metrics = list(summary.samples_ms)
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.8), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        values = np.sort(np.asarray(summary.samples_ms[metric]))
        if len(values):
            ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post")
            for q, style in zip(PERCENTILES, (":", "--", "-.")):
                ax.axvline(
                    float(np.percentile(values, q)), color="gray", ls=style, lw=1, label=f"p{q}"
                )
        if offline is not None and metric in ("TPOT", "ITL"):
            ax.axvline(
                1e3 * offline.step_s, color="red", lw=1.2, label=f"offline step @{offline.batch}"
            )
        ax.set_title(f"{metric} ({len(values)} samples)", fontsize=9)
        ax.set_xlabel("ms")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    axes[0][0].set_ylabel("fraction <= x")
    fig.suptitle(title, fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------- main
def describe_load(args: argparse.Namespace) -> str:
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


def contention_table(quiet: Summary, busy: Summary, level: int) -> str:
    """Latencies and throughput quiet against contended, with the ratio."""
    metrics = [
        (
            f"{metric} {'mean' if q is None else f'p{q}'} ms",
            quiet.stat(metric, q),
            busy.stat(metric, q),
        )
        for metric, q in (
            ("TTFT", 50),
            ("TPOT", 50),
            ("TPOT", None),
            ("ITL", 50),
            ("ITL", 90),
            ("E2E", 50),
        )
    ]
    metrics += [
        ("output tok/s", quiet.output_throughput, busy.output_throughput),
        ("requests/s", quiet.request_throughput, busy.request_throughput),
    ]
    headers = ["metric", "quiet", f"{level} busy", "contended / quiet"]
    return format_table(headers, slowdown_rows(metrics))


def describe_summary(summary: Summary) -> str:
    """Completed and failed requests, throughput, mean in flight, chunks: one line."""
    return (
        f"requests: {summary.completed} done, {summary.failed} failed in {summary.wall_s:.2f} s; "
        f"{summary.request_throughput:.2f} req/s; output {summary.output_throughput:,.1f} tok/s, "
        f"total {summary.total_throughput:,.1f} tok/s; mean in flight "
        f"{summary.mean_in_flight:.1f}; {summary.output_tokens} output tokens in "
        f"{summary.chunks} text chunks"
    ) + (f"\nfirst error: {summary.first_error}" if summary.first_error else "")


def summary_json(summary: Summary) -> dict[str, Any]:
    """A summary's counts, throughput and latency statistics (not its samples)."""
    return {k: v for k, v in asdict(summary).items() if k != "samples_ms"} | {
        "request_throughput": summary.request_throughput,
        "output_throughput": summary.output_throughput,
        "stats_ms": {
            m: {"mean": summary.stat(m)} | {f"p{q}": summary.stat(m, q) for q in PERCENTILES}
            for m in summary.samples_ms
        },
    }


def offline_comparison(
    summaries: list[Summary], offline_at: dict[int, OfflineStep], batch: int
) -> tuple[str, float | None]:
    """Per round: the server's TPOT p50 over the offline step measured just before and after
    that round; (the table, the median ratio over rounds)."""
    rows, ratios = [], []
    for k, summary in enumerate(summaries):
        around = [offline_at[i] for i in (k, k + 1) if i in offline_at]
        step = OfflineStep.merged(*around)
        tpot, itl = summary.stat("TPOT", 50), summary.stat("ITL", 50)
        ratio = None if tpot is None else tpot / (1e3 * step.step_s)
        if ratio is not None:
            ratios.append(ratio)
        rows.append(
            [
                k + 1,
                batch,
                1e3 * step.step_s,
                step.tok_per_s,
                tpot,
                summary.stat("TPOT"),
                None if ratio is None else f"{ratio:.2f}x",
                None if itl is None else f"{itl / (1e3 * step.step_s):.2f}x",
            ]
        )
    headers = [
        "round",
        "batch",
        "offline step ms",
        "offline decode tok/s",
        "server TPOT p50 ms",
        "server TPOT mean ms",
        "TPOT p50 / step",
        # Not moved by prefills that delay a request between its first and last token.
        "ITL p50 / step",
    ]
    return format_table(headers, rows), statistics.median(ratios) if ratios else None


def main(argv: list[str] | None = None) -> None:
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
        table, ratio = offline_comparison(summaries, offline_at, batch)
        print(table)
        if ratio is not None and args.rounds > 1:
            print(f"TPOT p50 / offline step, median over {args.rounds} rounds: {ratio:.2f}x")
        offline = OfflineStep.merged(*offline_at.values())
        for i, step in sorted(offline_at.items()):
            runs_ms = ", ".join(f"{1e3 * s:.2f}" for s in step.runs_s)
            print(
                f"offline step ms before round {i + 1}: {runs_ms}"
                if i < args.rounds
                else f"offline step ms after the last round: {runs_ms}"
            )

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
            else {
                "contention": args.contention,
                "cpus": busy_cpus(args.contention),
                "summary": summary_json(busy_summary),
                "rounds_tpot_p50_ms": [
                    summarize(results, wall, tokenizer).stat("TPOT", 50)
                    for results, wall in contended_runs
                ],
                "requests": [asdict(r) for r in busy_results],
            },
        },
    )


if __name__ == "__main__":
    main()
