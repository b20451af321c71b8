"""Replicated sharded saves on node-local disks: what a copy on another host costs, and how fast a replaced host
recovers.

    python benchmarks/replicas.py                    # ZeRO, 25M parameters (300 MB), 2 hosts of one rank, tmpfs
    python benchmarks/replicas.py --params 50e6 --runs 9

Each rank is a simulated host (Linux mount and UTS namespaces, as root): a hostname of its own, and a node-local disk
of its own (a directory of ``/dev/shm``) bind-mounted at one common path; the ranks meet in one gloo process group
over 127.0.0.1. Every rank trains one step of Adam under ``ZeroRedundancyOptimizer``, then the paths run interleaved
(their order rotates every round) after a warm-up round:

- ``sharded``: ``Checkpoint(ShardedSaver(shared))`` into a directory that both hosts share, unreplicated;
- ``replicated``: ``Checkpoint(ShardedSaver(node_local, replicas=1))``: each rank writes its files on its host and
  sends them to the other host, which writes them too: twice the bytes written, one copy across the loopback;
- ``load shared``: ``Checkpoint.load_objects`` of the ``sharded`` checkpoint, from the shared directory;
- ``recovery``: the second host's disk emptied (a replaced host), then ``Checkpoint.load_objects`` of the
  ``replicated`` checkpoint: the second host first fetches every file from the first, then both load from their own.

A time is its worst rank's. The table gives each path's min / median / max and the two ratios: replicated / sharded
(goal: at most 2.2) and recovery / load shared, each the median [min-max] of the ratios within each round.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import time
from pathlib import Path

import torch.distributed as dist
from _common import ZeROParameters, interleaved, launch, parser, summary, worst_rank, zero_adam_after_one_step
from _plot import seconds_panel, write_chart
from ignite.engine import Engine

from ignite_zero import Checkpoint, ShardedSaver

PATHS = ("sharded", "replicated", "load shared", "recovery")
ROOT = Path("/dev/shm/ignite_zero-replicas")


def _become_host(rank: int) -> Path:
    """Make this rank a host of its own: hostname ``host-RANK``, its disk at ``ROOT/node-local``."""
    libc = ctypes.CDLL(None, use_errno=True)
    clone_newns, clone_newuts = 0x00020000, 0x04000000
    ms_rec, ms_private, ms_bind = 0x4000, 0x40000, 0x1000
    name = f"host-{rank}".encode()
    disk, node_local = ROOT / f"disk-{rank}", ROOT / "node-local"
    disk.mkdir(parents=True, exist_ok=True)
    node_local.mkdir(exist_ok=True)
    for ok in (
        libc.unshare(clone_newns | clone_newuts) == 0,
        libc.sethostname(name, len(name)) == 0,
        libc.mount(b"none", b"/", None, ms_rec | ms_private, None) == 0,  # mounts here stay in this host
        libc.mount(bytes(disk), bytes(node_local), None, ms_bind, None) == 0,
    ):
        if not ok:
            raise OSError(ctypes.get_errno(), f"cannot simulate a host (needs root): {os.strerror(ctypes.get_errno())}")
    return node_local


def _rank(rank: int, world_size: int, count: int, runs: int, paths: tuple[str, ...]) -> dict[str, list[float]]:
    node_local = _become_host(rank)
    model = ZeROParameters(count)
    optimizer = zero_adam_after_one_step(model)
    to_save = {"model": model, "optimizer": optimizer}
    engine = Engine(lambda e, b: None)
    shared = Checkpoint(to_save, ShardedSaver(ROOT / "shared", require_empty=False), n_saved=1)
    replicated = Checkpoint(to_save, ShardedSaver(node_local / "ckpt", replicas=1, require_empty=False), n_saved=1)
    times: dict[str, list[float]] = {path: [] for path in paths}
    for measured, name in interleaved(paths, runs):
        engine.state.iteration += 1
        if name in ("load shared", "recovery"):
            handler = shared if name == "load shared" else replicated
            if handler.last_checkpoint is None:  # a load needs a checkpoint first
                handler(engine)
            dist.barrier()
            if name == "recovery" and rank == 1:  # the host replaced by one with an empty disk
                for entry in (node_local / "ckpt").iterdir():
                    shutil.rmtree(entry)
        dist.barrier()
        started = time.perf_counter()
        if name == "sharded":
            shared(engine)
        elif name == "replicated":
            replicated(engine)
        else:
            handler = shared if name == "load shared" else replicated
            Checkpoint.load_objects(to_save, str(handler.last_checkpoint))
        elapsed = time.perf_counter() - started
        dist.barrier()
        if measured:
            times[name].append(elapsed)
    return times


def _table(count: int, ranks: list[dict[str, list[float]]]) -> str:
    worst = worst_rank(ranks)
    ratios = {}
    for path, base in (("replicated", "sharded"), ("recovery", "load shared")):
        if path in worst and base in worst:
            low, middle, high = summary([a / b for a, b in zip(worst[path], worst[base])])
            ratios[path] = f"{middle:.2f} x {base} [{low:.2f}-{high:.2f}]"
    rows = ["| parameters | path | seconds min / median / max | ratio |", "|---|---|---|---|"]
    for path, values in worst.items():
        low, middle, high = summary(values)
        rows.append(f"| {count / 1e6:.0f}M | {path} | {low:.3f} / {middle:.3f} / {high:.3f} | {ratios.get(path, '')} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    options = parser(__doc__, [25e6], PATHS)
    args = options.parse_args(argv)
    paths = tuple(path for path in PATHS if path in args.paths)
    results: dict[str, dict[str, list[float]]] = {}
    for count in map(int, args.params):
        shutil.rmtree(ROOT, ignore_errors=True)
        ROOT.mkdir(parents=True)
        try:
            ranks = launch(_rank, 2, count, args.runs, paths)
        finally:
            shutil.rmtree(ROOT, ignore_errors=True)
        print(f"ZeRO, {count / 1e6:.0f}M parameters, 2 hosts of one rank, tmpfs:\n{_table(count, ranks)}\n", flush=True)
        results[f"{count / 1e6:.0f}M"] = worst_rank(ranks)
    if args.plot:
        saves = {
            group: {p: t for p, t in worst.items() if p in ("sharded", "replicated")}
            for group, worst in results.items()
        }
        loads = {group: {p: t for p, t in worst.items() if p not in saves[group]} for group, worst in results.items()}
        panels = [seconds_panel("saves", saves), seconds_panel("loads", loads)]
        write_chart(args.plot, "replicated sharded checkpoints, 2 hosts of one rank (worst rank)", panels)


if __name__ == "__main__":
    main()
