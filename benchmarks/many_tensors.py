"""States of many small tensors: what each entry costs a save and a load, against torch's own ways of doing them.

    python benchmarks/many_tensors.py                       # FSDP2, 1000 x Linear(64, 64) with Adam, 2 ranks, tmpfs
    python benchmarks/many_tensors.py --layers 125 1000 4000 --runs 2 --plot many_tensors.png
    python benchmarks/many_tensors.py --kinds zero fsdp2 --paths "sharded save" torch.save

Every configuration builds ``--layers`` linear layers of ``--width`` x ``--width`` with Adam after one step, each an
FSDP2 unit (``fsdp2``: eight entries a layer, the weight and bias and Adam's ``step``, ``exp_avg`` and
``exp_avg_sq`` of each: 1000 layers make 8,000) or under ``ZeroRedundancyOptimizer`` (``zero``), on ``--world-size``
gloo ranks (CPU), writing to ``/dev/shm`` (no disk: software alone is measured). Then every path runs once a round,
in an order that rotates each round, after a warm-up round:

- ``sharded save``: ``Checkpoint(ShardedSaver)``, against ``torch.save`` (each rank ``torch.save``\\ s the list of
  its own shards to a file of its own, then ``fsync``) and ``dcp.save`` of the sharded state;
- ``sharded load``: ``Checkpoint.load_objects`` of a sharded checkpoint into the live objects, against
  ``torch.load`` (each rank loads what it needs from its file and copies it into its tensors) and ``dcp.load`` (then
  ``set_state_dict`` for FSDP2);
- ``consolidated save``: ``Checkpoint(DiskSaver)``, gathered on rank 0, against ``torch full``: torch's full-state
  path, ``get_state_dict(full_state_dict=True, cpu_offload=True)`` then one ``torch.save`` and ``fsync`` on rank 0
  (ZeRO: of the state consolidated beforehand).

Every load reads a copy of what it loads made just before it and read through once, untimed. A path's time in a round
is its worst rank's (an operation ends when every rank's does); the table gives the median [min-max] of those, the
median's cost per entry of the state (ms/entry), and the median [min-max] of its per-round ratios to each anchor.
``--layers`` takes several counts to show how the cost grows (125, 1000 and 4000 layers make about 1,000, 8,000 and
32,000 entries for FSDP2); ``--plot PATH`` draws each path's seconds against the state's entries, log-log (needs
matplotlib: ``pip install -e '.[benchmarks]'``).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _common import LinearAdam, copy_fresh, empty_except, interleaved, launch, local_tensors, summary, worst_rank
from _plot import add_plot_option, write_growth_chart
from ignite.engine import Engine

from ignite_zero import Checkpoint, DiskSaver, ShardedSaver
from ignite_zero.storage.places import fsync_path

#: The paths each of ours is compared with.
ANCHORS = {
    "sharded save": ("torch.save", "dcp.save"),
    "sharded load": ("torch.load", "dcp.load"),
    "consolidated save": ("torch full",),
}
PATHS = tuple(path for ours, anchors in ANCHORS.items() for path in (ours, *anchors))
LOADS = ("sharded load", "torch.load", "dcp.load")
KINDS = ("zero", "fsdp2")

Times = dict[str, list[float]]
#: By ``(kind, layers)``: the state's entries, and each rank's times by path.
Results = dict[tuple[str, int], tuple[int, list[Times]]]


def _load_into(path: Path, tensors: list[torch.Tensor]) -> None:
    """``torch.load`` the list of tensors at ``path`` and copy it into ``tensors``, as a load into live objects does."""
    for target, loaded in zip(tensors, torch.load(path, weights_only=True), strict=True):
        target.copy_(loaded)


def _rank(
    rank: int, world_size: int, kind: str, layers: int, width: int, runs: int, directory: Path, paths: tuple[str, ...]
) -> tuple[int, Times]:
    """Every path of ``paths`` in interleaved rounds; the state's entries and this rank's seconds by path."""
    setup = LinearAdam(kind, layers, width, rank, world_size)
    entries = len(local_tensors(setup.dcp_state()))
    out, kept = directory / "out", directory / "kept"
    engine = Engine(lambda e, b: None)
    sharded_directory, consolidated_directory = out / "sharded", out / "consolidated"
    sharded = Checkpoint(setup.objects, ShardedSaver(sharded_directory, require_empty=False), n_saved=None)
    consolidated = Checkpoint(setup.objects, DiskSaver(consolidated_directory, require_empty=False), n_saved=None)
    # what the loads read, written once
    engine.state.iteration = 1
    kept_sharded = Checkpoint(setup.objects, ShardedSaver(kept / "sharded", require_empty=False), n_saved=None)
    kept_sharded(engine)
    dcp.save(setup.dcp_state(), checkpoint_id=kept / "dcp")
    torch.save(setup.needed, kept / f"tensors{rank}.pt")
    assert kept_sharded.last_checkpoint is not None
    # each rank its own torch.save file, rank 0 the directories every rank reads
    kept_reads = {
        "sharded load": Path(kept_sharded.last_checkpoint),
        "torch.load": kept / f"tensors{rank}.pt",
        "dcp.load": kept / "dcp",
    }
    loaded = {name: out / "loaded" / source.name for name, source in kept_reads.items()}

    def fresh(name: str) -> Path:
        return out / f"{name}-{engine.state.iteration}"

    def torch_save() -> None:
        path = fresh(f"tensors{rank}.pt")
        torch.save(setup.own, path)
        fsync_path(path)

    operations: dict[str, Callable[[], None]] = {
        "sharded save": lambda: sharded(engine),
        "torch.save": torch_save,
        "dcp.save": lambda: dcp.save(setup.dcp_state(), checkpoint_id=fresh("dcp")),
        "sharded load": lambda: Checkpoint.load_objects(setup.objects, loaded["sharded load"]),
        "torch.load": lambda: _load_into(loaded["torch.load"], setup.needed),
        "dcp.load": lambda: setup.dcp_load(loaded["dcp.load"]),
        "consolidated save": lambda: consolidated(engine),
        "torch full": lambda: setup.torch_full(rank, fresh("full.pt")),
    }
    times: Times = {path: [] for path in paths}
    for measured, name in interleaved(paths, runs):
        engine.state.iteration += 1
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
        if name in LOADS and (name == "torch.load" or rank == 0):
            copy_fresh(kept_reads[name], loaded[name], cold=False)
        gc.collect()
        dist.barrier()
        started = time.perf_counter()
        operations[name]()
        elapsed = time.perf_counter() - started
        dist.barrier()
        if rank == 0:  # no path pays for removing what an earlier one wrote
            empty_except(out, keep={sharded_directory, consolidated_directory})
        dist.barrier()
        if measured:
            times[name].append(elapsed)
    return entries, times


def _table(results: Results) -> str:
    rows = [
        "| kind | entries | path | seconds median [min-max] | ms/entry | x anchor median [min-max] |",
        "|---|---|---|---|---|---|",
    ]
    for (kind, _), (entries, ranks) in results.items():
        worst = worst_rank(ranks)
        for path, values in worst.items():
            low, middle, high = summary(values)
            ratios = []
            for anchor in ANCHORS.get(path, ()):
                if anchor in worst:
                    r = summary([ours / theirs for ours, theirs in zip(values, worst[anchor])])
                    ratios.append(f"{r[1]:.2f} x {anchor} [{r[0]:.2f}-{r[2]:.2f}]")
            rows.append(
                f"| {kind} | {entries:,} | {path} | {middle:.3f} [{low:.3f}-{high:.3f}] | "
                f"{middle / entries * 1e3:.3f} | {'; '.join(ratios)} |"
            )
    return "\n".join(rows)


def _plot(results: Results, path: str) -> None:
    """Each path's seconds (worst rank) against the state's entries, a panel a kind."""
    panels: dict[str, dict[str, dict[int, list[float]]]] = {}
    for (kind, _), (entries, ranks) in results.items():
        for name, values in worst_rank(ranks).items():
            panels.setdefault(kind, {}).setdefault(name, {})[entries] = values
    write_growth_chart(path, "seconds per save and load against the entries of the state", panels, "entries")


def main(argv: list[str] | None = None) -> None:
    options = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_argument("--kinds", nargs="+", choices=KINDS, default=["fsdp2"], help="what is sharded")
    options.add_argument("--layers", type=int, nargs="+", default=[1000], help="linear layers of the model")
    options.add_argument("--width", type=int, default=64, help="inputs and outputs of each layer")
    options.add_argument("--world-size", type=int, default=2)
    options.add_argument("--runs", type=int, default=3, help="measured rounds after the warm-up round")
    options.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS), help="what to measure")
    add_plot_option(options)
    args = options.parse_args(argv)
    paths = tuple(path for path in PATHS if path in args.paths)  # the table's order, whatever the command line's
    directory = Path("/dev/shm") / f"ignite_zero-many-tensors-{os.getpid()}"  # runs side by side never share it
    results: Results = {}
    for kind in args.kinds:
        for layers in args.layers:
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir(parents=True)
            try:
                ranks = launch(_rank, args.world_size, kind, layers, args.width, args.runs, directory, paths)
            finally:
                shutil.rmtree(directory, ignore_errors=True)
            results[(kind, layers)] = (ranks[0][0], [times for _, times in ranks])
            print(f"{kind}, {layers} layers:\n{_table({(kind, layers): results[(kind, layers)]})}\n", flush=True)
    print(_table(results))
    if args.plot is not None:
        _plot(results, args.plot)


if __name__ == "__main__":
    main()
