"""Without a process group ignite_zero's Checkpoint behaves as ignite's: the same files at every step, the same
names, scores, retention and state, checked side by side against ignite's own Checkpoint; and where it differs on
purpose: scores stored as Python numbers, old files removed only once the new one is durable."""

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from ignite.engine import Engine, Events
from ignite.handlers import Checkpoint as IgniteCheckpoint
from ignite.handlers import DiskSaver as IgniteDiskSaver
from ignite.handlers import ModelCheckpoint as IgniteModelCheckpoint
from ignite.handlers import global_step_from_engine
from ignite.handlers.checkpoint import CheckpointEvents
from saving import idle_engine, save_at
from training import assert_state_equal, tiny_model, train_step

from ignite_zero import Checkpoint, DiskSaver, ModelCheckpoint, ShardedSaver

SCORES = [0.5, 0.7, 0.6, 0.7, 0.9, 0.1]


def _training(seed=0):
    model = tiny_model(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    trainer = Engine(lambda engine, _: train_step(model, optimizer, 0, engine.state.iteration))

    @trainer.on(Events.EPOCH_COMPLETED)
    def score(engine):
        engine.state.metrics["acc"] = SCORES[engine.state.epoch - 1]

    return model, optimizer, trainer


def _run_side_by_side(tmp_path, make_handler, objects=("model", "optimizer", "trainer"), event=Events.EPOCH_COMPLETED):
    """Train twice identically, once with ignite's handler and once with ours; record what each leaves on disk."""
    history = {}
    for flavour in ("ignite", "ours"):
        model, optimizer, trainer = _training()
        everything = {"model": model, "optimizer": optimizer, "trainer": trainer}
        to_save = {key: everything[key] for key in objects}
        dirname = tmp_path / flavour
        handler = make_handler(flavour, to_save, dirname, trainer)
        trainer.add_event_handler(event, handler)
        steps = []

        @trainer.on(event)
        def record(engine, dirname=dirname, handler=handler, steps=steps):
            names = sorted(os.listdir(dirname))
            last = handler.last_checkpoint
            steps.append((names, None if last is None else Path(last).name, handler.state_dict()))

        trainer.run(range(3), max_epochs=len(SCORES))
        contents = {name: torch.load(dirname / name, weights_only=True) for name in sorted(os.listdir(dirname))}
        history[flavour] = (steps, contents)
    return history


def _assert_same(history):
    ignite_steps, ignite_contents = history["ignite"]
    our_steps, our_contents = history["ours"]
    assert our_steps == ignite_steps
    assert_state_equal(our_contents, ignite_contents)


CONFIGURATIONS = {
    "defaults": {},
    "n_saved=3": {"n_saved": 3},
    "keep all": {"n_saved": None},
    "prefix": {"filename_prefix": "run", "n_saved": 2},
    "score_name alone": {"score_name": "acc", "n_saved": 2},
    "score function and name": {
        "score_function": Checkpoint.get_default_score_fn("acc", -1.0),
        "score_name": "neg_acc",
        "n_saved": 2,
    },
    "integer score": {"score_function": lambda engine: engine.state.epoch % 3, "n_saved": 2},
    "greater or equal": {"score_name": "acc", "n_saved": 1, "greater_or_equal": True},
    "global step": {"global_step_transform": lambda engine, _: engine.state.epoch, "n_saved": 2},
    "step and score": {
        "score_name": "acc",
        "global_step_transform": lambda engine, _: engine.state.epoch * 10,
        "n_saved": 2,
        "filename_prefix": "best",
    },
    "pattern": {
        "filename_pattern": "{global_step}-{name}-{score}.pt",
        "global_step_transform": lambda engine, _: engine.state.epoch,
        "score_name": "acc",
        "n_saved": 2,
    },
    "constant name": {"filename_pattern": "latest.pt", "n_saved": 1},
    "include self": {"include_self": True, "n_saved": 2},
}


@pytest.mark.parametrize("config", CONFIGURATIONS.values(), ids=CONFIGURATIONS.keys())
def test_same_files_names_and_state_as_ignite(tmp_path, config):
    def make(flavour, to_save, dirname, trainer):
        if flavour == "ignite":
            return IgniteCheckpoint(to_save, IgniteDiskSaver(dirname, require_empty=False), **config)
        return Checkpoint(to_save, DiskSaver(dirname, require_empty=False), **config)

    _assert_same(_run_side_by_side(tmp_path, make))


@pytest.mark.parametrize("objects", [("model",), ("optimizer",), ("model", "trainer")])
def test_single_and_partial_object_saves_match_ignite(tmp_path, objects):
    def make(flavour, to_save, dirname, trainer):
        cls, saver = (IgniteCheckpoint, IgniteDiskSaver) if flavour == "ignite" else (Checkpoint, DiskSaver)
        return cls(to_save, saver(dirname, require_empty=False), n_saved=2, include_self=len(objects) > 1)

    _assert_same(_run_side_by_side(tmp_path, make, objects))


def test_directory_string_and_global_step_from_engine_match_ignite(tmp_path):
    def make(flavour, to_save, dirname, trainer):
        cls = IgniteCheckpoint if flavour == "ignite" else Checkpoint
        return cls(to_save, str(dirname), n_saved=2, global_step_transform=global_step_from_engine(trainer))

    _assert_same(_run_side_by_side(tmp_path, make, event=Events.ITERATION_COMPLETED(every=4)))


def test_model_checkpoint_matches_ignite(tmp_path):
    history = {}
    for flavour, cls in (("ignite", IgniteModelCheckpoint), ("ours", ModelCheckpoint)):
        model, optimizer, trainer = _training()
        handler = cls(tmp_path / flavour, "prefix", n_saved=2, score_name="acc", require_empty=False)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, handler, {"model": model, "optimizer": optimizer})
        trainer.run(range(3), max_epochs=len(SCORES))
        history[flavour] = (sorted(os.listdir(tmp_path / flavour)), Path(handler.last_checkpoint).name)
    assert (
        history["ours"]
        == history["ignite"]
        == (
            ["prefix_checkpoint_acc=0.7000.pt", "prefix_checkpoint_acc=0.9000.pt"],
            "prefix_checkpoint_acc=0.9000.pt",
        )
    )


def test_saved_checkpoint_event_fires_after_each_save(tmp_path):
    model, optimizer, trainer = _training()
    handler = Checkpoint({"model": model}, DiskSaver(tmp_path), score_name="acc", n_saved=1)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, handler)
    fired = []
    trainer.register_events(*CheckpointEvents)  # as with ignite, before handlers can be added to them
    trainer.add_event_handler(Checkpoint.SAVED_CHECKPOINT, lambda engine: fired.append(engine.state.epoch))
    trainer.run(range(3), max_epochs=len(SCORES))
    assert fired == [1, 2, 5]  # 0.5, then 0.7 beats it, then only 0.9 beats 0.7


def test_reload_objects_and_load_state_dict_resume_retention(tmp_path):
    model, optimizer, trainer = _training()
    handler = Checkpoint({"model": model, "optimizer": optimizer}, DiskSaver(tmp_path), n_saved=2)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, handler)
    trainer.run(range(3), max_epochs=2)

    fresh_model, fresh_optimizer, _ = _training(seed=7)
    handler.reload_objects({"model": fresh_model, "optimizer": fresh_optimizer}, global_step=6)
    assert_state_equal(fresh_model.state_dict(), model.state_dict())
    assert_state_equal(fresh_optimizer.state_dict(), optimizer.state_dict())

    # a new handler resumes the retention of the old one
    resumed = Checkpoint({"model": model}, DiskSaver(tmp_path, require_empty=False), n_saved=2)
    resumed.load_state_dict(handler.state_dict())
    assert resumed.last_checkpoint == tmp_path / "checkpoint_6.pt"
    resumed.reset()
    assert resumed.last_checkpoint is None


def test_load_objects_of_a_dictionary_and_of_a_single_object_file(tmp_path):
    model, optimizer, trainer = _training()
    trainer.run(range(3), max_epochs=1)
    Checkpoint({"model": model}, DiskSaver(tmp_path))(trainer)
    fresh = tiny_model(seed=3)
    Checkpoint.load_objects({"model": fresh}, tmp_path / "model_3.pt")
    assert_state_equal(fresh.state_dict(), model.state_dict())
    other = tiny_model(seed=4)
    Checkpoint.load_objects({"model": other}, {"model": model.state_dict()})
    assert_state_equal(other.state_dict(), model.state_dict())


def test_load_latest_resumes_a_checkpoint_of_another_kind_and_leaves_it_to_its_saver(tmp_path):
    """A run that changed savers (files, then sharded directories) resumes from the other kind's checkpoint as from
    another tier's: its retention neither counts nor removes it."""
    model, optimizer, trainer = _training()
    trainer.run(range(3), max_epochs=1)
    Checkpoint({"model": model}, DiskSaver(tmp_path))(trainer)
    fresh = tiny_model(seed=3)
    sharded = Checkpoint({"model": fresh}, ShardedSaver(tmp_path))
    assert sharded.load_latest({"model": fresh}) == str(tmp_path / "model_3.pt")
    assert_state_equal(fresh.state_dict(), model.state_dict())
    assert sharded.last_checkpoint is None
    trainer.state.iteration = 5
    sharded(trainer)
    assert sharded.last_checkpoint == tmp_path / "model_5.dcp"
    assert sorted(os.listdir(tmp_path)) == ["model_3.pt", "model_5.dcp"]


def test_numpy_scores_are_stored_as_python_numbers(tmp_path):
    engine = idle_engine()
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
    engine = idle_engine()
    save_at(handler, engine, 1)
    save_at(handler, engine, 2)
    assert order == ["write", "write", "remove model_1.pt"]


def test_the_extension_is_the_savers_unless_set(tmp_path):
    assert Checkpoint({"model": tiny_model()}, ShardedSaver(tmp_path / "s")).ext == "dcp"
    handler = Checkpoint({"model": tiny_model()}, DiskSaver(tmp_path / "f"))
    handler.ext = "pth"  # as with ignite's Checkpoint
    handler(Engine(lambda e, b: None))
    assert handler.last_checkpoint == tmp_path / "f" / "model_0.pth"
