"""Sharded and asynchronous saves: ignite_zero against a raw ``dcp.save`` and against its own synchronous saves.

    python benchmarks/sharded.py                          # 100M parameters on 2 and 4 ranks
    python benchmarks/sharded.py --params 25e6 --world-sizes 2 --runs 3

Every configuration trains one step of Adam under ``ZeroRedundancyOptimizer`` on gloo ranks (CPU), then saves
``{"model", "optimizer"}`` again and again, interleaving the paths after a warm-up round:

- ``dcp.save``: the floor of a sharded save: ``torch.distributed.checkpoint.save`` of exactly what
  ignite_zero's sharded save writes (every rank its optimizer shard; the model, which every rank holds, once);
- ``sharded``: ``Checkpoint(ShardedSaver(...))``: the same, plus agreement, per-file CRC-32 while writing, the
  sealed manifest, fsync and the rename into place;
- ``consolidated``: ``Checkpoint(DiskSaver(...))``: everything gathered on rank 0, one file;
- ``sharded async`` and ``consolidated async``: the same with ``async_save=True``: the time the training loop
  is blocked (the call's return), then the background write is waited for before the next run;
- ``memcpy``: one copy of what a sharded asynchronous save stages on each rank (its share of the model, which
  every rank holds, and its optimizer shard) into buffers allocated beforehand: the least staging has to do, and
  the yardstick of the asynchronous stall.

It prints the median (and min/max) over the runs of each path, the worst rank's time for the stall, and the
ratios the targets are stated in: sharded / dcp.save, async stall / memcpy, synchronous save / async stall.
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
    arguments,
    each_configuration,
    summary,
    zero_adam_after_one_step,
)
from ignite.engine import Engine

from ignite_zero import Checkpoint, DiskSaver, ShardedSaver, sharded
from ignite_zero.adapters import ZeROState

PATHS = ("dcp.save", "sharded", "consolidated", "sharded async", "consolidated async", "memcpy")


def _rank(rank: int, world_size: int, count: int, runs: int, directory: Path) -> dict[str, list[float]]:
    model = ZeROParameters(count)
    optimizer = zero_adam_after_one_step(model)
    to_save = {"model": model, "optimizer": optimizer}
    engine = Engine(lambda e, b: None)

    def saver(kind: str, async_save: bool) -> Checkpoint:
        cls = ShardedSaver if kind == "sharded" else DiskSaver
        return Checkpoint(
            to_save, cls(directory / f"{kind}{async_save}", require_empty=False), n_saved=None, async_save=async_save
        )

    handlers = {
        "sharded": saver("sharded", False),
        "consolidated": saver("consolidated", False),
        "sharded async": saver("sharded", True),
        "consolidated async": saver("consolidated", True),
    }
    # what a sharded asynchronous save stages on this rank: its share of the model (which every rank holds) and its
    # optimizer shard
    share = sharded.share(model.state_dict(), rank, world_size, keeper=0)
    parts = _tensors({"model": share, "optimizer": ZeROState(optimizer).sharded_state_dict()})
    buffers = [torch.empty_like(t) for t in parts]

    def raw_dcp() -> None:
        state = {"model": model.state_dict(), "optimizer": ZeROState(optimizer).sharded_state_dict()}
        dcp.save(state, checkpoint_id=directory / "raw" / str(engine.state.iteration))

    def memcpy() -> None:
        for buffer, tensor in zip(buffers, parts):
            buffer.copy_(tensor)

    times: dict[str, list[float]] = {path: [] for path in PATHS}
    for run in range(runs + 1):  # the first round warms up connections, caches, allocators and staging buffers
        for name in PATHS[run % len(PATHS) :] + PATHS[: run % len(PATHS)]:
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


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for value in state.values() for t in _tensors(value)]
    if isinstance(state, (list, tuple)):
        return [t for value in state for t in _tensors(value)]
    return []


def _table(results: dict[tuple[int, int], list[dict[str, list[float]]]]) -> str:
    rows = [
        "| parameters | ranks | path | seconds min / median / max | ratio |",
        "|---|---|---|---|---|",
    ]
    for (count, world_size), ranks in sorted(results.items()):
        # a rank's save ends when every rank's does; the stall is the worst rank's
        worst = {path: [max(values) for values in zip(*(r[path] for r in ranks))] for path in PATHS}
        median = {path: statistics.median(values) for path, values in worst.items()}
        ratios = {
            "sharded": f"{median['sharded'] / median['dcp.save']:.2f} x dcp.save",
            "sharded async": f"{median['sharded async'] / median['memcpy']:.2f} x memcpy, "
            f"{median['sharded'] / median['sharded async']:.0f}x less than synchronous",
            "consolidated async": f"{median['consolidated async'] / median['memcpy']:.2f} x memcpy, "
            f"{median['consolidated'] / median['consolidated async']:.0f}x less than synchronous",
            "consolidated": f"{median['consolidated'] / median['dcp.save']:.2f} x dcp.save",
        }
        for path in PATHS:
            low, middle, high = summary(worst[path])
            rows.append(
                f"| {count / 1e6:.0f}M | {world_size} | {path} | {low:.3f} / {middle:.3f} / {high:.3f} "
                f"| {ratios.get(path, '')} |"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    args = arguments(__doc__, [100e6], argv)
    each_configuration(_rank, args, "sharded", _table)


if __name__ == "__main__":
    main()
