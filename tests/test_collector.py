"""The cyclic garbage collector held off during saves and loads (ignite_zero.collector)."""

import gc
import threading

import torch

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
