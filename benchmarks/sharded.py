"""Sharded and asynchronous saves: ignite_zero against a raw ``dcp.save`` and against its own synchronous saves.

    python benchmarks/sharded.py             # sharded / dcp.save: ZeRO and FSDP2, 50M parameters, 2 and 4 ranks,
                                             # tmpfs and disk (how long: docs/benchmarks.rst)
    python benchmarks/sharded.py --paths dcp.save sharded consolidated "sharded async" "consolidated async" memcpy
    python benchmarks/sharded.py --kinds fsdp2 --targets tmpfs --world-sizes 2 --params 25e6 --runs 15

Every configuration trains one step of Adam on gloo ranks (CPU), under ``ZeroRedundancyOptimizer`` (``zero``: the
model in tensors of 4M parameters) or on a model of 2048 x 2048 linear layers, each an FSDP2 unit (``fsdp2``), then
saves ``{"model", "optimizer"}`` (12 bytes per parameter) again and again, interleaving the paths (their order
rotates every round) after a warm-up round; ``--paths`` picks them, ``dcp.save`` and ``sharded`` by default:

- ``dcp.save``: the floor of a sharded save: ``torch.distributed.checkpoint.save`` of exactly what
  ignite_zero's sharded save writes (ZeRO: every rank its optimizer shard, the model, which every rank holds,
  once; FSDP2: every rank its shards of both);
- ``sharded``: ``Checkpoint(ShardedSaver(...))``: the same, plus agreement, per-file CRC-32 while writing, the
  sealed manifest, fsync and the rename into place;
- ``consolidated``: ``Checkpoint(DiskSaver(...))``: everything gathered on rank 0, one file;
- ``sharded async`` and ``consolidated async``: the same with ``async_save=True``: the time the training loop
  is blocked (the call's return), then the background write is waited for before the next run;
- ``memcpy``: one copy of what a sharded asynchronous save stages on each rank (ZeRO: its share of the model and
  its optimizer shard; FSDP2: its shards) into buffers allocated beforehand: the least staging has to do, and
  the yardstick of the asynchronous stall.

Each target is a directory: ``tmpfs`` is ``/dev/shm`` (memory: what ignite_zero adds shows undiluted), ``disk``
the temporary directory or ``IGNITE_ZERO_BENCH_DIR``. A save's time is its worst rank's. The table gives each
path's min / median / max over the runs, and the ratios the targets are stated in: sharded / dcp.save as the
median [min-max] of the ratios of the two within each round (a round's two saves see the same machine), async
stall / memcpy, synchronous save / async stall. A summary of sharded / dcp.save ends the run. ``--plot PATH`` also
writes the seconds per save as a PNG chart.
"""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _common import (
    ZeROParameters,
    fsdp2_adam_after_one_step,
    launch,
    local_tensors,
    parser,
    scratch_directory,
    summary,
    worst_rank,
    zero_adam_after_one_step,
)
from _plot import seconds_panel, write_chart
from ignite.engine import Engine

from ignite_zero import Checkpoint, DiskSaver, ShardedSaver
from ignite_zero.adapters import ZeROState
from ignite_zero.adapters.fsdp import FSDPModelState, FSDPOptimizerState
from ignite_zero.storage.savers.sharded import share

PATHS = ("dcp.save", "sharded", "consolidated", "sharded async", "consolidated async", "memcpy")
KINDS = ("zero", "fsdp2")
TARGETS = ("tmpfs", "disk")

Results = dict[tuple[str, str, int, int], list[dict[str, list[float]]]]


def _state(kind: str, count: int, rank: int, world_size: int) -> tuple[dict[str, Any], Any, list[torch.Tensor]]:
    """What to save, the function giving what ``dcp.save`` writes for the floor, and what a rank stages."""
    if kind == "zero":
        model = ZeROParameters(count)
        optimizer = zero_adam_after_one_step(model)

        def floor() -> dict[str, Any]:
            return {"model": model.state_dict(), "optimizer": ZeROState(optimizer).sharded_state_dict()}

        # its share of the model (which every rank holds) and its optimizer shard
        part = share(model.state_dict(), rank, world_size, keeper=0)
        staged = local_tensors({"model": part, "optimizer": ZeROState(optimizer).sharded_state_dict()})
    else:
        model, optimizer = fsdp2_adam_after_one_step(count)
        model_state, optimizer_state = FSDPModelState(model, 0), FSDPOptimizerState(model, optimizer, 0)

        def floor() -> dict[str, Any]:
            return {"model": model_state.sharded_state_dict(), "optimizer": optimizer_state.sharded_state_dict()}

        staged = local_tensors(floor())
    return {"model": model, "optimizer": optimizer}, floor, staged


def _rank(
    rank: int, world_size: int, kind: str, count: int, runs: int, directory: Path, paths: tuple[str, ...]
) -> dict[str, list[float]]:
    to_save, floor, staged = _state(kind, count, rank, world_size)
    engine = Engine(lambda e, b: None)

    def saver(sharded_save: bool, async_save: bool) -> Checkpoint:
        cls = ShardedSaver if sharded_save else DiskSaver
        return Checkpoint(
            to_save,
            cls(directory / f"{cls.__name__}{async_save}", require_empty=False),
            n_saved=None,
            async_save=async_save,
        )

    handlers = {
        name: saver(name.startswith("sharded"), name.endswith("async"))
        for name in paths
        if name not in ("dcp.save", "memcpy")
    }
    buffers = [torch.empty_like(t) for t in staged] if "memcpy" in paths else []

    def raw_dcp() -> None:
        dcp.save(floor(), checkpoint_id=directory / "raw" / str(engine.state.iteration))

    def memcpy() -> None:
        for buffer, tensor in zip(buffers, staged):
            buffer.copy_(tensor)

    times: dict[str, list[float]] = {path: [] for path in paths}
    for run in range(runs + 1):  # the first round warms up connections, caches, allocators and staging buffers
        for name in paths[run % len(paths) :] + paths[: run % len(paths)]:
            engine.state.iteration += 1
            dist.barrier()
            started = time.perf_counter()
            if name == "dcp.save":
                raw_dcp()
            elif name == "memcpy":
                memcpy()
            else:
                handlers[name](engine)
            elapsed = time.perf_counter() - started
            if name.endswith("async"):
                handlers[name].wait()  # the write goes on in the background; the next run waits for it
            dist.barrier()
            if run:
                times[name].append(elapsed)
            if rank == 0:  # no path pays for removing what an earlier one wrote
                for written in (child for saver in directory.iterdir() for child in saver.iterdir()):
                    shutil.rmtree(written) if written.is_dir() else written.unlink()
            dist.barrier()
    return times


def _ratio(worst: dict[str, list[float]]) -> tuple[float, float, float]:
    """sharded / dcp.save: (min, median, max) of the ratios within each round."""
    return summary([s / d for s, d in zip(worst["sharded"], worst["dcp.save"])])


def _table(results: Results) -> str:
    rows = [
        "| kind | target | parameters | ranks | path | seconds min / median / max | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for (kind, target, count, world_size), ranks in results.items():
        worst = worst_rank(ranks)
        median = {path: statistics.median(values) for path, values in worst.items()}
        ratios = {}
        if {"sharded", "dcp.save"} <= median.keys():
            low, middle, high = _ratio(worst)
            ratios["sharded"] = f"{middle:.2f} x dcp.save [{low:.2f}-{high:.2f}]"
        if {"consolidated", "dcp.save"} <= median.keys():
            ratios["consolidated"] = f"{median['consolidated'] / median['dcp.save']:.2f} x dcp.save"
        for mode in ("sharded", "consolidated"):
            if {f"{mode} async", "memcpy"} <= median.keys():
                ratios[f"{mode} async"] = f"{median[f'{mode} async'] / median['memcpy']:.2f} x memcpy"
                if mode in median:
                    ratios[f"{mode} async"] += f", {median[mode] / median[f'{mode} async']:.0f}x less than synchronous"
        for path, values in worst.items():
            low, middle, high = summary(values)
            rows.append(
                f"| {kind} | {target} | {count / 1e6:.0f}M | {world_size} | {path} "
                f"| {low:.3f} / {middle:.3f} / {high:.3f} | {ratios.get(path, '')} |"
            )
    return "\n".join(rows)


def _summary_table(results: Results) -> str:
    rows = [
        "| kind | target | parameters | ranks | dcp.save s | sharded s | sharded / dcp.save median [min-max] |",
        "|---|---|---|---|---|---|---|",
    ]
    for (kind, target, count, world_size), ranks in results.items():
        worst = worst_rank(ranks)
        low, middle, high = _ratio(worst)
        rows.append(
            f"| {kind} | {target} | {count / 1e6:.0f}M | {world_size} | {statistics.median(worst['dcp.save']):.3f} "
            f"| {statistics.median(worst['sharded']):.3f} | {middle:.2f} [{low:.2f}-{high:.2f}] |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    options = parser(__doc__, [50e6], PATHS)
    options.set_defaults(paths=["dcp.save", "sharded"], runs=9)  # all six paths take 3 times as long
    options.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="what is sharded")
    options.add_argument("--targets", nargs="+", choices=TARGETS, default=list(TARGETS), help="where it is written")
    args = options.parse_args(argv)
    paths = tuple(path for path in PATHS if path in args.paths)  # the table's order, whatever the command line's
    results: Results = {}
    for target in args.targets:
        directory = (Path("/dev/shm") if target == "tmpfs" else scratch_directory()) / "ignite_zero-sharded"
        for kind in args.kinds:
            for count in map(int, args.params):
                for world_size in args.world_sizes:
                    shutil.rmtree(directory, ignore_errors=True)
                    directory.mkdir(parents=True)
                    key = (kind, target, count, world_size)
                    results[key] = launch(_rank, world_size, kind, count, args.runs, directory, paths)
                    print(f"{kind}, {target}, {count / 1e6:.0f}M parameters on {world_size} ranks:", flush=True)
                    print(_table({key: results[key]}) + "\n", flush=True)
        shutil.rmtree(directory, ignore_errors=True)
    if {"sharded", "dcp.save"} <= set(paths):
        print(f"sharded / dcp.save:\n{_summary_table(results)}")
    if args.plot:
        runs = {
            f"{kind}, {target}, {count / 1e6:.0f}M, {world_size} ranks": worst_rank(ranks)
            for (kind, target, count, world_size), ranks in results.items()
        }
        write_chart(args.plot, "sharded and asynchronous saves (worst rank)", [seconds_panel("seconds per save", runs)])


if __name__ == "__main__":
    main()
