"""Asynchronous saves beside a training loop: how long the loop is blocked, how much slower its steps are while the
save goes on, and when the checkpoint is durable; ignite_zero against ``dcp.async_save``.

    python benchmarks/async_loop.py                    # 12 x Linear(2048, 2048) with Adam (0.6 GB), tmpfs
    python benchmarks/async_loop.py --layers 1000 --width 64 --runs 5     # about 8,000 entries
    python benchmarks/async_loop.py --paths "sharded async" "dcp thread"

One rank (a gloo process group of one) holds ``--layers`` linear layers of ``--width`` x ``--width``, each an FSDP2
unit, with Adam after one step, and runs a training loop bound by Python on one thread, as a GPU loop's host thread
is: a step is a loop of small tensor operations, calibrated to take ``--step-ms`` (5 ms) on an idle interpreter. The
machine's other cores are left free for the save. Every path runs once a round, in an order that rotates each round,
after a warm-up round; in each, the loop runs ``--steps`` steps without a save (the reference), then calls the save
and steps on until the checkpoint is durable:

- ``sharded async``: ``Checkpoint(ShardedSaver, async_save=True)``;
- ``consolidated async``: ``Checkpoint(DiskSaver, async_save=True)``;
- ``dcp thread``: ``dcp.async_save`` of ``get_state_dict``'s state, its write in a thread;
- ``dcp process``: the same with ``async_checkpointer_type=AsyncCheckpointerType.PROCESS``: its write in a helper
  process (started by the first save, in the warm-up round).

For each: ``blocked``, the seconds the save call holds the loop; ``slowdown``, the median step time while the save
runs over the median step time of the steps before it; ``durable``, the seconds from the call until the checkpoint is
durable (ours: its writing thread is done, then ``Checkpoint.wait`` runs what follows a durable save; DCP: its future
is done), polled after every step; ``lost``, what the save costs the loop in all: the seconds blocked, and those its
steps took while the save ran beyond the pace of the steps before it (a save that slows the loop a lot for a short
while may cost it less than one that slows it a little for long). The table gives the median [min-max] of each over
the rounds. Files go to ``/dev/shm`` (no disk: software alone is measured).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from _common import LinearAdam, interleaved, launch, summary
from ignite.engine import Engine
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from ignite_zero import Checkpoint, DiskSaver, ShardedSaver

PATHS = ("sharded async", "consolidated async", "dcp thread", "dcp process")
#: The name of the thread that writes an asynchronous save of ours: once it is gone, the save is durable.
_WRITER = "ignite_zero-save"

Rounds = dict[str, dict[str, list[float]]]


class _Loop:
    """A training step bound by Python: ``repeats`` small tensor operations, each one holding the interpreter."""

    def __init__(self, step_ms: float) -> None:
        self.value = torch.zeros(16)
        self.repeats = 1000
        self.step()  # warms up the allocator
        self.repeats = max(1, round(1000 * step_ms / 1e3 / self.step()))

    def step(self) -> float:
        """One step; its seconds."""
        started = time.perf_counter()
        for _ in range(self.repeats):
            self.value = self.value * 0.999 + 0.001
        return time.perf_counter() - started


def _rank(
    rank: int,
    world_size: int,
    layers: int,
    width: int,
    step_ms: float,
    steps: int,
    runs: int,
    directory: Path,
    paths: tuple[str, ...],
) -> Rounds:
    """Every path of ``paths`` in interleaved rounds beside the loop: its blocked seconds, slowdown and durable
    seconds by round."""
    setup = LinearAdam("fsdp2", layers, width, rank, world_size)
    loop = _Loop(step_ms)
    engine = Engine(lambda e, b: None)
    handlers = {
        "sharded async": Checkpoint(
            setup.objects, ShardedSaver(directory / "sharded", require_empty=False), n_saved=1, async_save=True
        ),
        "consolidated async": Checkpoint(
            setup.objects, DiskSaver(directory / "consolidated", require_empty=False), n_saved=1, async_save=True
        ),
    }

    def ours(name: str) -> Callable[[], bool]:
        handlers[name](engine)

        def durable() -> bool:
            if any(thread.name == _WRITER for thread in threading.enumerate()):
                return False
            handlers[name].wait()
            return True

        return durable

    def theirs(kind: AsyncCheckpointerType) -> Callable[[], bool]:
        target = directory / f"dcp-{kind.value}-{engine.state.iteration}"
        future: Any = dcp.async_save(setup.dcp_state(), checkpoint_id=target, async_checkpointer_type=kind)
        return future.done

    saves: dict[str, Callable[[], Callable[[], bool]]] = {
        "sharded async": lambda: ours("sharded async"),
        "consolidated async": lambda: ours("consolidated async"),
        "dcp thread": lambda: theirs(AsyncCheckpointerType.THREAD),
        "dcp process": lambda: theirs(AsyncCheckpointerType.PROCESS),
    }
    rounds: Rounds = {name: {"blocked": [], "slowdown": [], "durable": [], "lost": []} for name in paths}
    for measured, name in interleaved(paths, runs):
        engine.state.iteration += 1
        before = [loop.step() for _ in range(steps)]
        started = time.perf_counter()
        done = saves[name]()
        blocked = time.perf_counter() - started
        during = [loop.step()]
        while not done():
            during.append(loop.step())
        durable = time.perf_counter() - started
        for path in directory.glob("dcp-*"):  # ours keep one checkpoint each (n_saved=1)
            shutil.rmtree(path)
        if measured:
            rounds[name]["blocked"].append(blocked)
            pace = statistics.median(before)
            rounds[name]["slowdown"].append(statistics.median(during) / pace)
            rounds[name]["durable"].append(durable)
            rounds[name]["lost"].append(blocked + sum(during) - pace * len(during))
    return rounds


def _table(rounds: Rounds) -> str:
    rows = [
        "| path | blocks the loop (s) | step time while the save runs (x) | durable after (s) | loop time lost (s) |",
        "|---|---|---|---|---|",
    ]
    for name, figures in rounds.items():
        cells = [summary(figures[figure]) for figure in ("blocked", "slowdown", "durable", "lost")]
        rows.append(f"| {name} | " + " | ".join(f"{m:.3f} [{lo:.3f}-{hi:.3f}]" for lo, m, hi in cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    options = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_argument("--layers", type=int, default=12, help="linear layers of the model")
    options.add_argument("--width", type=int, default=2048, help="inputs and outputs of each layer")
    options.add_argument("--step-ms", type=float, default=5.0, help="milliseconds of a training step, calibrated")
    options.add_argument("--steps", type=int, default=100, help="steps without a save before each save")
    options.add_argument("--runs", type=int, default=5, help="measured rounds after the warm-up round")
    options.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS), help="what to measure")
    args = options.parse_args(argv)
    paths = tuple(path for path in PATHS if path in args.paths)  # the table's order, whatever the command line's
    directory = Path("/dev/shm") / f"ignite_zero-async-loop-{os.getpid()}"  # runs side by side never share it
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    try:
        (rounds,) = launch(_rank, 1, args.layers, args.width, args.step_ms, args.steps, args.runs, directory, paths)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(f"{args.layers} x Linear({args.width}, {args.width}) with Adam, one rank:\n{_table(rounds)}")


if __name__ == "__main__":
    main()
