"""Loading on any number of ranks with bounded memory: every rank that sees the file reads its part of it, the first
one maps it and sends the others only their part, and ranks that see different files, or none, fail together.

Checkpoints written by other tools load too: directories of plain ``dcp.save`` of ``get_state_dict`` state dicts (as
torchtitan writes them) and plain ``torch.save`` files, into FSDP1, FSDP2, ZeRO and plain models on any world size,
with a warning that there is nothing to verify them against; and an engine's state loads weights-only."""

import ctypes
import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from ignite.engine import Engine, Events
from launcher import run_ranks
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.nn.parallel import DistributedDataParallel
from training import assert_state_equal, shard, small_net, tiny_model, train_step, zero_adam

from ignite_zero import Checkpoint, DiskSaver
from ignite_zero.adapters.zero import ZeROState

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


@pytest.mark.distributed
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


@pytest.mark.distributed
@needs_root
def test_ranks_that_see_different_files_fail_together(tmp_path):
    run_ranks(_save, 2, tmp_path)
    run_ranks(_different_files, 2, tmp_path)


def _no_file(rank, world_size, path):
    with pytest.raises(FileNotFoundError, match=r"missing.pt exists on no rank"):
        Checkpoint.load_objects({"optimizer": zero_adam(tiny_model())}, path)


@pytest.mark.distributed
def test_a_file_that_no_rank_sees_fails_on_every_rank(tmp_path):
    run_ranks(_no_file, 2, tmp_path / "missing.pt")


def _step(model, optimizer):
    model(torch.randn(4, 7, generator=torch.Generator().manual_seed(1))).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _full_state(model, optimizer):
    """The full model and optimizer state on rank 0, as ignite_zero saves it, keyed by parameter names."""
    held = {}
    Checkpoint({"model": model, "optimizer": optimizer}, lambda checkpoint, name: held.update(checkpoint))(
        Engine(lambda e, b: None)
    )
    return held


def _save_with_dcp(rank, world_size, directory):
    model = shard(small_net(), "fsdp2")
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    _step(model, optimizer)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(directory))
    return _full_state(model, optimizer)


def _objects(kind):
    if kind in ("fsdp1", "fsdp2"):
        model = shard(small_net(), kind)
    elif kind == "zero":
        model = DistributedDataParallel(small_net())
    else:
        model = small_net()
    optimizer = zero_adam(model) if kind == "zero" else torch.optim.Adam(model.parameters(), lr=0.01)
    return model, optimizer


def _load(rank, world_size, path, kind):
    model, optimizer = _objects(kind)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Checkpoint.load_objects({"model": model, "optimizer": optimizer}, path)
    warned = any("carries no ignite_zero" in str(warning.message) for warning in caught)
    if kind == "plain":
        return warned, {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    return warned, _full_state(model, optimizer)


def _as_plain(saved):
    """Name-keyed optimizer state as a plain Adam over the same model holds it (by index, in parameter order)."""
    names = saved["optimizer"]["param_groups"][0]["params"]
    state = {names.index(name): value for name, value in saved["optimizer"]["state"].items()}
    groups = [
        {**group, "params": [names.index(name) for name in group["params"]]}
        for group in saved["optimizer"]["param_groups"]
    ]
    return {"model": saved["model"], "optimizer": {"state": state, "param_groups": groups}}


@pytest.mark.distributed
@pytest.mark.parametrize("kind, world_size", [("fsdp2", 3), ("fsdp1", 2), ("zero", 2), ("plain", 1)])
def test_a_directory_of_plain_dcp_save_loads_anywhere(tmp_path, kind, world_size):
    expected = run_ranks(_save_with_dcp, 2, tmp_path / "dcp")[0]
    init = world_size > 1
    warned, loaded = run_ranks(_load, world_size, tmp_path / "dcp", kind, init=init)[0]
    assert warned
    if kind in ("zero", "plain"):  # index-keyed, as those optimizers hold their state
        expected = _as_plain(expected)
    assert_state_equal(_sorted(loaded), _sorted(expected))


def _sorted(state):
    """Optimizer state entries in one key order: loading keeps the order the checkpoint gives."""
    optimizer = state["optimizer"]
    entries = {index: dict(sorted(value.items())) for index, value in optimizer["state"].items()}
    return {"model": state["model"], "optimizer": {**optimizer, "state": entries}}


def _load_file(rank, world_size, path, kind):
    warned, loaded = _load(rank, world_size, path, kind)
    return warned, loaded


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["fsdp2", "fsdp1", "zero"])
def test_a_plain_torch_save_file_loads_into_sharded_objects(tmp_path, kind):
    model = small_net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    _step(model, optimizer)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "plain.pt")
    warned, loaded = run_ranks(_load_file, 2, tmp_path / "plain.pt", kind)[0]
    assert warned
    if kind != "zero":  # FSDP state comes back keyed by parameter names
        loaded = _as_plain(loaded)
    expected = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    assert_state_equal(_sorted(loaded), _sorted(expected))


def test_files_without_trailer_load_with_a_warning(tmp_path):
    model = tiny_model()
    torch.save(model.state_dict(), tmp_path / "plain.pt")
    fresh = tiny_model(1)
    with pytest.warns(UserWarning, match="carries no ignite_zero integrity trailer"):
        Checkpoint.load_objects({"model": fresh}, tmp_path / "plain.pt")
    assert_state_equal(fresh.state_dict(), model.state_dict())


def test_checkpoint_engine_state_loads_weights_only(tmp_path):
    trainer = Engine(lambda e, b: None)
    trainer.run(range(3), max_epochs=2)
    handler = Checkpoint({"trainer": trainer}, DiskSaver(tmp_path))
    handler(trainer)
    resumed = Engine(lambda e, b: None)
    Checkpoint.load_objects({"trainer": resumed}, tmp_path / "trainer_6.pt")
    assert (resumed.state.epoch, resumed.state.iteration) == (2, 6)
