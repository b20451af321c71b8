"""Peak memory of ``ignite-zero export`` on a large checkpoint: the export holds one tensor at a time.

Saves a model of ``--gigabytes`` of fp32 weights in ``--tensors`` tensors with ``DiskSaver``, then runs
``ignite-zero export`` on it in a subprocess and samples that process's resident memory every 10 ms from
``/proc``: anonymous memory (what the export allocates) and file-backed memory (pages of the mapped checkpoint,
which the kernel reclaims under pressure). Prints one table row per run.

    python benchmarks/export.py --gigabytes 1 --runs 3
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _plot import Panel, add_plot_option, seconds_panel, write_chart

from ignite_zero import DiskSaver


def _resident(pid: int) -> tuple[int, int]:
    """``(anonymous, file-backed)`` resident bytes of process ``pid``; zeros once it has gone."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    except (FileNotFoundError, ProcessLookupError):
        return 0, 0
    return tuple(int(fields.get(name, "0 kB").split()[0]) * 1024 for name in ("RssAnon", "RssFile"))  # type: ignore


def _export_peak(source: Path, target: Path, dtype: str | None) -> tuple[float, int, int]:
    command = [sys.executable, "-m", "ignite_zero", "export", str(source), str(target)]
    command += ["--dtype", dtype] if dtype else []
    started = time.perf_counter()
    process = subprocess.Popen(command)
    peak_anon = peak_file = 0
    while process.poll() is None:
        anon, mapped = _resident(process.pid)
        peak_anon, peak_file = max(peak_anon, anon), max(peak_file, mapped)
        time.sleep(0.01)
    if process.returncode != 0:
        raise RuntimeError(f"export failed with exit status {process.returncode}")
    return time.perf_counter() - started, peak_anon, peak_file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gigabytes", type=float, default=1.0)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None)
    add_plot_option(parser)
    args = parser.parse_args()
    numel = int(args.gigabytes * 1e9 / 4 / args.tensors)
    with tempfile.TemporaryDirectory(prefix="ignite_zero-export-", dir="/tmp") as tmp:
        state = {"model": {f"layer{i}.weight": torch.randn(numel) for i in range(args.tensors)}}
        DiskSaver(tmp)(state, "checkpoint.pt")
        del state
        source = Path(tmp) / "checkpoint.pt"
        size = source.stat().st_size
        largest = numel * 4
        rows = [_export_peak(source, Path(tmp) / f"out{run}", args.dtype) for run in range(args.runs)]
    print("| checkpoint | largest tensor | seconds (median) | peak anonymous (median) | peak file-backed (median) |")
    print("|---|---|---|---|---|")
    median = [statistics.median(column) for column in zip(*rows)]
    print(
        f"| {size / 2**20:.0f} MiB | {largest / 2**20:.0f} MiB | {median[0]:.2f} | {median[1] / 2**20:.0f} MiB | "
        f"{median[2] / 2**20:.0f} MiB |"
    )
    if args.plot:
        group = f"{size / 2**20:.0f} MiB"
        seconds = seconds_panel("seconds per export", {group: {"export": [row[0] for row in rows]}})
        peaks = {group: {"anonymous": median[1] / 2**20, "file-backed": median[2] / 2**20}}
        write_chart(
            args.plot, "ignite-zero export to safetensors", [seconds, Panel("peak memory (median)", "MiB", peaks)]
        )


if __name__ == "__main__":
    main()
