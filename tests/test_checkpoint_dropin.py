"""Code written for ignite's Checkpoint works unchanged with ours: rank-0-only handlers of replicated state, ignite's
own savers and any other handler called on every rank, ignite's messages, reassigned handlers, torch.save's keyword
arguments, ignite's form of include_self, and proxies of sharded optimizers."""

import os
import warnings
from unittest.mock import MagicMock

import ignite.distributed as idist
import pytest
import torch
import torch.distributed as dist
from ignite.engine import Engine, Events
from ignite.handlers import Checkpoint as IgniteCheckpoint
from ignite.handlers import DiskSaver as IgniteDiskSaver
from ignite.handlers import ModelCheckpoint as IgniteModelCheckpoint
from ignite.handlers.checkpoint import BaseSaveHandler
from launcher import run_ranks
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel
from training import assert_state_equal, tiny_model, train_step, zero_adam

from ignite_zero import Checkpoint, DiskSaver, ModelCheckpoint, RankFailureError, cli


def _trainer(model, optimizer, rank):
    return Engine(lambda engine, _: train_step(model, optimizer, rank, engine.state.iteration))


# --- 1. Handlers of replicated state wait for nobody -----------------------------------------------------------


def _rank_zero_only(rank, world_size, dirname, flavour):
    idist.get_rank()  # ignite's first call is a collective: make it on every rank, as a training script does
    model = DistributedDataParallel(tiny_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = _trainer(model, optimizer, rank)
    cls = ModelCheckpoint if flavour == "ours" else IgniteModelCheckpoint
    if rank == 0:  # the pattern of ignite's own distributed tests and of much user code
        handler = cls(dirname, "run", n_saved=1, require_empty=False)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, handler, {"model": model, "optimizer": optimizer})
    seen = []
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda _: seen.append(sorted(os.listdir(dirname))))
    trainer.run(range(2), max_epochs=4)  # DDP's all-reduce in every step: a rank stuck in a save would hang it
    return seen if rank == 0 else None


@pytest.mark.distributed
def test_a_rank_zero_only_model_checkpoint_over_ddp_saves_every_epoch_as_ignite_does(tmp_path):
    ours = run_ranks(_rank_zero_only, 2, tmp_path / "ours", "ours", timeout=60)[0]
    ignite = run_ranks(_rank_zero_only, 2, tmp_path / "ignite", "ignite", timeout=60)[0]
    assert ours == ignite == [[f"run_checkpoint_{2 * epoch}.pt"] for epoch in range(1, 5)]
    saved = torch.load(tmp_path / "ours" / "run_checkpoint_8.pt", weights_only=True)
    assert_state_equal(saved, torch.load(tmp_path / "ignite" / "run_checkpoint_8.pt", weights_only=True))


def _async_rank_zero_only(rank, world_size, dirname):
    model = DistributedDataParallel(tiny_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = _trainer(model, optimizer, rank)
    if rank == 0:
        handler = Checkpoint({"model": model}, DiskSaver(dirname), n_saved=2, async_save=True)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, handler)
    trainer.run(range(2), max_epochs=3)
    return sorted(os.listdir(dirname)) if rank == 0 else None


@pytest.mark.distributed
def test_an_asynchronous_rank_zero_only_handler_waits_for_nobody(tmp_path):
    assert run_ranks(_async_rank_zero_only, 2, tmp_path, timeout=60)[0] == ["model_4.pt", "model_6.pt"]


def _every_rank_plain(rank, world_size, dirname, flavour):
    model = DistributedDataParallel(tiny_model())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    trainer = _trainer(model, optimizer, rank)
    to_save = {"model": model, "optimizer": optimizer, "trainer": trainer}
    scores = iter([0.3, 0.5, 0.4, 0.9])
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda engine: engine.state.metrics.update(acc=next(scores)))
    cls, saver = (Checkpoint, DiskSaver) if flavour == "ours" else (IgniteCheckpoint, IgniteDiskSaver)
    handler = cls(to_save, saver(dirname, require_empty=False), n_saved=2, score_name="acc", include_self=True)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, handler)
    steps = []

    @trainer.on(Events.EPOCH_COMPLETED)
    def record(_):
        dist.barrier()  # every rank's save of this epoch is done
        steps.append((sorted(os.listdir(dirname)), str(handler.last_checkpoint), handler.state_dict()))

    trainer.run(range(2), max_epochs=4)
    return steps


@pytest.mark.distributed
def test_a_plain_handler_on_every_rank_matches_ignite_on_two_ranks(tmp_path):
    ours = run_ranks(_every_rank_plain, 2, tmp_path / "d", "ours")
    ignite = run_ranks(_every_rank_plain, 2, tmp_path / "d2", "ignite")
    normalised = [[(names, last.replace("/d2/", "/d/"), state) for names, last, state in rank] for rank in ignite]
    assert ours == normalised
    assert ours[0][-1][0] == ["checkpoint_acc=0.5000.pt", "checkpoint_acc=0.9000.pt"]
    saved = torch.load(tmp_path / "d" / "checkpoint_acc=0.9000.pt", weights_only=True)
    assert saved["checkpointer"] == ours[0][-1][2]  # include_self in ignite's own form
    assert_state_equal(saved, torch.load(tmp_path / "d2" / "checkpoint_acc=0.9000.pt", weights_only=True))


def _recipient_fails(rank, world_size, dirname):
    model = tiny_model()
    saver = DiskSaver(dirname)
    handler = Checkpoint({"model": model}, saver, n_saved=1)
    engine = Engine(lambda e, b: None)
    handler(engine)
    dist.barrier()  # every rank's first save is done: none of them may learn of the failure below yet
    engine.state.iteration = 1
    if rank == 0:
        saver._dump = lambda *args: (_ for _ in ()).throw(OSError(5, "Input/output error"))
        with pytest.raises(OSError, match="Input/output error"):
            handler(engine)
    dist.barrier()  # the recipient has failed: the others learn it at their next save, without waiting
    if rank == 1:
        with pytest.raises(RankFailureError, match=r"on rank 0, the recipient, failed: OSError: \[Errno 5\]"):
            handler(engine)
    return sorted(os.listdir(dirname))


@pytest.mark.distributed
def test_a_failed_save_of_replicated_state_reaches_the_other_ranks_without_a_wait(tmp_path):
    assert run_ranks(_recipient_fails, 2, tmp_path) == [["model_0.pt"]] * 2


# --- 2. Other handlers are called on every rank, as ignite calls them -------------------------------------------


def _counting_callable(rank, world_size, recipient):
    model = DistributedDataParallel(tiny_model())
    optimizer = zero_adam(model)
    trainer = _trainer(model, optimizer, rank)
    calls = []

    def save(checkpoint, filename, metadata):
        calls.append((filename, sorted(checkpoint), checkpoint["optimizer"] == {}, metadata["priority"]))

    handler = Checkpoint({"model": model, "optimizer": optimizer}, save, consolidate_recipient_rank=recipient)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, handler)
    trainer.run(range(2), max_epochs=3)
    return calls


@pytest.mark.distributed
def test_a_callable_handler_is_called_on_every_rank_with_empty_sharded_entries_elsewhere():
    for rank, calls in enumerate(run_ranks(_counting_callable, 3, 1)):
        assert calls == [(f"checkpoint_{i}.pt", ["model", "optimizer"], rank != 1, i) for i in (2, 4, 6)]


class _BarrierSaver(BaseSaveHandler):
    """Saves on rank 0 and removes behind a barrier, as ignite's NeptuneSaver does."""

    def __init__(self, log):
        self.log = log

    def __call__(self, checkpoint, filename, metadata=None):
        self.log.append(("save", filename, "state" in checkpoint.get("optimizer", {})))

    @idist.one_rank_only(with_barrier=True)
    def _remove(self, filename):
        self.log.append(("removed by rank 0", filename))

    def remove(self, filename):
        self.log.append(("remove", filename))
        self._remove(filename)


def _barrier_in_remove(rank, world_size):
    idist.get_rank()
    model = DistributedDataParallel(tiny_model())
    optimizer = zero_adam(model)
    trainer = _trainer(model, optimizer, rank)
    log = []
    handler = Checkpoint({"model": model, "optimizer": optimizer}, _BarrierSaver(log), n_saved=1)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, handler)
    trainer.run(range(2), max_epochs=3)
    return log


@pytest.mark.distributed
def test_a_handler_whose_remove_runs_a_barrier_is_called_on_every_rank_after_the_new_save():
    logs = run_ranks(_barrier_in_remove, 2, timeout=60)
    for rank, log in enumerate(logs):
        expected = [("save", "checkpoint_2.pt", rank == 0)]
        for old, new in (("checkpoint_2.pt", "checkpoint_4.pt"), ("checkpoint_4.pt", "checkpoint_6.pt")):
            expected += [("save", new, rank == 0), ("remove", old)] + [("removed by rank 0", old)] * (rank == 0)
        assert log == expected


def _ignite_disk_saver(rank, world_size, dirname):
    model = DistributedDataParallel(tiny_model())
    optimizer = zero_adam(model)
    trainer = _trainer(model, optimizer, rank)
    handler = Checkpoint({"optimizer": optimizer}, IgniteDiskSaver(dirname, save_on_rank=1, require_empty=False))
    trainer.add_event_handler(Events.EPOCH_COMPLETED, handler)
    trainer.run(range(2), max_epochs=1)
    optimizer.consolidate_state_dict(to=1)
    return optimizer.state_dict() if rank == 1 else str(handler.last_checkpoint)


@pytest.mark.distributed
def test_ignite_disk_saver_writes_the_full_state_on_its_own_save_on_rank(tmp_path):
    last, expected = run_ranks(_ignite_disk_saver, 2, tmp_path)
    assert last == str(tmp_path / "optimizer_2.pt")
    assert_state_equal(torch.load(tmp_path / "optimizer_2.pt", weights_only=True), expected)


# --- 3.-6. Messages, reassigned handlers, torch.save's keywords -------------------------------------------------


def test_ignite_messages_come_first(tmp_path):
    with pytest.raises(TypeError, match=r"^Object <class 'int'> should have `state_dict` method"):
        Checkpoint({"model": 1}, tmp_path)
    with pytest.raises(TypeError, match=r"^Object <class 'int'> should have `load_state_dict` method"):
        Checkpoint.load_objects({"model": 1}, {"model": {}})
    with pytest.raises(TypeError, match="^Argument checkpoint should be a string or a dictionary"):
        Checkpoint.load_objects({"model": tiny_model()}, 1)
    with pytest.raises(ValueError, match=f"^Directory path '{tmp_path / 'absent'}' is not found"):
        DiskSaver(tmp_path / "absent", create_dir=False, save_on_rank=0)
    (tmp_path / "old.pt").touch()
    with pytest.raises(ValueError, match=r"^Files \['old.pt'\] with extension '.pt' are already present"):
        DiskSaver(tmp_path, save_on_rank=0)


def test_a_strict_load_that_does_not_fit_raises_runtime_error_and_loads_nothing(tmp_path):
    model = tiny_model()
    before = {key: value.clone() for key, value in model.state_dict().items()}
    other = torch.nn.Sequential(torch.nn.Linear(7, 4))
    with pytest.raises(RuntimeError, match="Error.s. in loading state_dict for Sequential.*Nothing was loaded"):
        Checkpoint.load_objects({"model": model, "other": tiny_model()}, {"model": other.state_dict(), "other": {}})
    assert_state_equal(model.state_dict(), before)


def test_a_reassigned_save_handler_is_called_with_the_arity_it_has_then(tmp_path):
    engine = Engine(lambda e, b: None)
    handler = Checkpoint({"model": tiny_model()}, DiskSaver(tmp_path), n_saved=None, global_step_transform=lambda *_: 1)
    two, three = [], []
    handler.save_handler = lambda checkpoint, filename: two.append(filename)
    handler(engine)
    handler.save_handler = lambda checkpoint, filename, metadata: three.append((filename, metadata["basename"]))
    handler.global_step_transform = lambda *_: 2
    handler(engine)
    assert two == ["model_1.pt"] and three == [("model_2.pt", "model")]
    assert handler.last_checkpoint == "model_2.pt"  # as ignite: the file name, for a handler without a directory
    assert os.listdir(tmp_path) == []


def test_model_checkpoint_last_checkpoint_needs_a_disk_saver(tmp_path):
    handler = ModelCheckpoint(tmp_path, "run")
    handler.save_handler = lambda checkpoint, filename: None
    handler(Engine(lambda e, b: None), {"model": tiny_model()})
    with pytest.raises(RuntimeError, match="Internal error, save_handler should be DiskSaver"):
        _ = handler.last_checkpoint


def test_torch_save_keywords_and_the_legacy_format(tmp_path, capsys):
    handler = ModelCheckpoint(tmp_path, "run", _use_new_zipfile_serialization=False, pickle_protocol=2)
    model = tiny_model()
    handler(Engine(lambda e, b: None), {"model": model})
    path = tmp_path / "run_model_0.pt"
    assert path.read_bytes()[:2] == b"\x80\x02"  # a pickle stream, not a zip archive
    assert [name for name in os.listdir(tmp_path) if name != path.name] == []  # written atomically: no leftovers
    assert_state_equal(torch.load(path, weights_only=True), model.state_dict())
    fresh = tiny_model(seed=3)
    with pytest.warns(UserWarning, match="legacy format"):
        Checkpoint.load_objects({"model": fresh}, path)
    assert_state_equal(fresh.state_dict(), model.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # verify reports it, without a Python warning
        assert cli.main(["verify", str(path)]) == 2
    assert "legacy format" in capsys.readouterr().out
    saver = DiskSaver(tmp_path, require_empty=False, compression=1)  # made, and refused at the save, as ignite's
    with pytest.raises(TypeError, match="got an unexpected keyword argument 'compression'"):
        saver({"model": model.state_dict()}, "c.pt")


# --- 7. Proxies of sharded optimizers -----------------------------------------------------------------------------


def _proxy(rank, world_size, recipient):
    model = DistributedDataParallel(tiny_model())
    optimizer = zero_adam(model)
    train_step(model, optimizer, rank, 0)
    proxy = MagicMock(ZeroRedundancyOptimizer, wraps=optimizer)
    saved = {}
    handler = Checkpoint(
        {"optimizer": proxy}, lambda checkpoint, name: saved.update(checkpoint), save_on_rank=recipient
    )
    handler(Engine(lambda e, b: None))
    proxy.consolidate_state_dict.assert_called_once_with(to=recipient)
    optimizer.consolidate_state_dict(to=recipient)
    return (saved, optimizer.state_dict()) if rank == recipient else saved


@pytest.mark.distributed
def test_a_proxy_of_a_zero_optimizer_consolidates_itself_with_to():
    other, (saved, expected) = run_ranks(_proxy, 2, 1)
    assert other == {} and saved["state"]
    assert_state_equal(saved, expected)


def test_error_messages_never_raise_for_objects_without_a_qualname():
    class Sharded:
        consolidate_state_dict = MagicMock(spec=[])  # no __qualname__, no readable signature
        state_dict = load_state_dict = staticmethod(lambda *args: {})

    with pytest.raises(TypeError, match=r"Cannot tell how Sharded.consolidate_state_dict\(.*\) takes the recipient"):
        Checkpoint({"optimizer": Sharded()}, lambda checkpoint, name: None)(Engine(lambda e, b: None))


class _FailingOnce:
    """A plain object whose state cannot be read at its second save on rank 0."""

    def __init__(self, rank):
        self.rank, self.calls = rank, 0

    def state_dict(self):
        self.calls += 1
        if self.rank == 0 and self.calls == 2:
            raise OSError(5, "Input/output error")
        return {"calls": self.calls}

    def load_state_dict(self, state):
        pass


def _async_recipient_fails(rank, world_size, dirname):
    handler = Checkpoint({"thing": _FailingOnce(rank)}, DiskSaver(dirname), n_saved=1, async_save=True)
    engine = Engine(lambda e, b: None)
    handler(engine)
    handler.wait()
    dist.barrier()  # rank 0 waits for nobody: without this, rank 1's first call may already see the failure below
    engine.state.iteration = 1
    if rank == 0:
        with pytest.raises(OSError, match="Input/output error"):
            handler(engine)  # staging fails on the recipient
    dist.barrier()
    if rank == 1:
        with pytest.raises(RankFailureError, match=r"on rank 0, the recipient, failed: OSError"):
            handler(engine)


@pytest.mark.distributed
def test_a_failed_asynchronous_save_of_replicated_state_reaches_the_other_ranks(tmp_path):
    run_ranks(_async_recipient_fails, 2, tmp_path)
