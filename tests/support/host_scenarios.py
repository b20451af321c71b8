"""What the ranks of simulated hosts run (see ``hosts.py``): ``python host_scenarios.py SCENARIO WORKDIR NODE_LOCAL
NNODES NPROC_PER_NODE NODE_RANK PORT``, in a host's namespaces, directly or under torchrun.

Each rank leaves what it saw in ``WORKDIR/result-RANK.pkl``: ``(True, value)``, or ``(False, traceback)``.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import os
import pickle
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import ignite.distributed as idist
import torch
import torch.distributed as dist
from ignite.engine import Engine, Events
from launcher import attempt
from training import assert_state_equal, tiny_model, train_step, zero_adam

from ignite_zero import Checkpoint, DiskSaver, ShardedSaver, cli, find_latest
from ignite_zero.storage.formats import dcp_files

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


class _Stall:
    """A value whose pickling stalls its rank: DCP pickles a checkpoint's values while the rank that keeps them (the
    recipient) writes its file, after the save was planned among every rank."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir

    def state_dict(self) -> dict[str, Any]:
        return {"value": self}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def __reduce__(self) -> Any:
        (self.workdir / f"writing-{idist.get_rank()}").touch()
        time.sleep(600)  # writing its file when the host goes
        return int, ()


def host_lost_mid_write(workdir: Path, node_local: Path) -> dict[str, Any]:
    """The second host is killed while its first rank writes its file of the second sharded save (the test kills it
    once the rank is there); the host's other rank has written its own by then."""
    rank = idist.get_rank()
    shared = workdir / "shared"
    objects = _objects(rank)
    engine = Engine(lambda e, b: None)
    checkpoint = Checkpoint(objects, ShardedSaver(shared), n_saved=2, sync_timeout=5)
    train_step(objects["model"], objects["optimizer"], rank, 1)
    engine.state.iteration = 1
    checkpoint(engine)
    if rank == 0:
        torch.save(objects["model"].state_dict(), workdir / "model-1.pt")
    dist.barrier()
    engine.state.iteration = 2
    second_host = idist.get_nproc_per_node()  # the recipient keeps the values, the stall among them
    stalled = Checkpoint(
        {**objects, "stall": _Stall(workdir)},
        ShardedSaver(shared, require_empty=False),
        sync_timeout=5,
        consolidate_recipient_rank=second_host,
    )
    seen: dict[str, Any] = {"lost": attempt(lambda: stalled(engine))}
    seen["checkpoints"] = _visible(shared)
    return seen


def _resumable(rank: int, seed: int = 0) -> dict[str, Any]:
    """The objects of :func:`_objects` and a trainer that trains them, which a checkpoint saves too."""
    objects = _objects(rank, seed)
    model, optimizer = objects["model"], objects["optimizer"]
    return {**objects, "trainer": Engine(lambda e, b: train_step(model, optimizer, rank, e.state.iteration))}


def _state(objects: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A copy of the model's state and of this rank's partition of the optimizer's."""
    return copy.deepcopy(objects["model"].state_dict()), copy.deepcopy(objects["optimizer"].optim.state_dict())


def _assert_state(objects: dict[str, Any], state: tuple[dict[str, Any], dict[str, Any]]) -> None:
    assert_state_equal(objects["model"].state_dict(), state[0])
    loaded = objects["optimizer"].optim.state_dict()  # its entries in the order they were loaded in
    assert_state_equal({**loaded, "state": dict(sorted(loaded["state"].items()))}, state[1])


def _files(directory: Path) -> dict[str, list[str]]:
    """The checkpoints this host holds in ``directory``, each with its files."""
    return {name: sorted(os.listdir(directory / name)) for name in _visible(directory) or []}


def _warnings_of(logger: str) -> list[str]:
    """The messages that ``logger`` logs from now on."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger(logger).addHandler(handler)
    return records


def replicated(workdir: Path, node_local: Path) -> dict[str, Any]:
    """One rank a host: a replicated fast tier every iteration and a durable one every second; bad settings; an
    asynchronous save; the second host replaced by an empty one and a resume from both tiers; a file lost on both
    hosts; the save after, retaining what either host held."""
    rank = idist.get_rank()
    fast_dir, durable_dir = node_local / "fast", workdir / "durable"
    objects = _resumable(rank)
    trainer = objects["trainer"]
    states = {}
    fast = Checkpoint(objects, ShardedSaver(fast_dir, replicas=1), n_saved=2, sync_timeout=SYNC_TIMEOUT)
    durable = Checkpoint(objects, DiskSaver(durable_dir), n_saved=1, sync_timeout=SYNC_TIMEOUT)
    trainer.add_event_handler(Events.ITERATION_COMPLETED(every=2), durable)
    trainer.add_event_handler(Events.ITERATION_COMPLETED, fast)  # the newer at iteration 2
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: states.update({e.state.iteration: _state(objects)}))
    trainer.run(range(3), max_epochs=1)
    seen: dict[str, Any] = {"saved": _files(fast_dir)}

    too_many = Checkpoint(objects, ShardedSaver(node_local / "bad", replicas=2), sync_timeout=SYNC_TIMEOUT)
    seen["too many"] = attempt(lambda: too_many(trainer))
    shared = Checkpoint(objects, ShardedSaver(workdir / "shared", replicas=1), sync_timeout=SYNC_TIMEOUT)
    seen["shared"] = attempt(lambda: shared(trainer))
    seen["shared files"] = _visible(workdir / "shared")
    background = Checkpoint(
        objects, ShardedSaver(node_local / "async", replicas=1), async_save=True, sync_timeout=SYNC_TIMEOUT
    )
    background(trainer)
    background.wait()
    seen["async"] = _files(node_local / "async")

    dist.barrier()
    if rank == 1:  # the second host replaced by one whose disk is empty
        shutil.rmtree(fast_dir)
    dist.barrier()
    fresh = _resumable(rank, seed=1)
    # its recipient on the replaced host, whose own listing holds nothing older than what the resume fetches
    saver = ShardedSaver(fast_dir, replicas=1, require_empty=False)
    resumed = Checkpoint(fresh, saver, n_saved=2, consolidate_recipient_rank=1)
    seen["resumed"] = resumed.load_latest(fresh, places=[fast_dir, durable_dir])
    _assert_state(fresh, states[3])
    seen["repaired"] = _files(fast_dir)

    (fast_dir / "checkpoint_3.dcp" / "__1_0.distcp").unlink()  # on both hosts: a file that survives nowhere
    dist.barrier()
    log = _warnings_of("ignite_zero.loading.latest")
    seen["after loss"] = find_latest([fast_dir, durable_dir])  # the second host lacks checkpoint_2.dcp
    seen["log"] = log
    fresh = _resumable(rank, seed=2)
    Checkpoint.load_objects(fresh, seen["after loss"], sync_timeout=SYNC_TIMEOUT)
    _assert_state(fresh, states[2])
    seen["fetched"] = _files(fast_dir)

    trainer.state.iteration = 4
    resumed(trainer)  # every host holds every file again
    seen["next"] = _files(fast_dir)
    if rank == 0:
        torch.save(objects["model"].state_dict(), workdir / "model-4.pt")

    # a rank slower than sync_timeout to write what it relays: that save fails on every rank, the next one saves
    straggling = Checkpoint(objects, ShardedSaver(node_local / "straggler", replicas=1), sync_timeout=2.0)
    write_file = dcp_files.PlaceStorageWriter._write_file

    def late(*args: Any, **kwargs: Any) -> Any:
        time.sleep(3.0)
        return write_file(*args, **kwargs)

    if rank == 1:
        dcp_files.PlaceStorageWriter._write_file = late  # type: ignore[method-assign]
    seen["straggler"] = attempt(lambda: straggling(trainer))
    dcp_files.PlaceStorageWriter._write_file = write_file  # type: ignore[method-assign]
    trainer.state.iteration = 5
    seen["after straggler"] = attempt(lambda: straggling(trainer))
    seen["straggler files"] = _files(node_local / "straggler")
    # several writing threads: files sent once written, over a group of their own
    threads = Checkpoint(objects, ShardedSaver(node_local / "threads", replicas=1, thread_count=2))
    threads(trainer)
    seen["threads"] = _files(node_local / "threads")
    return seen


def three_hosts(workdir: Path, node_local: Path) -> dict[str, Any]:
    """Three hosts of one rank, each rank's files kept on one other host: what each host holds, and
    ``ignite-zero verify`` of its directory there."""
    rank = idist.get_rank()
    objects = _objects(rank)
    train_step(objects["model"], objects["optimizer"], rank, 1)
    handler = Checkpoint(objects, ShardedSaver(node_local / "fast", replicas=1), sync_timeout=SYNC_TIMEOUT)
    handler(Engine(lambda e, b: None))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = cli.main(["verify", str(handler.last_checkpoint)])
    return {"files": _files(node_local / "fast"), "verify": (status, printed.getvalue())}


def grown(workdir: Path, node_local: Path) -> dict[str, Any]:
    """Two ranks a host, after :func:`replicated` saved with one, its second host's disk emptied: a resume, a save,
    and the second host lost as the first host's ranks enter the next save."""
    rank = idist.get_rank()
    fast_dir = node_local / "fast"
    objects = _resumable(rank, seed=3)
    handler = Checkpoint(objects, ShardedSaver(fast_dir, replicas=1, require_empty=False), n_saved=2, sync_timeout=5)
    seen: dict[str, Any] = {"resumed": handler.load_latest(objects)}
    assert_state_equal(objects["model"].state_dict(), torch.load(workdir / "model-4.pt", weights_only=True))
    seen["repaired"] = _files(fast_dir)
    trainer = objects["trainer"]
    train_step(objects["model"], objects["optimizer"], rank, 5)
    trainer.state.iteration = 5
    handler(trainer)
    seen["saved"] = _files(fast_dir)
    if rank == 0:
        torch.save(objects["model"].state_dict(), workdir / "model-5.pt")
    dist.barrier()
    train_step(objects["model"], objects["optimizer"], rank, 6)
    trainer.state.iteration = 6
    if rank >= idist.get_nproc_per_node():
        # the test kills this host now, before its ranks come to the save
        (workdir / f"at-save-{rank}").touch()
        time.sleep(600)
    seen["lost"] = attempt(lambda: handler(trainer))
    seen["files"] = _files(fast_dir)
    return seen


def shrunk(workdir: Path, node_local: Path) -> dict[str, Any]:
    """One host of two ranks, the survivor of :func:`grown`: a resume from its disk alone."""
    rank = idist.get_rank()
    objects = _resumable(rank, seed=4)
    handler = Checkpoint(objects, ShardedSaver(node_local / "fast", replicas=1, require_empty=False))
    seen = {"resumed": handler.load_latest(objects)}
    assert_state_equal(objects["model"].state_dict(), torch.load(workdir / "model-5.pt", weights_only=True))
    return seen


# the scenarios in which the test kills the second host
_HOST_LOST = ("host_lost", "host_lost_mid_write", "grown")


def _run(local_rank: int, scenario: str, workdir: Path, node_local: Path) -> None:
    rank = idist.get_rank()
    try:
        outcome: tuple[bool, Any] = (True, globals()[scenario](workdir, node_local))
    except BaseException:
        outcome = (False, traceback.format_exc())
    (workdir / f"result-{rank}.pkl").write_bytes(pickle.dumps(outcome))
    if scenario in _HOST_LOST:  # the other host is gone: leave at once rather than wait for it at the exit
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
