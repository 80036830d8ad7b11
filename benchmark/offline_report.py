"""offline.py's output: the throughput table with each workload's matmul floor, the quiet
against contended table, the decode table against the roofline bound, their PNG and JSON."""

from __future__ import annotations

import argparse
from pathlib import Path

import paths  # noqa: F401  (before minisgl: a checkout without `pip install -e .`)
from contention import BusyLoops, slowdown
from machine import REFERENCE_MACHINE, Machine, model_cost
from models import model_label
from report import Panel, format_table, series, stamp, write_chart_and_json
from results import RunResult
from workloads import Shape

from minisgl.llm.llm import parse_dtype


def report_throughput(
    results: list[RunResult],
    shapes: list[Shape],
    args: argparse.Namespace,
    model: Path,
    machine: Machine,
) -> None:
    """Output and total tok/s per workload and engine with minisgl's ratio, the matmul floor of
    minisgl's runs, the contention table when there are contended runs; PNG and JSON."""
    rows = []
    quiet = [r for r in results if not r.contention]
    for shape in shapes:
        name = shape.describe()
        ours = next(r for r in quiet if r.workload == name and r.engine == "minisgl")
        for r in (r for r in quiet if r.workload == name):
            ratio = ours.output_tps / r.output_tps
            rows.append(
                [
                    name,
                    r.engine,
                    r.output_tps,
                    r.total_tps,
                    r.wall_s,
                    "1.00x" if r is ours else f"{ratio:.2f}x",
                    r.bad_lengths or "",
                ]
            )
    headers = [
        "workload",
        "engine",
        "out tok/s",
        "total tok/s",
        "wall s",
        "minisgl/this",
        "bad len",
    ]
    print(format_table(headers, rows))
    cost = model_cost(model, parse_dtype(args.dtype))
    for shape in shapes:
        ours = next(r for r in quiet if r.workload == shape.describe() and r.engine == "minisgl")
        # Prompt tokens served from the prefix cache pass no matmul.
        computed = ours.prompt_tokens - ours.cached_tokens
        floor = cost.matmul_seconds(computed, shape.num_prompts, ours.output_tokens, machine)
        print(
            f"floor: {shape.describe()}'s matmuls take >= {floor:.2f} s at "
            f"{machine.matmul_tflops:.2f} TFLOP/s ({machine.source}); minisgl's wall time is "
            f"{ours.wall_s / floor:.2f}x that"
        )
    if len(quiet) < len(results):
        report_contention(results, shapes)
    for r in results:
        if r.cached_tokens:
            print(
                f"note: {r.engine} served {r.cached_tokens} prompt tokens of {r.workload} from cache"
                + (f" ({r.contention} busy)" if r.contention else "")
            )

    def series_name(r: RunResult) -> str:
        return r.engine + (f", {r.contention} busy" if r.contention else "")

    groups = [s.describe() for s in shapes]
    bars = series(results, groups, lambda r: r.output_tps, series_name)
    png = args.out / f"offline-{model_label(model)}-{stamp()}.png"
    title = f"{model_label(model)} {args.dtype}: output tok/s (higher is better)"
    write_chart_and_json(png, title, [Panel(groups, bars, "output tokens / s")], results)


def report_contention(results: list[RunResult], shapes: list[Shape]) -> None:
    """Per workload and engine: quiet and contended wall time, slowdown, minisgl against it."""
    rows = []
    for shape in shapes:
        # engine -> (quiet run, contended run)
        pairs: dict[str, list[RunResult | None]] = {}
        for r in (r for r in results if r.workload == shape.describe()):
            pairs.setdefault(r.engine, [None, None])[bool(r.contention)] = r
        ours = pairs["minisgl"]
        for engine, runs in pairs.items():
            walls = [None if r is None else r.wall_s for r in runs]
            # minisgl's output tok/s over this engine's, quiet and contended.
            speedups = [
                None
                if mine is None or theirs is None
                else f"{mine.output_tps / theirs.output_tps:.2f}x"
                for mine, theirs in zip(ours, runs)
            ]
            rows.append([shape.describe(), engine, *walls, slowdown(*walls), *speedups])
    level = max(r.contention for r in results)
    headers = [
        "workload",
        "engine",
        "quiet s",
        f"{level} busy s",
        "slowdown",
        "minisgl/this quiet",
        f"minisgl/this {level} busy",
    ]
    print(f"contention: {BusyLoops(level).describe()} during each engine's contended runs")
    print(format_table(headers, rows))


def report_decode(
    results: list[RunResult],
    shapes: list[Shape],
    args: argparse.Namespace,
    model: Path,
    machine: Machine,
) -> None:
    """Decode steps/s and tok/s per batch size and engine against the roofline bound; PNG and
    JSON."""
    cost = model_cost(model, parse_dtype(args.dtype))
    print(
        f"bounds: {cost.params / 1e6:.1f}M params, {cost.weight_bytes / 1e6:.0f} MB of weights per "
        "decode step"
    )
    for m in dict.fromkeys((machine, REFERENCE_MACHINE)):  # once with --reference-machine
        print(
            f"  at {m.describe()}: <= {cost.bandwidth_steps_per_s(m):.1f} steps/s by bandwidth, "
            f"matmuls <= {cost.compute_tok_per_s(m):,.0f} tok/s"
        )
    bw = cost.bandwidth_steps_per_s(machine)
    rows = []
    for shape in shapes:
        bound = cost.roofline_tok_per_s(shape.num_prompts, machine)
        for r in (r for r in results if r.workload == shape.describe()):
            steps = r.decode_steps_per_s
            if steps is None and r.engine.startswith("vLLM"):
                steps = r.extra.get("decode_steps_per_s")
            tok = None if steps is None else steps * shape.num_prompts
            rows.append(
                [
                    shape.num_prompts,
                    r.engine,
                    steps,
                    tok,
                    None if tok is None else f"{100 * tok / bound:.0f}%",
                    min(bw, cost.compute_tok_per_s(machine) / shape.num_prompts),
                    r.output_tps,
                ]
            )
    headers = [
        "batch",
        "engine",
        "decode steps/s",
        "decode tok/s",
        "of bound",
        "bound steps/s",
        "e2e out tok/s",
    ]
    print(format_table(headers, rows))
    engines = list(dict.fromkeys(r.engine for r in results))
    groups = [s.describe() for s in shapes]
    bars: dict[str, list[float | None]] = {}
    for e in engines:
        bars[e] = []
        for s in shapes:
            row = next((r for r in rows if r[0] == s.num_prompts and r[1] == e), None)
            bars[e].append(None if row is None else row[3])
    png = args.out / f"decode-{model_label(model)}-{stamp()}.png"
    title = f"{model_label(model)} {args.dtype}: decode tok/s by batch size"
    bounds = [cost.roofline_tok_per_s(s.num_prompts, machine) for s in shapes]
    panel = Panel(groups, bars, "decode tokens / s", bounds=bounds, bound_label="roofline bound")
    write_chart_and_json(png, title, [panel], results)
