"""Asynchronous saves on real gloo ranks: each file holds the state of the moment it was asked for while training
goes on, errors of a background save surface on every rank at the next save or at the end of the run, an
exception in the run lets the pending save finish, and retention never removes the newest complete file early."""

import copy
import os
import signal
import threading
import time

import pytest
import torch
from ignite.engine import Engine, Events
from ignite.handlers.checkpoint import CheckpointEvents
from launcher import run_ranks
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from training import assert_state_equal, tiny_model, train_step, zero_adam

from ignite_zero import Checkpoint, CollectiveTimeoutError, DiskSaver, RankFailureError, ShardedSaver, verify_file
from ignite_zero.staging import HostBuffers
from ignite_zero.storage.formats.directory import verify

pytestmark = pytest.mark.distributed


def _trainer(model, optimizer, rank):
    return Engine(lambda engine, _: train_step(model, optimizer, rank, engine.state.iteration))


def _each_file_holds_its_moment(rank, world_size, dirname):
    model = DistributedDataParallel(tiny_model())
    optimizer = zero_adam(model)
    trainer = _trainer(model, optimizer, rank)
    checkpoint = Checkpoint(
        {"model": model, "optimizer": optimizer, "trainer": trainer},
        DiskSaver(dirname),
        n_saved=None,
        consolidate_recipient_rank=1,
        async_save=True,
    )
    trainer.add_event_handler(Events.EPOCH_COMPLETED, checkpoint)
    moments, pending = {}, []

    @trainer.on(Events.EPOCH_COMPLETED)
    def remember(engine):
        pending.append(checkpoint._background._pending is not None)  # the save runs on while training goes on
        optimizer.consolidate_state_dict(to=1)  # torch's own consolidation, beside the background gather
        if rank == 1:
            # copies: torch's consolidation holds the recipient's own live tensors, which training goes on changing
            moments[engine.state.iteration] = copy.deepcopy((optimizer.state_dict(), model.module.state_dict()))

    saved = []
    trainer.register_events(*CheckpointEvents)
    trainer.add_event_handler(Checkpoint.SAVED_CHECKPOINT, lambda engine: saved.append(checkpoint.last_checkpoint.name))
    trainer.run(range(3), max_epochs=3)  # COMPLETED waits for the last save
    assert checkpoint._background._pending is None
    return moments, pending, saved


def test_each_file_holds_the_state_of_its_moment(tmp_path):
    results = run_ranks(_each_file_holds_its_moment, 2, tmp_path)
    moments, pending, saved = results[1]
    assert pending == [True, True, True]
    assert saved == ["checkpoint_3.pt", "checkpoint_6.pt", "checkpoint_9.pt"] == results[0][2]
    for iteration, (optimizer_state, model_state) in moments.items():
        state = torch.load(tmp_path / f"checkpoint_{iteration}.pt", weights_only=True)
        assert_state_equal(state["optimizer"], optimizer_state)
        assert_state_equal(state["model"], model_state)
        assert state["trainer"]["iteration"] == iteration


def _fsdp_async_equals_sync(rank, world_size, dirname):
    torch.manual_seed(0)
    model = fully_shard(torch.nn.Sequential(torch.nn.Linear(7, 9), torch.nn.Linear(9, 3)))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(4, 7, generator=torch.Generator().manual_seed(0))).sum().backward()
    optimizer.step()
    engine = Engine(lambda e, b: None)
    to_save = {"model": model, "optimizer": optimizer}
    Checkpoint(to_save, DiskSaver(dirname / "sync"))(engine)
    background = Checkpoint(to_save, DiskSaver(dirname / "async"), async_save=True)
    background(engine)
    background.wait()


def test_fsdp_saved_in_the_background_equals_a_synchronous_save(tmp_path):
    run_ranks(_fsdp_async_equals_sync, 2, tmp_path)
    sync = torch.load(tmp_path / "sync" / "checkpoint_0.pt", weights_only=True)
    background = torch.load(tmp_path / "async" / "checkpoint_0.pt", weights_only=True)
    assert_state_equal(background, sync)


class _FailingSaver(DiskSaver):
    def __call__(self, checkpoint, filename, metadata=None):
        if filename == "checkpoint_2.pt":
            raise OSError(5, "Input/output error")
        super().__call__(checkpoint, filename, metadata)


def _errors_surface(rank, world_size, dirname, where):
    model = DistributedDataParallel(tiny_model())
    optimizer = zero_adam(model)
    trainer = _trainer(model, optimizer, rank)
    checkpoint = Checkpoint({"model": model, "optimizer": optimizer}, _FailingSaver(dirname), async_save=True)
    trainer.add_event_handler(Events.ITERATION_COMPLETED, checkpoint)
    with pytest.raises(RankFailureError, match=r"save of checkpoint_2.pt failed on 1 of 2 ranks: rank 0: OSError"):
        trainer.run(range(2 if where == "at the end of the run" else 3), max_epochs=1)
    return trainer.state.iteration, str(checkpoint.last_checkpoint)


@pytest.mark.parametrize("where", ["at the next save", "at the end of the run"])
def test_an_error_in_the_background_surfaces_on_every_rank(tmp_path, where):
    results = run_ranks(_errors_surface, 2, tmp_path, where)
    # at the next save: the third iteration's save raised it; at the end: COMPLETED did
    expected_iteration = 3 if where == "at the next save" else 2
    assert results == [(expected_iteration, str(tmp_path / "checkpoint_1.pt"))] * 2
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_1.pt"]
    verify_file(tmp_path / "checkpoint_1.pt")


def _staging_fails_on_one_rank(rank, world_size, dirname):
    model = DistributedDataParallel(tiny_model())
    optimizer = zero_adam(model)
    train_step(model, optimizer, rank, 1)
    objects = {"model": model, "optimizer": optimizer}
    checkpoint = Checkpoint(objects, ShardedSaver(dirname), async_save=True, sync_timeout=60)
    engine = Engine(lambda e, b: None)
    engine.state.iteration = 1
    checkpoint(engine)
    checkpoint.wait()
    copy_ = HostBuffers.copy

    def out_of_memory(self, tensors):
        raise RuntimeError("cannot allocate pinned host memory")

    if rank == 1:
        HostBuffers.copy = out_of_memory
    engine.state.iteration = 2
    started = time.monotonic()
    try:
        with pytest.raises(RankFailureError, match="rank 1: RuntimeError: cannot allocate pinned host memory"):
            checkpoint(engine)
            checkpoint.wait()
    finally:
        HostBuffers.copy = copy_
    elapsed = time.monotonic() - started
    left = sorted(name for name in os.listdir(dirname) if not name.startswith("."))
    engine.state.iteration = 3
    checkpoint(engine)
    checkpoint.wait()
    return elapsed, left, str(checkpoint.last_checkpoint)


def test_a_staging_that_fails_on_one_rank_fails_the_save_on_every_rank_at_once(tmp_path):
    for elapsed, left, last in run_ranks(_staging_fails_on_one_rank, 2, tmp_path):
        assert elapsed < 30, elapsed  # the others learn it with the outcome of the writes, not by a timeout of 60 s
        assert left == ["checkpoint_1.dcp"], left
        assert last == str(tmp_path / "checkpoint_3.dcp")
    assert sorted(name for name in os.listdir(tmp_path) if not name.startswith(".")) == ["checkpoint_3.dcp"]


class _SlowSaver(DiskSaver):
    """Lets the test decide when the write may go on."""

    gate = threading.Event()

    def __call__(self, checkpoint, filename, metadata=None):
        self.gate.wait(30)
        super().__call__(checkpoint, filename, metadata)


def _retention_and_exception(rank, world_size, dirname):
    model = DistributedDataParallel(tiny_model())
    optimizer = zero_adam(model)

    def step(engine, _):
        train_step(model, optimizer, rank, engine.state.iteration)
        if engine.state.iteration == 3:
            # the writer's save of iteration 2 is held: the newest complete file, iteration 1's, is still there (on
            # rank 1, whose gate holds nothing, the writer may have gone on already)
            if rank == 0:
                assert sorted(os.listdir(dirname)) == ["checkpoint_1.pt"]
            _SlowSaver.gate.set()
            raise KeyboardInterrupt("stopped by hand")
        return None

    trainer = Engine(step)
    checkpoint = Checkpoint({"model": model, "optimizer": optimizer}, _SlowSaver(dirname), n_saved=1, async_save=True)
    _SlowSaver.gate.set()
    trainer.add_event_handler(Events.ITERATION_COMPLETED, checkpoint)

    @trainer.on(Events.ITERATION_COMPLETED(once=1))
    def hold_the_next_write(engine):
        checkpoint.wait()
        _SlowSaver.gate.clear()

    with pytest.raises(KeyboardInterrupt, match="stopped by hand"):
        trainer.run(range(5), max_epochs=1)
    # the exception waited for the pending save, which completed
    return str(checkpoint.last_checkpoint), sorted(os.listdir(dirname))


def test_an_exception_in_the_run_lets_the_pending_save_finish_and_retention_keeps_the_newest(tmp_path):
    results = run_ranks(_retention_and_exception, 2, tmp_path)
    assert results == [(str(tmp_path / "checkpoint_2.pt"), ["checkpoint_2.pt"])] * 2
    verify_file(tmp_path / "checkpoint_2.pt")


def _recipient_killed(rank, world_size, dirname):
    # No training collectives (plain model and optimizer on each rank, and a ZeRO optimizer that is never stepped,
    # which makes the save a collective): only the checkpoint can tell the survivor.
    model = tiny_model()
    optimizer = torch.optim.Adam(model.parameters())
    trainer = _trainer(model, optimizer, rank)
    saver = DiskSaver(dirname)
    checkpoint = Checkpoint(
        {"model": model, "optimizer": optimizer, "zero": zero_adam(tiny_model())},
        saver,
        n_saved=1,
        sync_timeout=2.0,
        async_save=True,
    )
    trainer.add_event_handler(Events.ITERATION_COMPLETED, checkpoint)

    @trainer.on(Events.ITERATION_COMPLETED(once=1))
    def kill_the_recipient_in_the_next_write(engine):
        checkpoint.wait()
        if rank == 0:
            saver._dump = lambda *args: os.kill(os.getpid(), signal.SIGKILL)

    with pytest.raises(CollectiveTimeoutError, match=r"waiting for ranks \[0\] at the checkpoint save of checkpoint_2"):
        trainer.run(range(3), max_epochs=1)
    return trainer.state.iteration, str(checkpoint.last_checkpoint)


def test_a_recipient_killed_in_a_background_write_fails_the_others_and_the_previous_file_survives(tmp_path):
    results = run_ranks(_recipient_killed, 2, tmp_path, killed=[0], timeout=60)
    assert results[1] == (3, str(tmp_path / "checkpoint_1.pt"))  # raised by the save of iteration 3
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == ["checkpoint_1.pt"]
    verify_file(tmp_path / "checkpoint_1.pt")


def _creation_order(rank, world_size, dirname):
    model = tiny_model()
    optimizer = zero_adam(model)
    trainer = _trainer(model, optimizer, rank)
    names = ["first", "second"] if rank == 0 else ["second", "first"]  # created in another order on rank 1
    handlers = {
        name: Checkpoint({"optimizer": optimizer}, DiskSaver(dirname / name), n_saved=1, async_save=True)
        for name in names
    }
    for name in ("first", "second"):  # attached alike: the saves themselves run in the same order
        trainer.add_event_handler(Events.EPOCH_COMPLETED, handlers[name])
    trainer.run(range(2), max_epochs=2)
    twin = Checkpoint({"optimizer": optimizer}, DiskSaver(dirname / "first", require_empty=False), async_save=True)
    with pytest.raises(ValueError, match=r"Two asynchronous Checkpoint handlers write the same checkpoints"):
        twin(trainer)
    return {name: sorted(os.listdir(dirname / name)) for name in handlers}


def test_asynchronous_handlers_created_in_another_order_on_each_rank_pair_by_what_they_write(tmp_path):
    for listing in run_ranks(_creation_order, 2, tmp_path, timeout=60):
        assert listing == {"first": ["optimizer_4.pt"], "second": ["optimizer_4.pt"]}


def _two_handlers_one_directory(rank, world_size, dirname, alias, mode):
    from ignite_zero.storage import places
    from ignite_zero.storage.savers.sharded_commit import ShardedCommit

    begun, second_saved = threading.Event(), threading.Event()

    def hold(filename):  # the first handler's write waits, begun, until the second handler has saved
        if filename.startswith("first"):
            begun.set()
            assert second_saved.wait(60)

    if mode == "sharded":
        finish = ShardedCommit.finish

        def held_finish(commit, *args, **kwargs):  # every rank's files are written, not yet sealed
            hold(commit.filename)
            return finish(commit, *args, **kwargs)

        ShardedCommit.finish = held_finish
    else:
        write = places.LocalPlace.write

        def held_write(place, name, dump, atomic=True):
            def held_dump(f):  # the file's temporary is there now
                hold(name)
                return dump(f)

            return write(place, name, held_dump, atomic)

        places.LocalPlace.write = held_write

    model = DistributedDataParallel(tiny_model())
    optimizer = zero_adam(model)
    trainer = _trainer(model, optimizer, rank)
    saver = ShardedSaver if mode == "sharded" else DiskSaver
    to_save = {"model": model, "optimizer": optimizer}
    first = Checkpoint(to_save, saver(dirname, require_empty=False), filename_prefix="first", async_save=True)
    second = Checkpoint(to_save, saver(alias, require_empty=False), filename_prefix="second")  # spelled otherwise
    first(trainer)
    if mode == "sharded" or rank == 0:  # a consolidated file is written by the recipient alone
        assert begun.wait(60)
    second(trainer)  # its cleanup of what interrupted saves left finds the first's write under way
    second_saved.set()
    first.wait()
    return sorted(os.listdir(dirname))


@pytest.mark.parametrize("mode", ["consolidated", "sharded"])
def test_two_handlers_of_one_directory_leave_each_others_writes_alone(tmp_path, mode):
    ext = "dcp" if mode == "sharded" else "pt"
    names = [f"first_checkpoint_0.{ext}", f"second_checkpoint_0.{ext}"]
    directory, alias = tmp_path / "run", tmp_path / "alias"
    directory.mkdir()
    alias.symlink_to(directory)
    for listing in run_ranks(_two_handlers_one_directory, 2, directory, alias, mode, timeout=90):
        assert listing == names
    for name in names:
        (verify if mode == "sharded" else verify_file)(directory / name)
