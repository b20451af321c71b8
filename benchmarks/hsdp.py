"""Consolidated save of HSDP state: ignite_zero's ``Checkpoint`` against torch's own full state dict written by
rank 0.

    python benchmarks/hsdp.py                        # 25M and 100M parameters, 4 ranks (a 2 x 2 mesh)
    python benchmarks/hsdp.py --params 100e6 --runs 7

Every configuration shards linear layers of 2048 x 2048 with FSDP2 over a 2 x 2 device mesh (HSDP: placements
``(Replicate(), Shard(0))``), trains one step of Adam on 4 gloo ranks (CPU), then saves ``{"model", "optimizer"}``
(12 bytes per parameter) again and again, interleaving two paths after a warm-up round:

- ``ignite_zero``: ``ignite_zero.Checkpoint(consolidate_recipient_rank=0)`` with its ``DiskSaver``: agreement,
  each block gathered once to rank 0 from one replica, integrity trailer, fsync of file and directory;
- ``get_state_dict``: ``get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True,
  cpu_offload=True))`` on every rank, then ``torch.save`` of both on rank 0 and an fsync.

The table gives min/median/max seconds, each path's median against ``get_state_dict``'s (target: at most 1.2),
and the peak growth of resident memory on rank 0 and on the worst other rank, sampled every 5 ms (see
``_common.py``). Set ``IGNITE_ZERO_BENCH_DIR`` to write elsewhere than the temporary directory. ``--plot PATH``
also writes them as a PNG chart.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import each_configuration, fsdp2_adam_after_one_step, interleaved, measure, parser, summary
from _plot import save_panels, write_chart
from ignite.engine import Engine
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh

from ignite_zero import Checkpoint, DiskSaver
from ignite_zero.storage.places import fsync_path

PATHS = ("ignite_zero", "get_state_dict")


def _rank(rank: int, world_size: int, count: int, runs: int, directory: Path, *paths: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    model, optimizer = fsdp2_adam_after_one_step(count, mesh=mesh)
    to_save = {"model": model, "optimizer": optimizer}
    ours = Checkpoint(
        to_save, DiskSaver(directory / "ours", require_empty=False), n_saved=None, consolidate_recipient_rank=0
    )
    engine = Engine(lambda e, b: None)

    def save_ours() -> None:
        engine.state.iteration += 1
        ours(engine)

    def save_torch() -> None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
        if rank == 0:
            path = directory / "torch.pt"
            torch.save({"model": model_state, "optimizer": optimizer_state}, path)
            fsync_path(path)

    operations = {"ignite_zero": save_ours, "get_state_dict": save_torch}
    records: dict[str, list[tuple[float, int]]] = {path: [] for path in paths}
    for measured, name in interleaved(paths, runs):
        dist.barrier()
        with measure() as measurement:
            operations[name]()
        dist.barrier()
        if measured:
            records[name].append((measurement.seconds, measurement.growth))
        if rank == 0:
            for leftover in directory.rglob("*.pt"):
                leftover.unlink()
    return {"records": records}


def _table(results: dict[tuple[int, int], list[dict[str, Any]]]) -> str:
    rows = [
        "| parameters | ranks | path | seconds min / median / max | x get_state_dict | rank 0 growth (GB) "
        "| worst other rank growth (GB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for (count, world_size), ranks in sorted(results.items()):
        recipient = ranks[0]["records"]
        medians = {path: statistics.median(s for s, _ in recipient[path]) for path in recipient}
        for path in recipient:
            seconds = summary([s for s, _ in recipient[path]])
            growth = max(g for _, g in recipient[path])
            worst = max(max(g for _, g in ranks[r]["records"][path]) for r in range(1, world_size))
            versus = f"{medians[path] / medians['get_state_dict']:.2f}" if "get_state_dict" in medians else "-"
            rows.append(
                f"| {count / 1e6:.0f}M | {world_size} | {path} "
                f"| {seconds[0]:.2f} / {seconds[1]:.2f} / {seconds[2]:.2f} | {versus} "
                f"| {growth / 1e9:.2f} | {worst / 1e9:.2f} |"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    command = parser(__doc__, [25e6, 100e6], PATHS)
    command.set_defaults(world_sizes=[4])
    args = command.parse_args(argv)
    if any(size % 2 or size < 4 for size in args.world_sizes):
        command.error("HSDP needs a 2 x N mesh: world sizes of 4, 6, 8...")
    results = each_configuration(_rank, args, "hsdp", _table)
    if args.plot:
        write_chart(args.plot, "Consolidated save of HSDP state: ignite_zero and get_state_dict", save_panels(results))


if __name__ == "__main__":
    main()
