"""What ignite_zero does differently from ignite on purpose: durable writes, retention only after a durable
write, no retries, atomic overwrites, file modes, weights-only files, integrity checks at load."""

import os

import numpy as np
import pytest
import torch
from ignite.engine import Engine
from training import assert_state_equal, tiny_model

from ignite_zero import Checkpoint, DiskSaver, verify_file


class _Unpicklable:
    """Its state cannot be serialised: torch.save fails half-way through the file."""

    def __init__(self):
        self.fail = False

    def state_dict(self):
        return {"weights": torch.ones(1000), "callback": (lambda: None) if self.fail else None}

    def load_state_dict(self, state):
        pass


def _engine():
    engine = Engine(lambda e, b: None)
    engine.state.iteration = 0
    return engine


def _save_at(handler, engine, iteration):
    engine.state.iteration = iteration
    handler(engine)


def test_failed_save_keeps_previous_checkpoint_and_is_not_retried(tmp_path):
    flaky = _Unpicklable()
    calls = []
    saver = DiskSaver(tmp_path)
    original = saver._dump

    def counting_dump(checkpoint, f, func):
        calls.append(1)
        original(checkpoint, f, func)

    saver._dump = counting_dump
    handler = Checkpoint({"model": tiny_model(), "flaky": flaky}, saver, n_saved=1)
    engine = _engine()
    _save_at(handler, engine, 1)
    flaky.fail = True
    with pytest.raises(Exception, match="pickle|lambda"):
        _save_at(handler, engine, 2)
    assert len(calls) == 2, "a failed save is not retried"
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_1.pt"], "old file kept, no temporary file left"
    assert handler.last_checkpoint == tmp_path / "checkpoint_1.pt"
    verify_file(handler.last_checkpoint)
    flaky.fail = False
    _save_at(handler, engine, 3)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_3.pt"]


def test_constant_file_name_is_replaced_atomically(tmp_path):
    model = tiny_model()
    handler = Checkpoint({"model": model}, DiskSaver(tmp_path), filename_pattern="latest.pt")
    engine = _engine()
    _save_at(handler, engine, 1)
    inode = os.stat(tmp_path / "latest.pt").st_ino
    with torch.no_grad():
        model[0].weight.add_(1.0)
    _save_at(handler, engine, 2)
    assert os.listdir(tmp_path) == ["latest.pt"]
    assert os.stat(tmp_path / "latest.pt").st_ino != inode, "written beside, then renamed over the old file"
    assert_state_equal(torch.load(tmp_path / "latest.pt", weights_only=True), model.state_dict())


def test_temporary_files_of_a_crashed_save_are_never_checkpoints_and_are_cleaned_up(tmp_path):
    leftover = tmp_path / ".checkpoint_1.pt.ignite_zero-0123456789ab.tmp"
    leftover.write_bytes(b"half a checkpoint")
    saver = DiskSaver(tmp_path)  # require_empty=True only looks at .pt files
    Checkpoint({"model": tiny_model()}, saver)(_engine())
    assert sorted(os.listdir(tmp_path)) == ["model_0.pt"]


def test_new_files_get_the_umask_mode(tmp_path):
    previous = os.umask(0o027)
    try:
        Checkpoint({"model": tiny_model()}, DiskSaver(tmp_path))(_engine())
    finally:
        os.umask(previous)
    assert oct(os.stat(tmp_path / "model_0.pt").st_mode & 0o777) == oct(0o640)


def test_numpy_scores_are_stored_as_python_numbers(tmp_path):
    engine = _engine()
    handler = Checkpoint(
        {"model": tiny_model(), "optimizer": torch.optim.SGD(tiny_model().parameters(), lr=0.1)},
        DiskSaver(tmp_path),
        score_function=lambda _: np.float64(0.25),
        score_name="acc",
        include_self=True,
    )
    handler(engine)
    saved = torch.load(tmp_path / "checkpoint_acc=0.2500.pt", weights_only=True)
    assert saved["checkpointer"]["_saved"] == [(0.25, "checkpoint_acc=0.2500.pt")]  # ignite's own form
    assert type(handler._saved[0].priority) is float


def test_retention_removes_old_files_only_after_the_new_one_is_durable(tmp_path):
    order = []
    saver = DiskSaver(tmp_path)
    original_dump, original_remove = saver._dump, saver.remove
    saver._dump = lambda checkpoint, f, func: (order.append("write"), original_dump(checkpoint, f, func))
    saver.remove = lambda filename: (order.append(f"remove {filename}"), original_remove(filename))
    handler = Checkpoint({"model": tiny_model()}, saver, n_saved=1)
    engine = _engine()
    _save_at(handler, engine, 1)
    _save_at(handler, engine, 2)
    assert order == ["write", "write", "remove model_1.pt"]


def test_files_without_trailer_load_with_a_warning(tmp_path):
    model = tiny_model()
    torch.save(model.state_dict(), tmp_path / "plain.pt")
    fresh = tiny_model(1)
    with pytest.warns(UserWarning, match="carries no ignite_zero integrity trailer"):
        Checkpoint.load_objects({"model": fresh}, tmp_path / "plain.pt")
    assert_state_equal(fresh.state_dict(), model.state_dict())


def test_sealed_files_load_with_plain_torch_and_mmap(tmp_path):
    model = tiny_model()
    Checkpoint({"model": model}, DiskSaver(tmp_path))(_engine())
    for kwargs in ({}, {"mmap": True}):
        assert_state_equal(torch.load(tmp_path / "model_0.pt", weights_only=True, **kwargs), model.state_dict())
    # a single-object save loads strictly into the module itself
    tiny_model(2).load_state_dict(torch.load(tmp_path / "model_0.pt", weights_only=True), strict=True)


@pytest.mark.large
def test_large_archives_in_zip64_are_sealed_and_verified(tmp_path):
    # over 65535 records makes torch write zip64 end records
    state = {f"t{i}": torch.tensor(float(i)) for i in range(70_000)}
    saver = DiskSaver(tmp_path)
    saver(state, "many.pt")
    assert verify_file(tmp_path / "many.pt")["size"] > 0
    assert torch.load(tmp_path / "many.pt", weights_only=True, mmap=True)["t69999"].item() == 69999.0


def test_checkpoint_engine_state_loads_weights_only(tmp_path):
    trainer = Engine(lambda e, b: None)
    trainer.run(range(3), max_epochs=2)
    handler = Checkpoint({"trainer": trainer}, DiskSaver(tmp_path))
    handler(trainer)
    resumed = Engine(lambda e, b: None)
    Checkpoint.load_objects({"trainer": resumed}, tmp_path / "trainer_6.pt")
    assert (resumed.state.epoch, resumed.state.iteration) == (2, 6)
