"""What the benchmarks print and write: progress on stderr, Markdown tables, grouped bar charts
(PNG), JSON, and the time stamp in their file names."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from results import RunResult


def log(message: str) -> None:
    """Progress on stderr, so stdout holds only the results."""
    print(message, file=sys.stderr, flush=True)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (pastes into docs), columns padded for the terminal."""

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:,.2f}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in text]) for i, h in enumerate(headers)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in text:
        lines.append("| " + " | ".join(v.rjust(w) for v, w in zip(r, widths)) + " |")
    return "\n".join(lines)


def series(
    results: Sequence[RunResult],
    groups: Sequence[str],
    value: Callable[[RunResult], float | None],
    name: Callable[[RunResult], str] = lambda r: r.engine,
) -> dict[str, list[float | None]]:
    """Bar heights for a chart: per series `name` (in order of first appearance), `value` of its
    result for each group (workload), None where it has none."""
    return {
        e: [
            next((value(r) for r in results if name(r) == e and r.workload == g), None)
            for g in groups
        ]
        for e in dict.fromkeys(name(r) for r in results)
    }


@dataclass
class Panel:
    """One bar chart: a group per workload / batch size, a bar per engine (None: no bar)."""

    groups: Sequence[str]
    series: dict[str, Sequence[float | None]]
    ylabel: str
    title: str = ""
    # One marker per group, e.g. the roofline bound.
    bounds: Sequence[float | None] | None = None
    bound_label: str = "bound"


def pyplot_or_none() -> Any:
    """matplotlib.pyplot on the Agg backend, or None (with a note) when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no PNG; pip install matplotlib)")
        return None
    return plt


def bar_chart(path: Path, title: str, panels: Sequence[Panel]) -> bool:
    """Grouped bar charts side by side, saved as a PNG.

    Returns False when matplotlib is missing (the table still prints).
    """
    plt = pyplot_or_none()
    if plt is None:
        return False
    width_per = max(5.0, 0.5 * max(len(p.groups) * max(1, len(p.series)) for p in panels))
    fig, axes = plt.subplots(1, len(panels), figsize=(width_per * len(panels), 4.8), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        x = np.arange(len(panel.groups))
        width = 0.8 / max(1, len(panel.series))
        top = 0.0
        for i, (name, values) in enumerate(panel.series.items()):
            heights = [np.nan if v is None else v for v in values]
            offset = (i - (len(panel.series) - 1) / 2) * width
            bars = ax.bar(x + offset, heights, width, label=name)
            labels = ["" if v is None else f"{v:,.0f}" if v >= 100 else f"{v:.3g}" for v in values]
            ax.bar_label(bars, labels=labels, fontsize=7, padding=1)
            top = max([top] + [v for v in values if v is not None])
        for b in panel.bounds or []:
            top = max(top, b or 0.0)
        if panel.bounds is not None:
            ax.scatter(
                x,
                [np.nan if b is None else b for b in panel.bounds],
                marker="_",
                s=900,
                color="black",
                label=panel.bound_label,
                zorder=3,
            )
        ax.set_xticks(x, panel.groups, fontsize=8)
        ax.set_ylabel(panel.ylabel)
        if panel.title:
            ax.set_title(panel.title, fontsize=9)
        if top > 0:
            ax.set_ylim(0, top * 1.25)  # room for the legend above the bars
        entries = len(panel.series) + (panel.bounds is not None)
        ax.legend(fontsize=7, loc="upper center", ncol=min(entries, 4), frameon=False)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    save_figure(plt, fig, path)
    return True


def write_chart_and_json(
    png: Path, title: str, panels: Sequence[Panel], results: Sequence[RunResult]
) -> None:
    """The bar chart (its path printed when matplotlib made it) and every result as JSON."""
    if bar_chart(png, title, panels):
        print(f"plot: {png}")
    save_json(png.with_suffix(".json"), [r.to_json() for r in results])


def save_figure(plt: Any, fig: Any, path: Path) -> None:
    """Lay out, save as a PNG (creating its folder) and close a matplotlib figure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def save_json(path: Path, data: Any) -> None:
    """`data` as indented JSON (anything JSON cannot hold as its str), creating the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str))


def stamp() -> str:
    """The local time as `YYYYmmdd-HHMMSS`, for output file names."""
    return time.strftime("%Y%m%d-%H%M%S")
