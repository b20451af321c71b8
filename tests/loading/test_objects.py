"""Loading on any number of ranks with bounded memory: every rank that sees the file reads its part of it, the first
one maps it and sends the others only their part, and ranks that see different files, or none, fail together."""

import ctypes
import os

import pytest
import torch
from ignite.engine import Engine, Events
from launcher import run_ranks
from torch.nn.parallel import DistributedDataParallel
from training import assert_state_equal, tiny_model, train_step, zero_adam

from ignite_zero import Checkpoint, DiskSaver
from ignite_zero.adapters.zero import OptimizerStatePart, ZeROState

pytestmark = pytest.mark.distributed

_CLONE_NEWNS, _MS_REC, _MS_PRIVATE = 0x00020000, 0x4000, 0x40000


def _hide(directory):
    """Give this process a directory of its own at ``directory``: a new mount namespace, an empty tmpfs on it."""
    libc = ctypes.CDLL(None, use_errno=True)
    for result in (
        libc.unshare(_CLONE_NEWNS),
        libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None),
        libc.mount(b"tmpfs", str(directory).encode(), b"tmpfs", 0, b"size=4m"),
    ):
        if result != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def _can_hide():
    return os.geteuid() == 0


needs_root = pytest.mark.skipif(not _can_hide(), reason="private mount namespaces need root")


def _save(rank, world_size, dirname):
    model = DistributedDataParallel(tiny_model())
    optimizer = zero_adam(model)
    trainer = Engine(lambda engine, _: train_step(model, optimizer, rank, engine.state.iteration))
    trainer.add_event_handler(
        Events.EPOCH_COMPLETED,
        Checkpoint({"model": model, "optimizer": optimizer, "trainer": trainer}, DiskSaver(dirname)),
    )
    trainer.run(range(3), max_epochs=1)


def _load_where_only_some_see_the_file(rank, world_size, dirname, seeing):
    if rank not in seeing:
        _hide(dirname)
    assert (dirname / "checkpoint_3.pt").exists() == (rank in seeing)
    model = DistributedDataParallel(tiny_model(seed=3))
    optimizer = zero_adam(model)
    received = []
    original = ZeROState.load_state_dict
    ZeROState.load_state_dict = lambda self, entry: (received.append(entry), original(self, entry))[1]
    trainer = Engine(lambda e, b: None)
    Checkpoint.load_objects({"model": model, "optimizer": optimizer, "trainer": trainer}, dirname / "checkpoint_3.pt")
    optimizer.consolidate_state_dict(to=0)
    owned = ZeROState(optimizer).part_needed().indices
    return (
        optimizer.state_dict() if rank == 0 else None,
        model.module.state_dict(),
        trainer.state.iteration,
        sorted(received[0]["state"]),
        {t.is_meta for state in received[0]["state"].values() for t in state.values()},  # still to be read?
        owned,
    )


@needs_root
@pytest.mark.parametrize("seeing", [(1,), (0, 2)], ids=["one rank", "two ranks"])
def test_ranks_that_cannot_see_the_file_get_their_part_from_one_that_can(tmp_path, seeing):
    run_ranks(_save, 2, tmp_path)
    saved = torch.load(tmp_path / "checkpoint_3.pt", weights_only=True)
    results = run_ranks(_load_where_only_some_see_the_file, 3, tmp_path, seeing)
    assert_state_equal(results[0][0], saved["optimizer"])
    for rank, (_, model_state, iteration, received, deferred, owned) in enumerate(results):
        assert_state_equal(model_state, saved["model"])
        assert iteration == 3
        if rank == seeing[0]:  # the whole entry, mapped from the file, which it reads for the others
            assert received == list(range(6)) and deferred == {False}
        elif rank in seeing:  # the whole entry, nothing read yet: it reads its partition as it loads it
            assert received == list(range(6)) and deferred == {True}
        else:  # only the state of the parameters it owns travelled
            assert received == list(owned) and len(owned) < 6 and deferred == {False}


def _different_files(rank, world_size, dirname):
    if rank == 1:
        _hide(dirname)
        DiskSaver(dirname, save_on_rank=1)(
            {"model": tiny_model(seed=5).state_dict(), "optimizer": {}}, "checkpoint_3.pt"
        )
    optimizer = zero_adam(tiny_model())
    with pytest.raises(ValueError, match=r"Ranks see different files at .*checkpoint_3.pt \(size, checksum: rank 0: "):
        Checkpoint.load_objects({"model": tiny_model(), "optimizer": optimizer}, dirname / "checkpoint_3.pt")


@needs_root
def test_ranks_that_see_different_files_fail_together(tmp_path):
    run_ranks(_save, 2, tmp_path)
    run_ranks(_different_files, 2, tmp_path)


def _no_file(rank, world_size, path):
    with pytest.raises(FileNotFoundError, match=r"missing.pt exists on no rank"):
        Checkpoint.load_objects({"optimizer": zero_adam(tiny_model())}, path)


def test_a_file_that_no_rank_sees_fails_on_every_rank(tmp_path):
    run_ranks(_no_file, 2, tmp_path / "missing.pt")


def test_optimizer_state_part_selects_by_index():
    entry = {"state": {0: {"step": 1}, 3: {"step": 2}}, "param_groups": [{"params": [0, 1, 2, 3]}]}
    assert OptimizerStatePart((3, 5)).select(entry) == {
        "state": {3: {"step": 2}},
        "param_groups": entry["param_groups"],
    }
