"""``ignite-zero consolidate`` of a sharded checkpoint: its time and its peak resident memory, against reading the
directory's bytes and writing as many raw.

    python benchmarks/cli_consolidate.py --layers 24                 # 4.8 GB: 24 x Linear(4096, 4096) with Adam
    python benchmarks/cli_consolidate.py --layers 24 60 --runs 3     # and 12 GB

Each size is saved once by ``ShardedSaver`` on 2 gloo ranks (FSDP2, each layer a unit, Adam after one step), then
``--runs`` rounds alternate two paths, each in a process of its own:

- ``consolidate``: ``ignite-zero consolidate DIR FILE``, which checks every entry as it reads and writes the file
  durably (temporary name, fsync, rename);
- ``raw``: the floor, every file of the directory read with ``readinto`` and as many bytes written to one new file
  with ``write`` and fsync.

The table gives each path's median seconds, its ratio to the floor's, and the peak resident memory of the process
(``ru_maxrss``; the page cache is not counted). ``--plot PATH`` also draws both as a PNG. Set
``IGNITE_ZERO_BENCH_DIR`` to write elsewhere than the temporary directory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from _common import fsdp2_adam_after_one_step, launch, scratch_directory
from _plot import Panel, add_plot_option, seconds_panel, write_chart
from ignite.engine import Engine

from ignite_zero import Checkpoint, ShardedSaver

_WIDTH = 4096
_RAW_CHUNK = 64 << 20


def _save(rank: int, world_size: int, layers: int, directory: Path) -> None:
    model, optimizer = fsdp2_adam_after_one_step(layers * (_WIDTH * _WIDTH + _WIDTH), width=_WIDTH)
    Checkpoint({"model": model, "optimizer": optimizer}, ShardedSaver(directory))(Engine(lambda e, b: None))


def _raw(source: Path, target: Path) -> None:
    """Read every file of ``source`` and write as many bytes to ``target``, flushed to disk."""
    buffer = bytearray(_RAW_CHUNK)
    view = memoryview(buffer)
    with open(target, "wb") as out:
        for path in sorted(source.iterdir()):
            with open(path, "rb", buffering=0) as f:
                while n := f.readinto(view):
                    out.write(view[:n])
        out.flush()
        os.fsync(out.fileno())


def main(argv: list[str] | None = None) -> None:
    options = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_argument("--layers", type=int, nargs="+", default=[24], help="Linear(4096, 4096) layers")
    options.add_argument("--runs", type=int, default=3, help="rounds of both paths")
    options.add_argument("--raw", nargs=2, type=Path, metavar=("DIR", "FILE"), help="only the raw path, once")
    add_plot_option(options)
    args = options.parse_args(argv)
    if args.raw:
        _raw(*args.raw)
        return
    root = scratch_directory() / "ignite_zero-cli-consolidate"
    print("| state | consolidate s | raw read + write s | x raw | consolidate peak RSS | raw peak RSS |")
    print("|---|---|---|---|---|---|")
    runs: dict[str, dict[str, list[float]]] = {}  # by state, by path: seconds of each round
    peak_memory: dict[str, dict[str, float]] = {}  # by state, by path: GB
    for layers in args.layers:
        shutil.rmtree(root, ignore_errors=True)
        launch(_save, 2, layers, root / "ckpt")
        (directory,) = (root / "ckpt").glob("*.dcp")
        size = sum(path.stat().st_size for path in directory.iterdir())
        paths = {
            "consolidate": [sys.executable, "-m", "ignite_zero", "consolidate", str(directory), str(root / "one.pt")],
            "raw": [sys.executable, __file__, "--raw", str(directory), str(root / "raw")],
        }
        seconds: dict[str, list[float]] = {name: [] for name in paths}
        peaks: dict[str, int] = {}
        for round_ in range(args.runs):
            for name in list(paths)[round_ % 2 :] + list(paths)[: round_ % 2]:
                for leftover in (root / "one.pt", root / "raw"):
                    leftover.unlink(missing_ok=True)
                elapsed, peak = _measured(paths[name])
                seconds[name].append(elapsed)
                peaks[name] = max(peaks.get(name, 0), peak)
        group = f"{size / 1e9:.2f} GB"
        runs[group] = seconds
        peak_memory[group] = {name: peak / 1e9 for name, peak in peaks.items()}
        ours, raw = statistics.median(seconds["consolidate"]), statistics.median(seconds["raw"])
        print(
            f"| {size / 1e9:.2f} GB ({layers} layers) | {ours:.1f} | {raw:.1f} | {ours / raw:.2f} | "
            f"{peaks['consolidate'] / 1e9:.2f} GB | {peaks['raw'] / 1e9:.2f} GB |",
            flush=True,
        )
    shutil.rmtree(root, ignore_errors=True)
    if args.plot:
        panels = [seconds_panel("seconds (median, min-max)", runs), Panel("peak resident memory", "GB", peak_memory)]
        write_chart(args.plot, "ignite-zero consolidate against a raw read and write", panels)


def _measured(command: list[str]) -> tuple[float, int]:
    """Seconds and peak resident bytes of ``command``, through a process of its own that runs it and reports its
    child's ``ru_maxrss`` (a parent's covers every child it ever had: each path needs a parent of its own)."""
    wrapper = (
        "import resource, subprocess, sys, time; started = time.perf_counter(); "
        "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
        "print(time.perf_counter() - started, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)"
    )
    out = subprocess.run([sys.executable, "-c", wrapper, *command], check=True, capture_output=True, text=True)
    elapsed, peak = out.stdout.split()
    return float(elapsed), int(peak)


if __name__ == "__main__":
    main()
