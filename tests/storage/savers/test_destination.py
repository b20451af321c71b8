"""What the savers of directories share (:mod:`ignite_zero.storage.savers.destination`): the checkpoints a saver
lists, and the temporary files of an interrupted save, never checkpoints and cleaned up."""

import os

import torch
from ignite.engine import Engine
from saving import idle_engine
from training import tiny_model

from ignite_zero import Checkpoint, DiskSaver, ShardedSaver


def test_temporary_files_of_a_crashed_save_are_never_checkpoints_and_are_cleaned_up(tmp_path):
    leftover = tmp_path / ".checkpoint_1.pt.ignite_zero-0123456789ab.tmp"
    leftover.write_bytes(b"half a checkpoint")
    saver = DiskSaver(tmp_path)  # require_empty=True only looks at .pt files
    Checkpoint({"model": tiny_model()}, saver)(idle_engine())
    assert sorted(os.listdir(tmp_path)) == ["model_0.pt"]


def test_savers_list_the_checkpoints_they_hold(tmp_path):
    engine = Engine(lambda e, b: None)
    for saver, ext in ((DiskSaver(tmp_path / "files"), "pt"), (ShardedSaver(tmp_path / "dirs"), "dcp")):
        handler = Checkpoint({"model": tiny_model()}, saver, n_saved=2)
        for step in (1, 2, 3):
            engine.state.iteration = step
            handler(engine)
        assert saver.list() == [f"model_2.{ext}", f"model_3.{ext}"]
        assert handler.last_checkpoint == saver.directory / f"model_3.{ext}"
    torch.save({}, tmp_path / "files" / ".model_9.pt.ignite_zero-abc.tmp")  # left by an interrupted save
    assert DiskSaver(tmp_path / "files", require_empty=False).list() == ["model_2.pt", "model_3.pt"]
