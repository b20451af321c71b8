"""A handler resumed by load_latest carries on where it resumed: it saves into its own directory, whose checkpoints
it found (``require_empty`` guards fresh runs only), and what would make its first save fail fails at load_latest."""

import contextlib
import os
import subprocess
from pathlib import Path

import pytest
import torch
from ignite.engine import Engine, Events
from launcher import attempt, run_ranks
from saving import idle_engine, save_at
from training import tiny_model, train_step, zero_adam

from ignite_zero import Checkpoint, DiskSaver, ModelCheckpoint, ShardedSaver


def _training(rank, seed=0):
    model = tiny_model(seed)
    optimizer = zero_adam(model)
    trainer = Engine(lambda engine, _: train_step(model, optimizer, rank, engine.state.iteration))
    return {"model": model, "optimizer": optimizer, "trainer": trainer}


def _handler(to_save, dirname, kind, **kwargs):
    """A handler with ``require_empty`` as its saver makes it by default: from a string path, or a ShardedSaver."""
    save_handler = str(dirname) if kind == "string" else ShardedSaver(dirname)
    return Checkpoint(to_save, save_handler, n_saved=2, **kwargs)


def _stopped(rank, world_size, dirname, kind, async_save):
    to_save = _training(rank)
    handler = _handler(to_save, dirname, kind, async_save=async_save)
    handler.load_latest(to_save)  # a fresh run: nothing found, the directory still guarded
    to_save["trainer"].add_event_handler(Events.EPOCH_COMPLETED, handler)
    to_save["trainer"].run(range(2), max_epochs=3)  # saves at iterations 2, 4, 6


def _resumed(rank, world_size, dirname, kind, async_save):
    to_save = _training(rank, seed=5)
    resumed = _handler(to_save, dirname, kind, async_save=async_save)
    found = resumed.load_latest(to_save)
    taken_up = (str(resumed.last_checkpoint), resumed.state_dict()["_saved"])
    to_save["trainer"].add_event_handler(Events.EPOCH_COMPLETED, resumed)
    to_save["trainer"].run(range(2), max_epochs=5)  # saves at iterations 8 and 10
    after = (str(resumed.last_checkpoint), resumed.state_dict()["_saved"], sorted(os.listdir(dirname)))

    fresh = _training(rank)  # another run, pointed at this directory by mistake
    fresh["trainer"].add_event_handler(Events.EPOCH_COMPLETED, _handler(fresh, dirname, kind))
    refused = attempt(lambda: fresh["trainer"].run(range(2), max_epochs=1))
    return found, taken_up, after, refused[:2]


@pytest.mark.distributed
@pytest.mark.parametrize(("kind", "async_save"), [("string", False), ("sharded", True)])
def test_a_resumed_handler_saves_into_its_directory_and_a_fresh_one_is_still_refused(tmp_path, kind, async_save):
    ext = "pt" if kind == "string" else "dcp"
    run_ranks(_stopped, 2, tmp_path, kind, async_save)
    for found, taken_up, after, refused in run_ranks(_resumed, 2, tmp_path, kind, async_save):
        assert found == str(tmp_path / f"checkpoint_6.{ext}")
        assert taken_up == (found, [(4, f"checkpoint_4.{ext}"), (6, f"checkpoint_6.{ext}")])
        # the earlier checkpoints count: checkpoint_4 went at the first save, checkpoint_6 at the second
        assert after == (
            str(tmp_path / f"checkpoint_10.{ext}"),
            [(8, f"checkpoint_8.{ext}"), (10, f"checkpoint_10.{ext}")],
            [f"checkpoint_10.{ext}", f"checkpoint_8.{ext}"],
        )
        assert refused[0] == "RankFailureError" and "are already present in the directory" in refused[1]


@contextlib.contextmanager
def _unwritable(path):
    """``path`` refuses new entries, to root as well (an immutable directory) as to anyone else."""
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(path)], check=True)
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", str(path)], check=True)
    else:
        path.chmod(0o555)
        try:
            yield
        finally:
            path.chmod(0o755)


def _states(rank):
    """A model and its optimizer, and an engine that never ran (its state is no checkpoint's to load)."""
    everything = _training(rank)
    return {"model": everything["model"], "optimizer": everything["optimizer"]}, everything["trainer"]


def _save_one(rank, directory, step, prefix=""):
    """A checkpoint at iteration ``step`` in ``directory``, as a run with another handler leaves it."""
    to_save, trainer = _states(rank)
    trainer.state.iteration = step
    Checkpoint(to_save, DiskSaver(directory), filename_prefix=prefix)(trainer)


def _early_failures(rank, world_size, tmp_path):
    """Each case: what the first save after the resume would hit, raised by load_latest instead, before any load."""
    outcomes = {}
    to_save, trainer = _states(rank)
    _save_one(rank, tmp_path / "prefix", 3, prefix="first")
    handler = Checkpoint(to_save, str(tmp_path / "prefix"), filename_prefix="second")
    outcomes["prefix"] = attempt(lambda: handler.load_latest(to_save))

    _save_one(rank, tmp_path / "unwritable", 3)
    handler = Checkpoint(to_save, str(tmp_path / "unwritable"))
    with _unwritable(tmp_path / "unwritable") if rank == 0 else contextlib.nullcontext():
        torch.distributed.barrier()
        outcomes["unwritable"] = attempt(lambda: handler.load_latest(to_save))
        torch.distributed.barrier()

    own, durable = tmp_path / "own", tmp_path / "durable"
    _save_one(rank, own, 3)
    _save_one(rank, durable, 4)
    handler = Checkpoint(to_save, str(own))
    outcomes["own_tier_not_searched"] = attempt(lambda: handler.load_latest(to_save, places=[str(durable)]))

    # its own tier searched too: the newest, in the other tier, resumes, and it saves beside its own older one
    handler = Checkpoint(to_save, str(own), n_saved=2)
    outcomes["tiers"] = attempt(lambda: handler.load_latest(to_save, places=[str(own), str(durable)]))
    trainer.state.iteration = 5
    handler(trainer)
    return {case: outcome[:2] for case, outcome in outcomes.items()}, sorted(os.listdir(own))


@pytest.mark.distributed
def test_what_would_fail_at_the_first_save_after_a_resume_fails_at_load_latest(tmp_path):
    results = run_ranks(_early_failures, 2, tmp_path)
    assert results[0] == results[1]  # every rank raises the same
    outcomes, own_listing = results[0]
    for case, text in [
        ("prefix", "found no checkpoint of this handler to resume (it looks for names that start with 'second_')"),
        ("unwritable", "is not writable by this process (rank 0)"),
        ("own_tier_not_searched", "is not among `places`: its saves start afresh there"),
    ]:
        assert outcomes[case][0] == "RankFailureError", (case, outcomes[case])
        assert text in outcomes[case][1], (case, outcomes[case])
    assert "['first_checkpoint_3.pt'] with extension '.pt' are already present" in outcomes["prefix"][1]
    assert "load_latest resumes" in outcomes["unwritable"][1]
    assert outcomes["tiers"] == (None, ""), outcomes["tiers"]
    assert own_listing == ["checkpoint_3.pt", "checkpoint_5.pt"]


def _on_object_storage(rank, world_size, url, options):
    """A run saving to a URL, then one resumed from it there, as a new process would; and a handler whose bucket is
    missing, which load_latest refuses before its first save could."""
    to_save, trainer = _states(rank)
    first = Checkpoint(to_save, DiskSaver(url, storage_options=options), n_saved=2)
    for step in (2, 4):
        trainer.state.iteration = step
        first(trainer)
    resumed = Checkpoint(to_save, DiskSaver(url, storage_options=options), n_saved=2)
    found = resumed.load_latest(to_save)
    trainer.state.iteration = 6
    resumed(trainer)
    missing = Checkpoint(to_save, DiskSaver("s3://no-such-bucket/run", storage_options=options))
    refused = attempt(lambda: missing.load_latest(to_save))
    return found, resumed.saver.list(), str(resumed.last_checkpoint), refused[:2]


@pytest.mark.distributed
def test_on_object_storage_a_resumed_handler_saves_and_a_missing_bucket_fails_at_load_latest(bucket, storage_options):
    url = f"{bucket}/run"
    for found, listed, last, refused in run_ranks(_on_object_storage, 2, url, storage_options):
        assert found == f"{url}/checkpoint_4.pt"
        assert listed == ["checkpoint_4.pt", "checkpoint_6.pt"] and last == f"{url}/checkpoint_6.pt"
        assert refused[0] == "RankFailureError" and "Bucket 'no-such-bucket'" in refused[1]
        assert "load_latest found no checkpoint of this handler to resume" in refused[1]


def _one_process_handler(dirname, kind, **kwargs):
    """A handler whose saver checks ``require_empty`` at load_latest or its first save: a path's (a string or a
    Path), or a ShardedSaver asked to."""
    to_save = {"model": tiny_model()}
    kinds = {"string": str, "path": Path, "sharded": lambda path: ShardedSaver(path, defer_require_empty=True)}
    save_handler = kinds[kind](dirname)
    return to_save, Checkpoint(to_save, save_handler, n_saved=2, **kwargs)


@pytest.mark.parametrize(("kind", "async_save"), [("string", False), ("path", True), ("sharded", False)])
def test_in_one_process_a_handler_of_a_path_resumes_and_saves_into_its_directory(tmp_path, kind, async_save):
    ext = "dcp" if kind == "sharded" else "pt"
    engine = idle_engine()
    _, first = _one_process_handler(tmp_path, kind)
    for step in (2, 4, 6):
        save_at(first, engine, step)
    to_load, resumed = _one_process_handler(tmp_path, kind, async_save=async_save)  # made on a non-empty directory
    assert resumed.load_latest(to_load) == str(tmp_path / f"model_6.{ext}")
    for step in (8, 10):
        save_at(resumed, engine, step)
    resumed.wait()
    # the earlier checkpoints count: model_4 went at the first save, model_6 at the second
    assert resumed.state_dict()["_saved"] == [(8, f"model_8.{ext}"), (10, f"model_10.{ext}")]
    assert sorted(os.listdir(tmp_path)) == [f"model_10.{ext}", f"model_8.{ext}"]


@pytest.mark.parametrize(("kind", "async_save"), [("string", False), ("path", True), ("sharded", False)])
def test_in_one_process_a_fresh_handler_of_a_path_is_refused_at_its_first_save(tmp_path, kind, async_save):
    ext = "dcp" if kind == "sharded" else "pt"
    _, other = _one_process_handler(tmp_path, kind)
    save_at(other, idle_engine(), 3)
    _, fresh = _one_process_handler(tmp_path, kind, async_save=async_save)  # no load_latest: a fresh run
    with pytest.raises(ValueError, match=rf"^Files \['model_3.{ext}'\] with extension '.{ext}' are already present"):
        save_at(fresh, idle_engine(), 1)  # an asynchronous save too: by the call, not later by wait()
    fresh.wait()
    assert os.listdir(tmp_path) == [f"model_3.{ext}"]


def test_in_one_process_savers_made_by_the_user_check_require_empty_when_made(tmp_path):
    (tmp_path / "old.pt").touch()
    for make in (lambda: DiskSaver(tmp_path), lambda: ModelCheckpoint(tmp_path, "run")):
        with pytest.raises(ValueError, match=r"^Files \['old.pt'\] with extension '.pt' are already present"):
            make()
    (tmp_path / "sharded" / "old.dcp").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"^Files \['old.dcp'\] with extension '.dcp' are already present"):
        ShardedSaver(tmp_path / "sharded")
