"""ZeRO and OSS through Checkpoint on real gloo ranks: saved state equals torch's own consolidation, loads on any
world size, resumes bitwise, and every misuse fails on every rank instead of hanging; and the part of an optimizer's
entry that a rank loads."""

import functools

import pytest
import torch
import torch.distributed as dist
from fairscale.optim import OSS
from ignite.engine import Engine, Events
from launcher import run_ranks
from torch.nn.parallel import DistributedDataParallel
from training import assert_state_equal, tiny_model, train_step, zero_adam

from ignite_zero import Checkpoint, CollectiveTimeoutError, ConsolidateZeROHandler, DiskSaver, RankFailureError
from ignite_zero.adapters.zero import OptimizerStatePart

pytestmark = pytest.mark.distributed


def _trainer(model, optimizer, rank):
    return Engine(lambda engine, _: train_step(model, optimizer, rank, engine.state.iteration))


def _make_optimizer(kind, model):
    if kind == "zero":
        return zero_adam(model)
    if kind == "zero_bucket_view":
        return zero_adam(model, parameters_as_bucket_view=True)
    if kind == "oss":
        return OSS(model.parameters(), optim=torch.optim.Adam, lr=0.01)
    raise ValueError(kind)


def _save_then_consolidate(rank, world_size, dirname, kind, recipient):
    model = DistributedDataParallel(tiny_model())
    optimizer = _make_optimizer(kind, model)
    trainer = _trainer(model, optimizer, rank)
    to_save = {"model": model, "optimizer": optimizer, "trainer": trainer}
    checkpoint = Checkpoint(to_save, DiskSaver(dirname), n_saved=1, consolidate_recipient_rank=recipient)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, checkpoint)
    trainer.run(range(3), max_epochs=2)
    # torch's (or fairscale's) own consolidation of the same state, right after our save
    if kind == "oss":
        optimizer.consolidate_state_dict(recipient_rank=recipient)
    else:
        optimizer.consolidate_state_dict(to=recipient)
    expected = optimizer.state_dict() if rank == recipient else None
    return str(checkpoint.last_checkpoint), expected, model.module.state_dict()


@pytest.mark.parametrize(
    "kind, world_size, recipient",
    [("zero", 2, 0), ("zero", 3, 1), ("zero_bucket_view", 2, 1), ("oss", 2, 0), ("oss", 3, 2)],
)
def test_saved_optimizer_state_equals_the_optimizers_own_consolidation(tmp_path, kind, world_size, recipient):
    results = run_ranks(_save_then_consolidate, world_size, tmp_path, kind, recipient)
    path, expected, model_state = results[recipient]
    assert path == str(tmp_path / "checkpoint_6.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_6.pt"]
    saved = torch.load(path, weights_only=True)
    assert_state_equal(saved["optimizer"], expected)
    assert_state_equal(saved["model"], model_state)
    assert saved["trainer"]["iteration"] == 6
    assert len(saved["optimizer"]["state"]) == 6  # every parameter, not one rank's shard
    assert all(r[0] == path for r in results), "every rank names the same last checkpoint"


def _train_and_save(rank, world_size, dirname, epochs):
    model = DistributedDataParallel(tiny_model())
    optimizer = zero_adam(model)
    trainer = _trainer(model, optimizer, rank)
    to_save = {"model": model, "optimizer": optimizer, "trainer": trainer}
    trainer.add_event_handler(Events.EPOCH_COMPLETED, Checkpoint(to_save, DiskSaver(dirname), n_saved=None))
    trainer.run(range(3), max_epochs=epochs)
    return {name: p.detach().clone() for name, p in model.module.named_parameters()}


def _resume(rank, world_size, path, epochs):
    model = DistributedDataParallel(tiny_model(seed=123))
    optimizer = zero_adam(model)
    trainer = _trainer(model, optimizer, rank)
    to_load = {"model": model, "optimizer": optimizer, "trainer": trainer}
    Checkpoint.load_objects(to_load=to_load, checkpoint=path)
    resumed_at = trainer.state.epoch
    trainer.run(range(3), max_epochs=epochs)
    optimizer.consolidate_state_dict(to=0)
    consolidated = optimizer.state_dict() if rank == 0 else None
    return resumed_at, {name: p.detach().clone() for name, p in model.module.named_parameters()}, consolidated


def test_resumed_run_is_bitwise_equal_to_an_uninterrupted_one(tmp_path):
    uninterrupted = run_ranks(_train_and_save, 2, tmp_path / "a", 4)
    run_ranks(_train_and_save, 2, tmp_path / "b", 2)
    resumed = run_ranks(_resume, 2, tmp_path / "b" / "checkpoint_6.pt", 4)
    for rank in range(2):
        assert resumed[rank][0] == 2
        assert_state_equal(resumed[rank][1], uninterrupted[rank])
    # and the optimizer state continued exactly as the saved run's would have
    assert_state_equal(resumed[0][2], torch.load(tmp_path / "a" / "checkpoint_12.pt", weights_only=True)["optimizer"])


def _load_and_consolidate(rank, world_size, path):
    model = DistributedDataParallel(tiny_model(seed=99))
    optimizer = zero_adam(model)
    Checkpoint.load_objects(to_load={"model": model, "optimizer": optimizer}, checkpoint=path)
    optimizer.consolidate_state_dict(to=0)
    return (optimizer.state_dict(), model.module.state_dict()) if rank == 0 else None


@pytest.mark.parametrize("saved_on, loaded_on", [(2, 3), (3, 2), (4, 2), (2, 1)])
def test_checkpoint_loads_on_another_world_size(tmp_path, saved_on, loaded_on):
    run_ranks(_train_and_save, saved_on, tmp_path, 1)
    path = tmp_path / "checkpoint_3.pt"
    saved = torch.load(path, weights_only=True)
    optimizer_state, model_state = run_ranks(_load_and_consolidate, loaded_on, path)[0]
    assert_state_equal(optimizer_state, saved["optimizer"])
    assert_state_equal(model_state, saved["model"])
    assert torch.load(path, weights_only=True)["optimizer"]["state"].keys() == saved["optimizer"]["state"].keys()


def test_zero_checkpoint_loads_into_a_plain_optimizer_without_process_group(tmp_path):
    run_ranks(_train_and_save, 3, tmp_path, 1)
    saved = torch.load(tmp_path / "checkpoint_3.pt", weights_only=True)
    model = tiny_model(seed=5)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.5)
    Checkpoint.load_objects(to_load={"model": model, "optimizer": optimizer}, checkpoint=tmp_path / "checkpoint_3.pt")
    assert_state_equal(optimizer.state_dict(), saved["optimizer"])
    assert_state_equal(model.state_dict(), saved["model"])
    # stock ignite reads the same file
    from ignite.handlers import Checkpoint as IgniteCheckpoint

    other = torch.optim.Adam(tiny_model(seed=6).parameters())
    IgniteCheckpoint.load_objects(to_load={"optimizer": other}, checkpoint=tmp_path / "checkpoint_3.pt")
    assert_state_equal(other.state_dict()["state"], saved["optimizer"]["state"])


def _save_before_first_step(rank, world_size, dirname):
    model = tiny_model()
    optimizer = zero_adam(model)
    Checkpoint({"optimizer": optimizer}, DiskSaver(dirname))(Engine(lambda e, b: None))
    optimizer.consolidate_state_dict(to=0)
    return optimizer.state_dict() if rank == 0 else None


def test_save_before_the_first_step(tmp_path):
    expected = run_ranks(_save_before_first_step, 2, tmp_path)[0]
    saved = torch.load(tmp_path / "optimizer_0.pt", weights_only=True)
    assert saved["state"] == {}
    assert_state_equal(saved, expected)
    torch.optim.Adam(tiny_model().parameters()).load_state_dict(saved)


def _stale_consolidation(rank, world_size, dirname):
    model = DistributedDataParallel(tiny_model())
    optimizer = zero_adam(model)
    trainer = _trainer(model, optimizer, rank)
    # the consolidating handler runs before the checkpoint, and only every 2 epochs
    ConsolidateZeROHandler(optimizer, call_every=2).attach(trainer)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, Checkpoint({"optimizer": optimizer}, DiskSaver(dirname)))
    trainer.run(range(2), max_epochs=3)
    optimizer.consolidate_state_dict(to=0)
    return optimizer.state_dict() if rank == 0 else None


def test_checkpoint_never_saves_a_stale_consolidation(tmp_path):
    expected = run_ranks(_stale_consolidation, 2, tmp_path)[0]
    assert_state_equal(torch.load(tmp_path / "optimizer_6.pt", weights_only=True), expected)


def _sub_group(rank, world_size, dirname, recipient):
    group = dist.new_group([0, 1])
    model = tiny_model()
    if rank in (0, 1):
        optimizer = torch.distributed.optim.ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.Adam, process_group=group, lr=0.01
        )
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    train_step(model, optimizer, rank, 0)
    checkpoint = Checkpoint({"optimizer": optimizer}, DiskSaver(dirname), consolidate_recipient_rank=recipient)
    try:
        checkpoint(Engine(lambda e, b: None))
    except RankFailureError as error:
        return str(error)
    if rank in (0, 1):
        optimizer.consolidate_state_dict(to=0)
    return optimizer.state_dict() if rank == 0 else None


def test_zero_on_a_sub_group(tmp_path):
    expected = run_ranks(_sub_group, 3, tmp_path, 0)[0]
    assert_state_equal(torch.load(tmp_path / "optimizer_0.pt", weights_only=True), expected)
    errors = run_ranks(_sub_group, 3, tmp_path / "other", 2)
    # The save needs the ranks of the optimizer's group, which raise the same error; rank 2 holds replicated state
    # only, and saves it without waiting for anyone.
    assert errors[0] == errors[1] and errors[2] is None
    assert (
        "Recipient rank 2 is not in the process group of this ZeroRedundancyOptimizer (global ranks [0, 1])"
        in (errors[0])
    )
    assert "failed on 2 of 2 ranks: ranks [0, 1]: ValueError: Recipient rank 2" in errors[0]  # named once, alike


def _overlap_with_ddp(rank, world_size, dirname):
    model = DistributedDataParallel(tiny_model())
    optimizer = zero_adam(model, overlap_with_ddp=True)
    with pytest.raises(RankFailureError, match="overlap_with_ddp=True` and is not initialised yet"):
        Checkpoint({"optimizer": optimizer}, DiskSaver(dirname))(Engine(lambda e, b: None))


def test_zero_overlapping_ddp_before_its_initialisation_is_a_clear_error(tmp_path):
    # torch refuses the overlap hook on gloo, so the initialised case runs only with NCCL.
    run_ranks(_overlap_with_ddp, 2, tmp_path)


def _failing_write(rank, world_size):
    def saver(checkpoint, filename):  # called on every rank, as ignite calls it; it writes on the recipient only
        if rank == 1:
            raise OSError(28, "No space left on device")

    optimizer = zero_adam(tiny_model())
    checkpoint = Checkpoint({"optimizer": optimizer}, saver, consolidate_recipient_rank=1)
    with pytest.raises(RankFailureError) as info:
        checkpoint(Engine(lambda e, b: None))
    return str(info.value), checkpoint.last_checkpoint


def test_a_failed_write_on_the_recipient_raises_on_every_rank():
    results = run_ranks(_failing_write, 3)
    messages = {message for message, _ in results}
    assert messages == {
        "The checkpoint save of optimizer_0.pt failed on 1 of 3 ranks: rank 1: OSError: [Errno 28] No space left on "
        "device"
    }
    assert all(last is None for _, last in results)


def _load_on_one_rank(rank, world_size, path):
    optimizer = zero_adam(tiny_model())
    if rank == 1:
        with pytest.raises(CollectiveTimeoutError, match=r"waiting for ranks \[0\] at the checkpoint load"):
            Checkpoint.load_objects({"optimizer": optimizer}, path, sync_timeout=1.0)


def test_load_of_sharded_objects_called_on_one_rank_fails_fast(tmp_path):
    run_ranks(_train_and_save, 2, tmp_path, 1)
    run_ranks(_load_on_one_rank, 2, tmp_path / "checkpoint_3.pt", timeout=30)


def _handler_consolidates(rank, world_size, kind, recipient, epoch_level):
    model = DistributedDataParallel(tiny_model())
    optimizer = _make_optimizer(kind, model)
    trainer = _trainer(model, optimizer, rank)
    ConsolidateZeROHandler(optimizer, call_every=2, recipient_rank=recipient, epoch_level=epoch_level).attach(trainer)
    states = []

    @trainer.on(Events.COMPLETED)
    def keep(engine):
        if rank == recipient:
            states.append((engine.state.iteration, optimizer.state_dict()))

    trainer.run(range(2), max_epochs=2)
    if kind == "oss":
        optimizer.consolidate_state_dict(recipient_rank=recipient)
    else:
        optimizer.consolidate_state_dict(to=recipient)
    return (states, optimizer.state_dict()) if rank == recipient else None


@pytest.mark.parametrize("kind, recipient, epoch_level", [("zero", 1, True), ("oss", 0, False)])
def test_consolidate_handler_leaves_the_current_state_on_the_recipient(kind, recipient, epoch_level):
    states, expected = run_ranks(_handler_consolidates, 2, kind, recipient, epoch_level)[recipient]
    # it ran at the end of epoch 2 (iteration 4): the state the handlers after it see is current
    assert [iteration for iteration, _ in states] == [4]
    assert_state_equal(states[0][1], expected)


def _counting(method, calls):
    @functools.wraps(method)
    def counted(*args, **kwargs):
        calls.append(1)
        return method(*args, **kwargs)

    return counted


def _reload(rank, world_size, dirname):
    model = DistributedDataParallel(tiny_model())
    optimizer = zero_adam(model)
    trainer = _trainer(model, optimizer, rank)
    checkpoint = Checkpoint({"model": model, "optimizer": optimizer, "trainer": trainer}, DiskSaver(dirname))
    trainer.add_event_handler(Events.EPOCH_COMPLETED, checkpoint)
    trainer.run(range(3), max_epochs=1)

    consolidations = []
    fresh_model = DistributedDataParallel(tiny_model(seed=9))
    fresh_optimizer = zero_adam(fresh_model)
    for opt in (optimizer, fresh_optimizer):
        opt.consolidate_state_dict = _counting(opt.consolidate_state_dict, consolidations)
    checkpoint.reload_objects({"model": fresh_model, "optimizer": fresh_optimizer}, global_step=3)
    assert consolidations == [], "reloading runs no consolidation"
    for opt in (optimizer, fresh_optimizer):
        opt.consolidate_state_dict(to=0)
    if rank == 0:
        assert_state_equal(fresh_optimizer.state_dict(), optimizer.state_dict())
    assert_state_equal(fresh_model.module.state_dict(), model.module.state_dict())


def test_reload_objects_restores_sharded_state_without_consolidating(tmp_path):
    run_ranks(_reload, 2, tmp_path)


def _private_attribute(rank, world_size):
    from ignite_zero import _compat

    model = tiny_model()
    return (
        _compat.consolidated_state_attribute(zero_adam(model)),
        _compat.consolidated_state_attribute(OSS(model.parameters(), optim=torch.optim.Adam, lr=0.01)),
    )


def test_the_fast_path_still_finds_where_zero_and_oss_keep_consolidated_state():
    """If torch or fairscale rename the list they merge from, this fails loudly (at run time the optimizers'
    own, slower consolidation takes over)."""
    assert run_ranks(_private_attribute, 2)[0] == ("_all_state_dicts", "_all_states")


def _load_leaves_the_dict_alone(rank, world_size, state):
    import copy

    before = copy.deepcopy(state)
    optimizer = zero_adam(DistributedDataParallel(tiny_model(seed=4)))
    Checkpoint.load_objects({"optimizer": optimizer}, state)
    # ZeroRedundancyOptimizer.load_state_dict sets the entries a rank does not own to None in the dict it is given
    assert_state_equal(state, before)
    assert all(value is not None for value in state["optimizer"]["state"].values())


def test_load_objects_never_mutates_the_checkpoint_it_is_given(tmp_path):
    run_ranks(_train_and_save, 2, tmp_path, 1)
    state = torch.load(tmp_path / "checkpoint_3.pt", weights_only=True)
    run_ranks(_load_leaves_the_dict_alone, 2, state)


def test_optimizer_state_part_selects_by_index():
    entry = {"state": {0: {"step": 1}, 3: {"step": 2}}, "param_groups": [{"params": [0, 1, 2, 3]}]}
    assert OptimizerStatePart((3, 5)).select(entry) == {
        "state": {3: {"step": 2}},
        "param_groups": entry["param_groups"],
    }
