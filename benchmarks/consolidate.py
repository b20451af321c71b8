"""Consolidated save of ZeRO state: ignite_zero's ``Checkpoint`` against ignite 0.5.5's and a single-process
``torch.save``.

    python benchmarks/consolidate.py                                   # 25M and 100M parameters, 2 and 4 ranks
    python benchmarks/consolidate.py --params 25e6 100e6 250e6 --runs 5

Every configuration trains one step of Adam under ``ZeroRedundancyOptimizer`` on ``--world-sizes`` gloo ranks
(CPU), then saves ``{"model", "optimizer"}`` (a file of 12 bytes per parameter) again and again, interleaving
three paths after a warm-up round:

- ``ignite_zero``: ``ignite_zero.Checkpoint(consolidate_recipient_rank=0)`` with its ``DiskSaver``: agreement,
  gather to rank 0, integrity trailer, fsync of file and directory;
- ``ignite``: ``ignite.handlers.Checkpoint(save_on_rank=0)`` with ignite's ``DiskSaver``, which consolidates
  with ``ZeroRedundancyOptimizer.consolidate_state_dict``;
- ``torch.save``: the floor, one process writing the same consolidated state, plus an fsync.

``--plot PATH`` also writes the medians (with min and max) and the memory growth as a PNG chart.

The table gives min/median/max seconds, GB/s (file size / median), each path's median against the floor's
and ignite's, and the peak growth of resident memory on the recipient (against the full state) and on the
worst other rank (against its optimizer shard), sampled every 5 ms (see ``_common.py``). The floor is timed
alone, while the other ranks wait. Set ``IGNITE_ZERO_BENCH_DIR`` to write elsewhere than the temporary
directory.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import (
    ZeROParameters,
    each_configuration,
    interleaved,
    measure,
    parser,
    summary,
    zero_adam_after_one_step,
)
from _plot import save_panels, write_chart
from ignite.engine import Engine
from ignite.handlers import Checkpoint as IgniteCheckpoint
from ignite.handlers import DiskSaver as IgniteDiskSaver

from ignite_zero import Checkpoint, DiskSaver
from ignite_zero.adapters import ZeROState
from ignite_zero.storage.places import fsync_path

PATHS = ("ignite_zero", "ignite", "torch.save")


def _rank(rank: int, world_size: int, count: int, runs: int, directory: Path, *paths: str) -> dict[str, Any]:
    model = ZeROParameters(count)
    optimizer = zero_adam_after_one_step(model)
    to_save = {"model": model, "optimizer": optimizer}
    ours = Checkpoint(
        to_save,
        DiskSaver(directory / "ours", require_empty=False),
        n_saved=None,
        consolidate_recipient_rank=0,
    )
    theirs = IgniteCheckpoint(
        to_save,
        IgniteDiskSaver(directory / "ignite", require_empty=False),
        n_saved=None,
        save_on_rank=0,
    )
    # the floor writes what the checkpoint holds, consolidated beforehand on rank 0
    full = {"model": model.state_dict(), "optimizer": ZeROState(optimizer).state_dict()}
    engine = Engine(lambda e, b: None)

    def save_ours() -> Path:
        engine.state.iteration += 1
        ours(engine)
        return Path(ours.last_checkpoint)

    def save_theirs() -> Path:
        engine.state.iteration += 1
        theirs(engine)
        return Path(theirs.last_checkpoint)

    def save_floor() -> Path | None:
        if rank != 0:
            return None
        path = directory / "floor.pt"
        torch.save(full, path)
        fsync_path(path)
        return path

    operations = {
        "ignite_zero": save_ours,
        "ignite": save_theirs,
        "torch.save": save_floor,
    }
    records: dict[str, list[tuple[float, int, int]]] = {path: [] for path in paths}
    for measured, name in interleaved(paths, runs):
        dist.barrier()
        with measure() as measurement:
            written = operations[name]()
        dist.barrier()
        size = written.stat().st_size if rank == 0 else 0
        if measured and (rank == 0 or name != "torch.save"):
            records[name].append((measurement.seconds, measurement.growth, size))
        if rank == 0:
            for leftover in directory.rglob("*.pt"):
                leftover.unlink()
    shard = sum(t.numel() * t.element_size() for s in optimizer.optim.state.values() for t in s.values() if t.dim())
    return {"records": records, "shard": shard}


def _table(results: dict[tuple[int, int], list[dict[str, Any]]]) -> str:
    rows = [
        "| parameters | ranks | path | seconds min / median / max | GB/s | x floor | ignite / path | recipient growth "
        "(x full state) | worst other rank growth (% of its shard) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (count, world_size), ranks in sorted(results.items()):
        recipient = ranks[0]["records"]
        medians = {path: statistics.median(s for s, _, _ in recipient[path]) for path in recipient}
        size = recipient["torch.save"][0][2]
        for path in recipient:
            seconds = summary([s for s, _, _ in recipient[path]])
            growth = max(g for _, g, _ in recipient[path])
            others = "-"
            if path != "torch.save" and world_size > 1:
                worst = max(
                    max(g for _, g, _ in ranks[r]["records"][path]) / ranks[r]["shard"] for r in range(1, world_size)
                )
                others = f"{100 * worst:.1f}%"
            versus_ignite = f"{medians['ignite'] / medians[path]:.1f}" if "ignite" in medians else "-"
            rows.append(
                f"| {count / 1e6:.0f}M | {world_size} | {path} "
                f"| {seconds[0]:.2f} / {seconds[1]:.2f} / {seconds[2]:.2f} "
                f"| {size / 1e9 / seconds[1]:.2f} | {medians[path] / medians['torch.save']:.2f} "
                f"| {versus_ignite} | {growth / 1e9:.2f} GB ({growth / size:.2f}) | {others} |"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    command = parser(__doc__, [25e6, 100e6], PATHS)
    args = command.parse_args(argv)
    results = each_configuration(_rank, args, "consolidate", _table)
    if args.plot:
        title = "Consolidated save of ZeRO (Adam) state: ignite_zero, ignite 0.5.5, and torch.save in one process"
        write_chart(args.plot, title, save_panels(results))


if __name__ == "__main__":
    main()
