"""What the ranks of simulated hosts run (see ``hosts.py``): ``python host_scenarios.py SCENARIO WORKDIR NODE_LOCAL
NNODES NPROC_PER_NODE NODE_RANK PORT``, in a host's namespaces, directly or under torchrun.

Each rank leaves what it saw in ``WORKDIR/result-RANK.pkl``: ``(True, value)``, or ``(False, traceback)``.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import ignite.distributed as idist
import torch
import torch.distributed as dist
from ignite.engine import Engine
from launcher import attempt
from training import assert_state_equal, tiny_model, train_step, zero_adam

from ignite_zero import Checkpoint, DiskSaver, ShardedSaver

SYNC_TIMEOUT = 20.0


def _objects(rank: int, seed: int = 0) -> dict[str, Any]:
    model = tiny_model(seed)
    return {"model": model, "optimizer": zero_adam(model)}


def _assert_restored(fresh: dict[str, Any], saved: dict[str, Any]) -> None:
    """The same model, and the same partition of the ZeRO optimizer on this rank."""
    assert_state_equal(fresh["model"].state_dict(), saved["model"].state_dict())
    assert_state_equal(fresh["optimizer"].optim.state_dict(), saved["optimizer"].optim.state_dict())


def _visible(directory: Path) -> list[str] | None:
    """The checkpoints this host sees in ``directory``, ``None`` if it sees no such directory."""
    return sorted(name for name in os.listdir(directory) if not name.startswith(".")) if directory.is_dir() else None


def node_local(workdir: Path, node_local: Path) -> dict[str, Any]:
    """Consolidated files on node-local disks load everywhere; sharded saves to them fail, on every rank."""
    rank = idist.get_rank()
    objects = _objects(rank)
    engine = Engine(lambda e, b: None)
    files = Checkpoint(objects, DiskSaver(node_local / "files"), n_saved=2, sync_timeout=SYNC_TIMEOUT)
    for iteration in (1, 2):
        train_step(objects["model"], objects["optimizer"], rank, iteration)
        engine.state.iteration = iteration
        files(engine)
    seen: dict[str, Any] = {"files": _visible(node_local / "files"), "last": str(files.last_checkpoint)}

    # every rank of both hosts loads the file that only the recipient's host holds
    fresh = _objects(rank, seed=1)
    Checkpoint.load_objects(fresh, files.last_checkpoint, sync_timeout=SYNC_TIMEOUT)
    _assert_restored(fresh, objects)
    resumed = _objects(rank, seed=2)
    handler = Checkpoint(resumed, DiskSaver(node_local / "files", require_empty=False), sync_timeout=SYNC_TIMEOUT)
    seen["latest"] = handler.load_latest(resumed)
    _assert_restored(resumed, objects)

    # a sharded save to node-local disks: refused at the first save, on every rank, before anything is written
    sharded = Checkpoint(objects, ShardedSaver(node_local / "sharded"), sync_timeout=SYNC_TIMEOUT)
    seen["sharded"] = attempt(lambda: sharded(engine))
    seen["sharded files"] = _visible(node_local / "sharded")

    # a shared directory that the second host stops seeing after the first save (its mount lost)
    shared = workdir / "shared"
    handler = Checkpoint(objects, ShardedSaver(shared), n_saved=2, sync_timeout=SYNC_TIMEOUT)
    engine.state.iteration = 3
    handler(engine)
    first = handler.last_checkpoint
    second_host_leader = rank == idist.get_nproc_per_node() and idist.get_local_rank() == 0
    dist.barrier()
    if second_host_leader:  # its ranks share its mount namespace: both see its own disk there from now on
        (node_local / "lost").mkdir()
        subprocess.run(["mount", "--bind", str(node_local / "lost"), str(shared)], check=True)
    dist.barrier()
    engine.state.iteration = 4
    seen["unshared"] = attempt(lambda: handler(engine))
    dist.barrier()
    if second_host_leader:
        subprocess.run(["umount", str(shared)], check=True)
    dist.barrier()
    seen["shared files"] = _visible(shared)
    fresh = _objects(rank, seed=3)
    Checkpoint.load_objects(fresh, first, sync_timeout=SYNC_TIMEOUT)  # the checkpoint before the failure
    _assert_restored(fresh, objects)
    return seen


def sharded_on_node_local(workdir: Path, node_local: Path) -> dict[str, Any]:
    """Under torchrun: a sharded save to node-local disks fails on every rank; a file there loads on every rank."""
    rank = idist.get_rank()
    objects = _objects(rank)
    train_step(objects["model"], objects["optimizer"], rank, 1)
    engine = Engine(lambda e, b: None)
    sharded = Checkpoint(objects, ShardedSaver(node_local / "sharded"), sync_timeout=SYNC_TIMEOUT)
    seen: dict[str, Any] = {"sharded": attempt(lambda: sharded(engine))}
    files = Checkpoint(objects, DiskSaver(node_local / "files"), sync_timeout=SYNC_TIMEOUT)
    files(engine)
    fresh = _objects(rank, seed=1)
    Checkpoint.load_objects(fresh, files.last_checkpoint, sync_timeout=SYNC_TIMEOUT)
    _assert_restored(fresh, objects)
    seen["hostname"] = os.uname().nodename
    return seen


def host_lost(workdir: Path, node_local: Path) -> dict[str, Any]:
    """The second host is killed during the second save (the test kills it once its ranks are there)."""
    rank = idist.get_rank()
    objects = _objects(rank)
    engine = Engine(lambda e, b: None)
    checkpoint = Checkpoint(objects, DiskSaver(node_local / "files"), n_saved=2, sync_timeout=5)
    train_step(objects["model"], objects["optimizer"], rank, 1)
    engine.state.iteration = 1
    checkpoint(engine)
    dist.barrier()
    engine.state.iteration = 2
    if rank >= idist.get_nproc_per_node():
        (workdir / f"at-save-{rank}").touch()
        time.sleep(600)  # at the save when the host goes
    seen: dict[str, Any] = {"lost": attempt(lambda: checkpoint(engine))}
    seen["files"] = _visible(node_local / "files")
    return seen


def _run(local_rank: int, scenario: str, workdir: Path, node_local: Path) -> None:
    rank = idist.get_rank()
    try:
        outcome: tuple[bool, Any] = (True, globals()[scenario](workdir, node_local))
    except BaseException:
        outcome = (False, traceback.format_exc())
    (workdir / f"result-{rank}.pkl").write_bytes(pickle.dumps(outcome))
    if scenario == "host_lost":  # the other host is gone: leave at once rather than wait for it at the exit
        sys.stdout.flush()
        os._exit(0)


def main() -> None:
    scenario, workdir, node_local, nnodes, nproc_per_node, node_rank, port = sys.argv[1:8]
    torch.set_num_threads(1)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun started this rank: idist takes the process group from it
        with idist.Parallel(backend="gloo") as parallel:
            parallel.run(_run, scenario, Path(workdir), Path(node_local))
        return
    with idist.Parallel(
        backend="gloo",
        nproc_per_node=int(nproc_per_node),
        nnodes=int(nnodes),
        node_rank=int(node_rank),
        master_addr="127.0.0.1",
        master_port=int(port),
        start_method="fork",  # the launcher imported torch already: its ranks need not import it again
    ) as parallel:
        parallel.run(_run, scenario, Path(workdir), Path(node_local))


if __name__ == "__main__":
    main()
