"""serving.py's output: the latency table, the one-line summary, quiet against contended, the
server's TPOT over the offline step per round, the latency CDFs (PNG) and the JSON."""

from __future__ import annotations

import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from contention import busy_cpus, slowdown_rows
from report import format_table, pyplot_or_none, save_figure
from serving_client import RequestResult
from serving_metrics import PERCENTILES, Summary
from serving_offline import OfflineStep


def latency_table(summary: Summary) -> str:
    """Mean and percentiles in ms of every latency metric, with its sample count."""
    rows = []
    for metric, values in summary.samples_ms.items():
        stats = [summary.stat(metric)] + [summary.stat(metric, q) for q in PERCENTILES]
        rows.append([metric, *stats, len(values)])
    headers = ["metric", "mean ms", *(f"p{q} ms" for q in PERCENTILES), "samples"]
    return format_table(headers, rows)


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


def print_offline_comparison(
    summaries: list[Summary], offline_at: dict[int, OfflineStep], batch: int, rounds: int
) -> tuple[OfflineStep, float | None]:
    """Print the per-round table, the median ratio and every offline measurement; (the offline
    step over all of them, the median ratio)."""
    table, ratio = offline_comparison(summaries, offline_at, batch)
    print(table)
    if ratio is not None and rounds > 1:
        print(f"TPOT p50 / offline step, median over {rounds} rounds: {ratio:.2f}x")
    for i, step in sorted(offline_at.items()):
        runs_ms = ", ".join(f"{1e3 * s:.2f}" for s in step.runs_s)
        print(
            f"offline step ms before round {i + 1}: {runs_ms}"
            if i < rounds
            else f"offline step ms after the last round: {runs_ms}"
        )
    return OfflineStep.merged(*offline_at.values()), ratio


def contended_json(
    level: int, summary: Summary, rounds: list[Summary], requests: list[RequestResult]
) -> dict[str, Any]:
    """The rounds with `level` busy loops spinning, for the JSON: the CPUs they took, the
    summary, each round's TPOT p50 and every request."""
    return {
        "contention": level,
        "cpus": busy_cpus(level),
        "summary": summary_json(summary),
        "rounds_tpot_p50_ms": [r.stat("TPOT", 50) for r in rounds],
        "requests": [asdict(r) for r in requests],
    }


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
    save_figure(plt, fig, path)
    return True
