"""Single checkpoint files (:mod:`ignite_zero.storage.savers.disk`), where DiskSaver differs from ignite's on
purpose: a failed save keeps the previous file and is not retried, a constant name is replaced atomically, new files
get the umask's mode, and sealed files load with plain torch, mapped or not, also past zip64's limits."""

import os

import pytest
import torch
from saving import idle_engine, save_at
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
    engine = idle_engine()
    save_at(handler, engine, 1)
    flaky.fail = True
    with pytest.raises(Exception, match="pickle|lambda"):
        save_at(handler, engine, 2)
    assert len(calls) == 2, "a failed save is not retried"
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_1.pt"], "old file kept, no temporary file left"
    assert handler.last_checkpoint == tmp_path / "checkpoint_1.pt"
    verify_file(handler.last_checkpoint)
    flaky.fail = False
    save_at(handler, engine, 3)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_3.pt"]


def test_constant_file_name_is_replaced_atomically(tmp_path):
    model = tiny_model()
    handler = Checkpoint({"model": model}, DiskSaver(tmp_path), filename_pattern="latest.pt")
    engine = idle_engine()
    save_at(handler, engine, 1)
    inode = os.stat(tmp_path / "latest.pt").st_ino
    with torch.no_grad():
        model[0].weight.add_(1.0)
    save_at(handler, engine, 2)
    assert os.listdir(tmp_path) == ["latest.pt"]
    assert os.stat(tmp_path / "latest.pt").st_ino != inode, "written beside, then renamed over the old file"
    assert_state_equal(torch.load(tmp_path / "latest.pt", weights_only=True), model.state_dict())


def test_new_files_get_the_umask_mode(tmp_path):
    previous = os.umask(0o027)
    try:
        Checkpoint({"model": tiny_model()}, DiskSaver(tmp_path))(idle_engine())
    finally:
        os.umask(previous)
    assert oct(os.stat(tmp_path / "model_0.pt").st_mode & 0o777) == oct(0o640)


def test_sealed_files_load_with_plain_torch_and_mmap(tmp_path):
    model = tiny_model()
    Checkpoint({"model": model}, DiskSaver(tmp_path))(idle_engine())
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
