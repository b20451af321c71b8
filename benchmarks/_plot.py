"""Charts of the benchmarks' results: ``--plot PATH`` writes a PNG of grouped bars, or of lines of growth, next to
the printed table.

matplotlib is the ``benchmarks`` extra (``pip install -e ".[benchmarks]"``), not a dependency of the package, and is
imported only when a chart is written, so that a benchmark without ``--plot`` runs without it.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Panel", "add_plot_option", "save_panels", "seconds_panel", "write_chart", "write_growth_chart"]

# one colour a path, the same in every panel: ours first, then the others, then the floor
_COLOURS = (
    "#1f6fb4",
    "#d9822b",
    "#6b6b6b",
    "#3c9a5f",
    "#a33f3f",
    "#8a63b8",
    "#c9a227",
    "#2bb3c0",
    "#e377c2",
    "#8c564b",
)


@dataclass(frozen=True)
class Panel:
    """One chart of grouped bars: a group a configuration ("25M, 2 ranks"), a bar in it a path ("ignite")."""

    title: str
    unit: str
    bars: Mapping[str, Mapping[str, float]]  # group -> path -> value
    spread: Mapping[str, Mapping[str, tuple[float, float]]] = field(default_factory=dict)  # (min, max) whiskers
    log: bool = False


def add_plot_option(parser: argparse.ArgumentParser) -> None:
    """``--plot PATH`` on a benchmark's command line."""
    parser.add_argument(
        "--plot", metavar="PATH", help='also write the results as a PNG chart (needs the "benchmarks" extra)'
    )


def seconds_panel(title: str, runs: Mapping[str, Mapping[str, Sequence[float]]], log: bool = False) -> Panel:
    """A panel of seconds: by group and path, the median of the runs, with min-max whiskers."""
    bars = {
        group: {path: statistics.median(times) for path, times in paths.items() if times}
        for group, paths in runs.items()
    }
    spread = {
        group: {path: (min(times), max(times)) for path, times in paths.items() if times}
        for group, paths in runs.items()
    }
    return Panel(title, "seconds (log scale)" if log else "seconds", bars, spread, log)


def save_panels(results: Mapping[tuple[int, int], Sequence[Mapping[str, Any]]]) -> list[Panel]:
    """The panels of a benchmark of saves: seconds on rank 0 (the recipient), and the peak memory growth of rank 0
    and of the worst other rank, by configuration and path.

    Args:
        results: by ``(parameters, world size)``, each rank's ``{"records": {path: [(seconds, growth, ...)]}}``; a
            path that ran on rank 0 only (a floor) has no bar in the other ranks' panel.
    """
    seconds: dict[str, dict[str, float]] = {}
    spread: dict[str, dict[str, tuple[float, float]]] = {}
    recipient: dict[str, dict[str, float]] = {}
    others: dict[str, dict[str, float]] = {}
    for (count, world_size), ranks in sorted(results.items()):
        group = f"{count / 1e6:.0f}M, {world_size} ranks"
        records = ranks[0]["records"]
        seconds[group] = {path: statistics.median(r[0] for r in records[path]) for path in records}
        spread[group] = {path: (min(r[0] for r in records[path]), max(r[0] for r in records[path])) for path in records}
        recipient[group] = {path: max(r[1] for r in records[path]) / 2**30 for path in records}
        others[group] = {
            path: max(r[1] for rank in ranks[1:] for r in rank["records"][path]) / 2**30
            for path in records
            if all(rank["records"][path] for rank in ranks[1:]) and len(ranks) > 1
        }
    return [
        Panel("seconds per save (median, min-max)", "seconds (log scale)", seconds, spread, log=True),
        Panel("memory growth of rank 0, the recipient", "GiB", recipient),
        Panel("memory growth of the worst other rank", "GiB", others),
    ]


def write_chart(path: str | Path, title: str, panels: Sequence[Panel]) -> None:
    """Write ``panels`` side by side, under ``title``, as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display
    import matplotlib.pyplot as plt

    paths = list(dict.fromkeys(name for panel in panels for group in panel.bars.values() for name in group))
    colours = {name: _COLOURS[index % len(_COLOURS)] for index, name in enumerate(paths)}
    handles: dict[str, Any] = {}
    figure, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.6), squeeze=False)
    for axis, panel in zip(axes[0], panels):
        groups = list(panel.bars)
        present = [name for name in paths if any(name in group for group in panel.bars.values())]
        width = 0.8 / max(len(present), 1)
        for index, name in enumerate(present):
            where = [(g, group) for g, group in enumerate(groups) if name in panel.bars[group]]
            xs = [g + (index - (len(present) - 1) / 2) * width for g, _ in where]
            heights = [panel.bars[group][name] for _, group in where]
            bars = axis.bar(xs, heights, width, label=name, color=colours[name])
            handles.setdefault(name, bars)
            axis.bar_label(bars, fmt="%.3g", fontsize=7, padding=1)  # a bar of 0 shows as a label, not as nothing
            spreads = [panel.spread.get(group, {}).get(name) for _, group in where]
            if any(spreads):
                low = [h - s[0] if s else 0 for h, s in zip(heights, spreads)]
                high = [s[1] - h if s else 0 for h, s in zip(heights, spreads)]
                axis.errorbar(xs, heights, yerr=[low, high], fmt="none", ecolor="black", capsize=2, linewidth=0.8)
        axis.set_xticks(range(len(groups)), groups)
        axis.set_title(panel.title, fontsize=10)
        axis.set_ylabel(panel.unit)
        if panel.log:
            axis.set_yscale("log")
        axis.grid(axis="y", alpha=0.3)
        axis.set_axisbelow(True)
    # one legend for every panel: panels may show different paths
    figure.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(len(handles), 5), fontsize=8)
    figure.suptitle(title, fontsize=11)
    figure.tight_layout(rect=(0, 0.06 * -(-len(handles) // 5), 1, 1))
    figure.savefig(path, dpi=100)
    plt.close(figure)


def write_growth_chart(
    path: str | Path, title: str, panels: Mapping[str, Mapping[str, Mapping[int, Sequence[float]]]], unit: str
) -> None:
    """Write, side by side under ``title``, one log-log panel of lines a key of ``panels``: in each, a line a path,
    its median seconds (min-max whiskers) against ``unit`` (the size each point measured), as a PNG at ``path``.

    Args:
        path: where the PNG goes.
        title: the chart's title.
        panels: panel title -> path -> size -> seconds of each run.
        unit: what the sizes count ("entries").
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: no display
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(name for lines in panels.values() for name in lines))
    colours = {name: _COLOURS[index % len(_COLOURS)] for index, name in enumerate(names)}
    figure, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.6), squeeze=False)
    for axis, (panel, lines) in zip(axes[0], panels.items()):
        for name, points in lines.items():
            sizes = sorted(points)
            middle = [statistics.median(points[size]) for size in sizes]
            low = [m - min(points[size]) for m, size in zip(middle, sizes)]
            high = [max(points[size]) - m for m, size in zip(middle, sizes)]
            axis.errorbar(sizes, middle, yerr=[low, high], label=name, color=colours[name], marker="o", capsize=2)
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel(unit)
        axis.set_ylabel("seconds (median, min-max)")
        axis.set_title(panel, fontsize=10)
        axis.grid(alpha=0.3, which="both")
        axis.legend(fontsize=8)
    figure.suptitle(title, fontsize=11)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
