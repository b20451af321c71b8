"""Saves and loads against the machine's limit: each path's time as a multiple of writing or reading the same bytes
raw, for ZeRO and FSDP2.

    python benchmarks/limit.py                         # ZeRO and FSDP2, 12 x Linear(2048, 2048), 2 ranks, tmpfs
    python benchmarks/limit.py --targets tmpfs disk --runs 6 --plot limit.png
    python benchmarks/limit.py --kinds fsdp2 --layers 4 --paths write sharded read "sharded load"

Every configuration builds ``--layers`` linear layers of ``--width`` x ``--width`` with Adam after one step (12 bytes
per parameter: 0.60 GB of state by default), under ``ZeroRedundancyOptimizer`` (``zero``: every rank holds the model,
the optimizer state is spread over the ranks) or with each layer an FSDP2 unit (``fsdp2``), on ``--world-sizes``
gloo ranks (CPU). Then every path runs once a round, in an order that rotates each round, after a warm-up round:

- ``write`` (floor of the sharded saves): each rank writes its own bytes (its shards, and its share of what every
  rank holds) raw into one file, ``write`` then ``fsync``;
- ``dcp.save``: ``torch.distributed.checkpoint.save`` of the sharded state (FSDP2: ``get_state_dict``; ZeRO: the
  model and each rank's optimizer shard);
- ``sharded``: ``Checkpoint(ShardedSaver)``;
- ``write whole`` (floor of the consolidated saves): rank 0 writes as many bytes as all ranks hold, raw;
- ``consolidated``: ``Checkpoint(DiskSaver)``, gathered on rank 0;
- ``torch full``: torch's own full-state path: FSDP2, ``get_state_dict(full_state_dict=True, cpu_offload=True)``
  then ``torch.save`` and ``fsync`` on rank 0; ZeRO, ``torch.save`` and ``fsync`` of the state consolidated beforehand;
- ``read`` (floor of the loads): each rank reads the bytes it needs with ``readinto``, into its tensors (its shards;
  ZeRO ranks also the whole model, which every rank holds);
- ``dcp.load``: ``dcp.load`` of the ``dcp.save`` directory into the sharded state (FSDP2: then ``set_state_dict``);
- ``sharded load`` and ``consolidated load``: ``Checkpoint.load_objects`` of a checkpoint written by ``sharded`` and
  by ``consolidated`` before the rounds.

Each target is a directory: ``tmpfs`` is ``/dev/shm`` (no disk: software alone is measured), ``disk`` is ``--disk`` (the
temporary directory or ``IGNITE_ZERO_BENCH_DIR`` by default); every load, the floor's included, reads a copy of what it
loads made just before it, read through once untimed on tmpfs, flushed and dropped from the page cache on disk
(``posix_fadvise``), so that it reads the disk: how fast a file reads from tmpfs depends on the pages the kernel gave it
(the same 300 MB read in 57-58 ms from the last of six files written one after the other, 76-78 ms from the first), and
files written once before the rounds favoured the last one, the floor's; a first read right after the write is slower
too (the floor 0.089 s, 0.072 s read again). A path's time in a round is its worst rank's (an operation ends when every
rank's does); the table gives the median of those, and each path's median [min-max] of its per-round ratios to its floor
(and to the path it must beat). The last line holds the median x-floor ratios of every configuration.
``--plot PATH`` draws seconds per path against its floor (needs matplotlib: ``pip install -e '.[benchmarks]'``).
``--profile N`` runs each path once after a warm-up, under cProfile on every rank, and prints the N functions that
took the most time of their own, instead of the table; ``--memory`` runs each path once after a warm-up, and prints
the growth of every rank's resident memory during it (sampled, see ``_common.measure``) against the bytes the rank
holds.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import os
import pstats
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _common import (
    LinearAdam,
    Measurement,
    copy_fresh,
    empty_except,
    launch,
    measure,
    scratch_directory,
    summary,
    worst_rank,
)
from _plot import add_plot_option, seconds_panel, write_chart
from ignite.engine import Engine

from ignite_zero import Checkpoint, DiskSaver, ShardedSaver

#: Each path, and the floor its ratios are taken against.
FLOORS = {
    "write": "write",
    "dcp.save": "write",
    "sharded": "write",
    "write whole": "write whole",
    "consolidated": "write whole",
    "torch full": "write whole",
    "read": "read",
    "dcp.load": "read",
    "sharded load": "read",
    "consolidated load": "read",
}
#: The path each must beat, as the goals state them.
RIVALS = {"sharded": "dcp.save", "sharded load": "dcp.load", "consolidated": "torch full"}
PATHS = tuple(FLOORS)
KINDS = ("zero", "fsdp2")
TARGETS = ("tmpfs", "disk")
LOADS = ("read", "dcp.load", "sharded load", "consolidated load")

Times = dict[str, list[float]]


def _raw(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor, without a copy."""
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def _write_raw(path: Path, tensors: list[torch.Tensor], total: int) -> None:
    """Write ``total`` bytes of ``tensors`` (again from the first once they are all written), then fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        written = 0
        while written < total:
            for tensor in tensors:
                view = _raw(tensor)[: total - written]
                while view.nbytes:
                    done = os.write(fd, view)
                    written += done
                    view = view[done:]
                if written >= total:
                    break
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_raw(path: Path, tensors: list[torch.Tensor]) -> None:
    with open(path, "rb", buffering=0) as f:
        for tensor in tensors:
            view = _raw(tensor)
            while view.nbytes:
                done = f.readinto(view)
                if not done:
                    raise EOFError(f"{path} ends early")
                view = view[done:]


def _rank(
    rank: int,
    world_size: int,
    kind: str,
    layers: int,
    width: int,
    runs: int,
    directory: Path,
    paths: tuple[str, ...],
    cold: bool,
    profile: int,
    memory: bool,
) -> Times | dict[str, str]:
    """Every path of ``paths`` in interleaved rounds; ``cold``: loads read from the disk, not the page cache.
    ``profile``: each path once after a warm-up instead, under cProfile: its ``profile`` costliest functions.
    ``memory``: each path once after a warm-up instead, its growth of this rank's memory against the rank's bytes."""
    setup = LinearAdam(kind, layers, width, rank, world_size)
    out, kept = directory / "out", directory / "kept"
    engine = Engine(lambda e, b: None)

    def checkpoint(saver: Any) -> Checkpoint:
        return Checkpoint(setup.objects, saver, n_saved=None)

    sharded_saver, consolidated_saver = out / "sharded", out / "consolidated"
    sharded = checkpoint(ShardedSaver(sharded_saver, require_empty=False))
    consolidated = checkpoint(DiskSaver(consolidated_saver, require_empty=False))
    # what the loads read, written once
    engine.state.iteration = 1
    kept_sharded = checkpoint(ShardedSaver(kept / "sharded", require_empty=False))
    kept_sharded(engine)
    kept_consolidated = checkpoint(DiskSaver(kept / "consolidated", require_empty=False))
    kept_consolidated(engine)
    dcp.save(setup.dcp_state(), checkpoint_id=kept / "dcp")
    _write_raw(kept / f"raw{rank}", setup.needed, setup.needed_bytes)
    sharded_path, consolidated_path = kept_sharded.last_checkpoint, kept_consolidated.last_checkpoint
    assert sharded_path is not None and consolidated_path is not None
    # what each load reads, copied afresh before it into `loaded`: each rank its own raw file, rank 0 the rest
    kept_reads = {
        "read": kept / f"raw{rank}",
        "dcp.load": kept / "dcp",
        "sharded load": Path(sharded_path),
        "consolidated load": Path(consolidated_path),
    }
    loaded = {name: out / "loaded" / source.name for name, source in kept_reads.items()}

    def fresh(name: str) -> Path:
        return out / f"{name}-{engine.state.iteration}"

    operations: dict[str, Callable[[], None]] = {
        "write": lambda: _write_raw(fresh(f"raw{rank}"), setup.own, setup.own_bytes),
        "dcp.save": lambda: dcp.save(setup.dcp_state(), checkpoint_id=fresh("dcp")),
        "sharded": lambda: sharded(engine),
        "write whole": lambda: _write_raw(fresh("whole"), setup.own, setup.total_bytes) if rank == 0 else None,
        "consolidated": lambda: consolidated(engine),
        "torch full": lambda: setup.torch_full(rank, fresh("full.pt")),
        "read": lambda: _read_raw(loaded["read"], setup.needed),
        "dcp.load": lambda: setup.dcp_load(loaded["dcp.load"]),
        "sharded load": lambda: Checkpoint.load_objects(setup.objects, loaded["sharded load"]),
        "consolidated load": lambda: Checkpoint.load_objects(setup.objects, loaded["consolidated load"]),
    }

    def run(name: str, profiler: cProfile.Profile | None = None, sampled: list[Measurement] | None = None) -> float:
        engine.state.iteration += 1
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
        if name in LOADS and (name == "read" or rank == 0):
            copy_fresh(kept_reads[name], loaded[name], cold)
        gc.collect()
        dist.barrier()
        if profiler is not None:
            profiler.enable()
        started = time.perf_counter()
        with measure() if sampled is not None else contextlib.nullcontext() as measurement:
            operations[name]()
        elapsed = time.perf_counter() - started
        if sampled is not None:
            sampled.append(measurement)
        if profiler is not None:
            profiler.disable()
        dist.barrier()
        if rank == 0:  # no path pays for removing what an earlier one wrote
            empty_except(out, keep={sharded_saver, consolidated_saver})
        dist.barrier()
        return elapsed

    if profile:
        profiles = {}
        for name in paths:
            run(name)
            profiler = cProfile.Profile()
            elapsed = run(name, profiler)
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(profile)
            profiles[name] = f"{elapsed:.3f} s\n" + text.getvalue().split("\n\n", 1)[-1].strip()
        return profiles
    if memory:
        growths = {}
        for name in paths:
            run(name)
            sampled: list[Measurement] = []
            run(name, sampled=sampled)
            growth, held = sampled[0], setup.needed_bytes if name in LOADS else setup.own_bytes
            growths[name] = (
                f"resident +{growth.growth / 1e6:.0f} MB ({growth.growth / held:.2f} x the {held / 1e6:.0f} MB it "
                f"{'reads' if name in LOADS else 'holds'}), anonymous +{growth.anon_growth / 1e6:.0f} MB "
                f"({growth.anon_growth / held:.2f} x)"
            )
        return growths
    times: Times = {path: [] for path in paths}
    for round_ in range(runs + 1):  # the first round warms up caches, allocators and connections
        for name in paths[round_ % len(paths) :] + paths[: round_ % len(paths)]:
            elapsed = run(name)
            if round_:
                times[name].append(elapsed)
    return times


def _ratios(worst: Times, path: str, against: str) -> tuple[float, float, float] | None:
    """(min, median, max) of ``path``'s per-round ratios to ``against``."""
    if against not in worst:
        return None
    return summary([p / a for p, a in zip(worst[path], worst[against])])


Results = dict[tuple[str, str], list[Times]]


def _table(results: Results) -> str:
    rows = [
        "| kind | target | path | seconds median [min-max] | x floor median [min-max] | x rival |",
        "|---|---|---|---|---|---|",
    ]
    for (kind, target), ranks in results.items():
        worst = worst_rank(ranks)
        for path, values in worst.items():
            low, middle, high = summary(values)
            floor = _ratios(worst, path, FLOORS[path])
            floor_text = "-" if floor is None else f"{floor[1]:.2f} [{floor[0]:.2f}-{floor[2]:.2f}]"
            rival = _ratios(worst, path, RIVALS[path]) if path in RIVALS else None
            rival_text = "" if rival is None else f"{rival[1]:.2f} x {RIVALS[path]} [{rival[0]:.2f}-{rival[2]:.2f}]"
            rows.append(
                f"| {kind} | {target} | {path} | {middle:.3f} [{low:.3f}-{high:.3f}] | {floor_text} | {rival_text} |"
            )
    return "\n".join(rows)


def _last_line(results: Results) -> str:
    """The median x-floor ratio of every path that is not a floor, configuration by configuration."""
    parts = []
    for (kind, target), ranks in results.items():
        worst = worst_rank(ranks)
        ratios = [
            f"{path} {ratio[1]:.2f}"
            for path in worst
            if FLOORS[path] != path and (ratio := _ratios(worst, path, FLOORS[path])) is not None
        ]
        parts.append(f"{kind}/{target}: " + ", ".join(ratios))
    return "x floor: " + "; ".join(parts)


def _plot(results: Results, path: str) -> None:
    """Seconds per path (worst rank; median, min-max) beside its floor: the saves, then the loads."""
    saves: dict[str, Times] = {}
    loads: dict[str, Times] = {}
    for (kind, target), ranks in results.items():
        worst = worst_rank(ranks)
        saves[f"{kind}, {target}"] = {path: times for path, times in worst.items() if path not in LOADS}
        loads[f"{kind}, {target}"] = {path: times for path, times in worst.items() if path in LOADS}
    panels = [seconds_panel("saves (floors: write, write whole)", saves), seconds_panel("loads (floor: read)", loads)]
    write_chart(path, "seconds per save and load against writing and reading the bytes raw", panels)


def main(argv: list[str] | None = None) -> None:
    options = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="what is sharded")
    options.add_argument("--targets", nargs="+", choices=TARGETS, default=["tmpfs"], help="where it is written")
    options.add_argument("--disk", type=Path, default=None, help="directory of the disk target")
    options.add_argument("--layers", type=int, default=12, help="linear layers of the model")
    options.add_argument("--width", type=int, default=2048, help="inputs and outputs of each layer")
    options.add_argument("--world-sizes", type=int, nargs="+", default=[2])
    options.add_argument("--runs", type=int, default=4, help="measured rounds after the warm-up round")
    options.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS), help="what to measure")
    add_plot_option(options)
    options.add_argument(
        "--memory", action="store_true", help="instead: each path once, its growth of every rank's resident memory"
    )
    options.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="instead: each path once under cProfile, its N costliest functions on every rank",
    )
    args = options.parse_args(argv)
    paths = tuple(path for path in PATHS if path in args.paths)  # the table's order, whatever the command line's
    results: Results = {}
    for target in args.targets:
        root = Path("/dev/shm") if target == "tmpfs" else (args.disk or scratch_directory())
        directory = root / f"ignite_zero-limit-{os.getpid()}"  # runs side by side never share it
        for kind in args.kinds:
            for world_size in args.world_sizes:
                shutil.rmtree(directory, ignore_errors=True)
                directory.mkdir(parents=True)
                key = (kind, target if len(args.world_sizes) == 1 else f"{target}, {world_size} ranks")
                cold = target == "disk"
                arguments = (
                    kind,
                    args.layers,
                    args.width,
                    args.runs,
                    directory,
                    paths,
                    cold,
                    args.profile,
                    args.memory,
                )
                try:
                    ranks = launch(_rank, world_size, *arguments)
                finally:
                    shutil.rmtree(directory, ignore_errors=True)
                if args.profile or args.memory:
                    for name in paths:
                        for rank, profiles in enumerate(ranks):
                            print(f"{key[0]}, {key[1]}, {name}, rank {rank}: {profiles[name]}\n", flush=True)
                    continue
                results[key] = ranks
                print(f"{key[0]}, {key[1]}:\n{_table({key: results[key]})}\n", flush=True)
    if args.profile or args.memory:
        return
    print(_table(results))
    if args.plot is not None:
        _plot(results, args.plot)
    print(_last_line(results))


if __name__ == "__main__":
    main()
