"""find_latest and load_latest: the newest checkpoint that is complete and verifies, the same on every rank, and a
handler that carries on its retention from it."""

import logging
import os

import pytest
import torch
from ignite.engine import Engine, Events
from launcher import run_ranks
from training import assert_state_equal, tiny_model, train_step, zero_adam

from ignite_zero import Checkpoint, DiskSaver, ShardedSaver, find_latest


def _trainer(model, optimizer, rank):
    return Engine(lambda engine, _: train_step(model, optimizer, rank, engine.state.iteration))


def _save_three(rank, world_size, dirname, sharded):
    model = tiny_model()
    optimizer = zero_adam(model)
    trainer = _trainer(model, optimizer, rank)
    saver = ShardedSaver(dirname) if sharded else DiskSaver(dirname)
    trainer.add_event_handler(
        Events.EPOCH_COMPLETED, Checkpoint({"model": model, "optimizer": optimizer}, saver, n_saved=None)
    )
    trainer.run(range(2), max_epochs=3)


def _find(rank, world_size, dirname):
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("ignite_zero.loading.latest").addHandler(handler)
    return find_latest(dirname), records


@pytest.mark.distributed
def test_the_newest_corrupt_and_the_next_truncated_every_rank_finds_the_third(tmp_path):
    run_ranks(_save_three, 2, tmp_path, False)
    newest, second = tmp_path / "checkpoint_6.pt", tmp_path / "checkpoint_4.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    os.truncate(second, second.stat().st_size - 100)
    results = run_ranks(_find, 2, tmp_path)
    assert [found for found, _ in results] == [str(tmp_path / "checkpoint_2.pt")] * 2
    checker_log = results[0][1]  # rank 0 checked, for its host
    assert any(f"Skipping checkpoint {newest}" in line and "corrupt" in line for line in checker_log)
    assert any(f"Skipping checkpoint {second}" in line for line in checker_log)
    assert results[1][1] == []  # the other rank of the host read nothing


@pytest.mark.distributed
def test_an_uncommitted_sharded_checkpoint_is_skipped(tmp_path):
    run_ranks(_save_three, 2, tmp_path, True)
    (tmp_path / "checkpoint_6.dcp" / ".metadata").unlink()  # as if the save had stopped before DCP's last write
    (tmp_path / ".checkpoint_8.dcp.ignite_zero-partial.tmp").mkdir()  # an interrupted save's directory
    assert [found for found, _ in run_ranks(_find, 2, tmp_path)] == [str(tmp_path / "checkpoint_4.dcp")] * 2
    # a corrupt byte in a file: every byte is checked on a local disk, though a load checks only what it reads
    corrupt = tmp_path / "checkpoint_4.dcp" / "__1_0.distcp"
    data = bytearray(corrupt.read_bytes())
    data[len(data) // 2] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    # and a manifest that is not JSON: that checkpoint is skipped too, never the search ended
    (tmp_path / "checkpoint_2.dcp" / "ignite_zero.json").write_bytes(b"{not json")
    results = run_ranks(_find, 2, tmp_path)
    assert [found for found, _ in results] == [None] * 2
    assert any("checkpoint_2.dcp/ignite_zero.json is corrupt" in line for line in results[0][1])


def test_nothing_valid_is_none(tmp_path):
    assert find_latest(tmp_path) is None
    assert find_latest(tmp_path / "absent") is None
    (tmp_path / "checkpoint_3.pt").write_bytes(b"not a checkpoint")
    assert find_latest(tmp_path) is None


def test_names_without_a_number_go_by_modification_time_and_prefixes_filter(tmp_path):
    state = {"model": tiny_model().state_dict()}
    saver = DiskSaver(tmp_path)
    for name in ("best_model_acc=0.9000.pt", "best_model_acc=0.5000.pt", "run_model_7.pt"):
        saver(state, name)
    os.utime(tmp_path / "best_model_acc=0.9000.pt", (2e9, 2e9))
    assert find_latest(tmp_path, filename_prefix="best") == str(tmp_path / "best_model_acc=0.9000.pt")
    assert find_latest(tmp_path, filename_prefix="run") == str(tmp_path / "run_model_7.pt")
    assert find_latest(tmp_path) == str(tmp_path / "best_model_acc=0.9000.pt")  # names differ: by time


def _resume(rank, world_size, dirname):
    model = tiny_model()
    optimizer = zero_adam(model)
    trainer = _trainer(model, optimizer, rank)
    to_save = {"model": model, "optimizer": optimizer, "trainer": trainer}
    checkpoint = Checkpoint(to_save, DiskSaver(dirname, require_empty=False), n_saved=2)
    first = checkpoint.load_latest(to_save)  # a fresh run: nothing yet
    trainer.add_event_handler(Events.EPOCH_COMPLETED, checkpoint)
    trainer.run(range(2), max_epochs=3)
    expected = model.state_dict()

    model = tiny_model(seed=5)
    optimizer = zero_adam(model)
    trainer = _trainer(model, optimizer, rank)
    to_save = {"model": model, "optimizer": optimizer, "trainer": trainer}
    resumed = Checkpoint(to_save, DiskSaver(dirname, require_empty=False), n_saved=2)
    found = resumed.load_latest(to_save)
    assert_state_equal(model.state_dict(), expected)
    retained = (str(resumed.last_checkpoint), resumed.state_dict()["_saved"], trainer.state.iteration)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, resumed)
    trainer.run(range(2), max_epochs=4)
    return first, found, retained, sorted(os.listdir(dirname))


@pytest.mark.distributed
def test_load_latest_restores_the_objects_and_carries_on_the_retention(tmp_path):
    for first, found, retained, listing in run_ranks(_resume, 2, tmp_path):
        assert first is None and found == str(tmp_path / "checkpoint_6.pt")
        assert retained == (found, [(4, "checkpoint_4.pt"), (6, "checkpoint_6.pt")], 6)
        assert listing == ["checkpoint_6.pt", "checkpoint_8.pt"]  # n_saved went on: checkpoint_4.pt removed


def test_load_latest_reads_scores_back_from_the_names(tmp_path):
    model = tiny_model()
    engine = Engine(lambda e, b: None)
    scores = iter([0.5, 0.9, 0.7])
    kwargs = {"score_function": lambda _: next(scores), "score_name": "acc", "n_saved": 2}
    handler = Checkpoint({"model": model}, DiskSaver(tmp_path), **kwargs)
    for step in (1, 2, 3):
        engine.state.iteration = step
        handler(engine)
    os.utime(tmp_path / "model_acc=0.9000.pt", (2e9, 2e9))  # the newest by time
    resumed = Checkpoint({"model": tiny_model(seed=1)}, DiskSaver(tmp_path, require_empty=False), **kwargs)
    assert resumed.load_latest({"model": tiny_model()}) == str(tmp_path / "model_acc=0.9000.pt")
    assert resumed.state_dict()["_saved"] == [(0.7, "model_acc=0.7000.pt"), (0.9, "model_acc=0.9000.pt")]
    assert torch.load(tmp_path / "model_acc=0.9000.pt", weights_only=True).keys() == model.state_dict().keys()


def _two_tiers(rank, world_size, tmp_path):
    """A fast sharded tier every iteration and a durable one every second iteration; then a run that resumes from
    whichever holds the newest valid checkpoint."""
    fast_dir, durable_dir = tmp_path / "fast", tmp_path / "durable"
    model = tiny_model()
    optimizer = zero_adam(model)
    trainer = _trainer(model, optimizer, rank)
    to_save = {"model": model, "optimizer": optimizer, "trainer": trainer}
    fast = Checkpoint(to_save, ShardedSaver(fast_dir), n_saved=2)
    durable = Checkpoint(to_save, DiskSaver(durable_dir), n_saved=2)
    trainer.add_event_handler(Events.ITERATION_COMPLETED(every=2), durable)
    trainer.add_event_handler(Events.ITERATION_COMPLETED, fast)  # at step 4, the newer of the two
    expected = {}
    trainer.add_event_handler(
        Events.ITERATION_COMPLETED, lambda e: expected.update({e.state.iteration: model.state_dict()})
    )
    trainer.run(range(4), max_epochs=1)
    newest = find_latest([fast_dir, durable_dir])
    if rank == 0:  # the newest is corrupt: the other tier's at the same step is the newest valid
        data = fast_dir / "checkpoint_4.dcp" / "__0_0.distcp"
        content = bytearray(data.read_bytes())
        content[len(content) // 2] ^= 0xFF
        data.write_bytes(bytes(content))
    torch.distributed.barrier()
    found = find_latest([fast_dir, durable_dir])

    model = tiny_model(seed=5)
    optimizer = zero_adam(model)
    to_load = {"model": model, "optimizer": optimizer, "trainer": _trainer(model, optimizer, rank)}
    resumed = Checkpoint(to_load, ShardedSaver(fast_dir, require_empty=False), n_saved=2)
    loaded = resumed.load_latest(to_load, places=[str(fast_dir), str(durable_dir)])
    assert_state_equal(model.state_dict(), expected[4])
    return newest, found, loaded, str(resumed.last_checkpoint), to_load["trainer"].state.iteration


@pytest.mark.distributed
def test_two_tiers_the_newest_valid_of_either_and_the_handler_keeps_its_own_retention(tmp_path):
    for newest, found, loaded, last, iteration in run_ranks(_two_tiers, 2, tmp_path):
        assert newest == str(tmp_path / "fast" / "checkpoint_4.dcp")
        assert found == loaded == str(tmp_path / "durable" / "checkpoint_4.pt")
        assert last == str(tmp_path / "fast" / "checkpoint_3.dcp") and iteration == 4
