"""The cyclic garbage collector held off during saves and loads (ignite_zero.collector)."""

import gc
import threading
import time

import pytest
import torch
from launcher import run_ranks

from ignite_zero import Checkpoint, collector


def test_the_collector_runs_again_when_the_last_pause_ends_in_any_thread():
    assert gc.isenabled()
    entered, release = threading.Event(), threading.Event()

    def hold():
        with collector.paused():
            entered.set()
            release.wait(10)

    other = threading.Thread(target=hold)
    with collector.paused():
        assert not gc.isenabled()
        other.start()
        entered.wait(10)
    assert not gc.isenabled(), "the other thread's pause still holds"
    release.set()
    other.join(10)
    assert gc.isenabled()


def test_a_collector_disabled_before_stays_disabled():
    gc.disable()
    try:
        with collector.paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_pause_with_a_limit_ends_by_then_unless_another_pause_holds():
    with collector.paused(at_most=0.05):
        assert not gc.isenabled()
        deadline = time.monotonic() + 5
        while not gc.isenabled() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gc.isenabled(), "the collector runs again while the block goes on"
    assert gc.isenabled()
    with collector.paused():
        with collector.paused(at_most=0.05):
            time.sleep(0.2)
            assert not gc.isenabled(), "the other pause holds on"
        assert not gc.isenabled(), "the limited pause ended once, not again at its block's end"
    assert gc.isenabled()


def test_a_pause_ends_with_the_error_that_ends_it():
    try:
        with collector.paused():
            raise KeyError("x")
    except KeyError:
        pass
    assert gc.isenabled()


class _Recording(torch.nn.Linear):
    """A module that notes whether the collector runs when it is saved and loaded."""

    def __init__(self):
        super().__init__(2, 2)
        self.collector_enabled = []

    def state_dict(self, *args, **kwargs):
        self.collector_enabled.append(gc.isenabled())
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        self.collector_enabled.append(gc.isenabled())
        return super().load_state_dict(*args, **kwargs)


def test_the_collector_is_held_off_while_a_checkpoint_saves_and_loads(tmp_path):
    from ignite.engine import Engine

    model = _Recording()
    checkpoint = Checkpoint({"model": model}, str(tmp_path))
    checkpoint(Engine(lambda engine, batch: None))
    Checkpoint.load_objects({"model": model}, checkpoint.last_checkpoint)
    assert len(model.collector_enabled) >= 2 and not any(model.collector_enabled)
    assert gc.isenabled()


def test_the_collector_is_held_off_while_an_asynchronous_save_writes(tmp_path):
    from ignite.engine import Engine

    from ignite_zero import DiskSaver

    seen, returned = [], threading.Event()

    class _RecordingSaver(DiskSaver):
        def __call__(self, checkpoint, filename, metadata=None):
            returned.wait(10)  # the save call, which holds the collector off for the staging, has returned
            seen.append((threading.current_thread() is threading.main_thread(), gc.isenabled()))
            super().__call__(checkpoint, filename, metadata)

    checkpoint = Checkpoint({"model": torch.nn.Linear(2, 2)}, _RecordingSaver(tmp_path), async_save=True)
    checkpoint(Engine(lambda engine, batch: None))
    returned.set()
    checkpoint.wait()
    assert seen == [(False, False)], "written in the save's own thread, the collector held off"
    assert gc.isenabled()


def _tensors_left_to_the_collector(rank, world_size, directory):
    """For each step, the tensors that only a pass of the collector would free after it: held by reference cycles."""
    from training import mixed_objects

    from ignite_zero import DiskSaver, ShardedSaver

    objects = mixed_objects("fsdp2", rank)
    trainer = objects["trainer"]
    consolidated = Checkpoint(objects, DiskSaver(directory / "consolidated"), n_saved=1)
    sharded = Checkpoint(objects, ShardedSaver(directory / "sharded"), n_saved=1)
    steps = {
        "consolidated save": lambda: consolidated(trainer),
        "sharded save": lambda: sharded(trainer),
        "consolidated load": lambda: Checkpoint.load_objects(objects, consolidated.last_checkpoint),
        "sharded load": lambda: Checkpoint.load_objects(objects, sharded.last_checkpoint),
    }
    trainer.run(range(2), max_epochs=1)
    left = {}
    for name, step in steps.items():
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds is kept in gc.garbage, to be counted
        try:
            step()
            gc.collect()
            left[name] = sum(isinstance(found, torch.Tensor) for found in gc.garbage)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    return left


@pytest.mark.distributed
def test_saves_and_loads_leave_no_tensor_to_the_collector(tmp_path):
    # the collector is held off during a save; a tensor held by a reference cycle would stay in memory after it,
    # the gathered full state of a consolidated save among them, until the collector's next pass over the heap
    for left in run_ranks(_tensors_left_to_the_collector, 2, tmp_path):
        assert left == dict.fromkeys(left, 0), left
