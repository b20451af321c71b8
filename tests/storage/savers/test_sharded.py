"""Sharded checkpoints on real gloo ranks: every rank writes its own part through torch.distributed.checkpoint, the
directory is sealed with checksums, and it loads on any number of ranks, or in one process, for every kind of state."""

import errno
import json
import os
import pickle
import shutil

import pytest
import torch
from ignite.engine import Engine, Events
from launcher import run_ranks
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from training import assert_state_equal, mixed_objects, small_net, tiny_model, train_step, zero_adam

from ignite_zero import Checkpoint, IntegrityError, RankFailureError, ShardedSaver, tree
from ignite_zero.storage.formats import directory as sharded
from ignite_zero.storage.places import LocalPlace
from ignite_zero.storage.savers.sharded import share


def _save(rank, world_size, dirname, kind):
    objects = mixed_objects(kind, rank)
    trainer = objects["trainer"]
    checkpoint = Checkpoint(objects, ShardedSaver(dirname), n_saved=1, consolidate_recipient_rank=world_size - 1)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, checkpoint)
    trainer.run(range(2), max_epochs=2)
    # the full state, gathered by a consolidated save, for comparison
    Checkpoint({k: v for k, v in objects.items() if k != "trainer"}, dirname / "full")(trainer)
    return str(checkpoint.last_checkpoint)


@pytest.fixture(scope="module", params=["fsdp1", "fsdp2"])
def saved(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    assert run_ranks(_save, 2, directory, request.param) == [str(directory / "checkpoint_4.dcp")] * 2
    return request.param, directory


@pytest.mark.distributed
def test_a_sharded_checkpoint_is_a_sealed_directory_with_one_file_per_rank(saved):
    _, directory = saved
    assert sorted(p.name for p in directory.iterdir()) == ["checkpoint_4.dcp", "full"]
    checkpoint = directory / "checkpoint_4.dcp"
    assert sorted(p.name for p in checkpoint.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "ignite_zero.json",
        "ignite_zero_index.json",
    ]
    manifest = sharded.verify(checkpoint)
    assert manifest["world_size"] == 2
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp", "ignite_zero_index.json"]


@pytest.mark.distributed
def test_torch_own_tools_read_the_directory_as_the_full_state(saved, tmp_path):
    """The ranks' plans, agreed in the saver's rounds, make a directory that DCP's own reader takes whole."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    _, directory = saved
    dcp_to_torch_save(directory / "checkpoint_4.dcp", tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)
    (full_file,) = (directory / "full").iterdir()
    full = torch.load(full_file, weights_only=True)
    for name in ("model", "side_model"):
        assert whole[name].keys() == full[name].keys(), name
        for key, tensor in full[name].items():
            assert torch.equal(whole[name][key], tensor), (name, key)


def _load(rank, world_size, directory, kind):
    objects = mixed_objects(kind, rank, seed=7)
    Checkpoint.load_objects(objects, directory / "checkpoint_4.dcp")
    again = {k: v for k, v in objects.items() if k != "trainer"}
    Checkpoint(again, directory / f"again{world_size}")(Engine(lambda e, b: None))
    return objects["trainer"].state.iteration


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [3, 2, 1])
def test_loads_on_any_number_of_ranks(saved, world_size):
    kind, directory = saved
    assert run_ranks(_load, world_size, directory, kind) == [4] * world_size
    full = torch.load(directory / "full" / "checkpoint_4.pt", weights_only=True)
    again = torch.load(directory / f"again{world_size}" / "checkpoint_0.pt", weights_only=True)
    assert_state_equal(again, full)


class _Holder:
    """An object whose one tensor changes dtype or shape between saves, its name alike."""

    def __init__(self, x):
        self.x = x

    def state_dict(self):
        return {"x": self.x}

    def load_state_dict(self, state):
        self.x = state["x"]


def _zero_and_a_holder(rank, dirname):
    """A ZeRO optimizer, its model and a holder of one tensor, under a sharded checkpoint; and an engine."""
    model = tiny_model()
    optimizer = zero_adam(model)
    train_step(model, optimizer, rank, 0)
    holder = _Holder(torch.arange(6, dtype=torch.float32))
    checkpoint = Checkpoint({"model": model, "optimizer": optimizer, "holder": holder}, ShardedSaver(dirname))
    return checkpoint, holder, Engine(lambda e, b: None)


def _loaded_holder(checkpoint):
    """The holder of the checkpoint's latest save, loaded with fresh objects."""
    loaded = _Holder(None)
    Checkpoint.load_objects(
        {"model": tiny_model(1), "optimizer": zero_adam(tiny_model(1)), "holder": loaded}, checkpoint.last_checkpoint
    )
    return loaded


def _save_as_a_tensor_changes(rank, world_size, dirname):
    checkpoint, holder, engine = _zero_and_a_holder(rank, dirname)
    # a new dtype, the first one again (plans kept from the first save), then a new shape alone (which DCP tells)
    changes = [(torch.float32, 6), (torch.float64, 6), (torch.float32, 6), (torch.float32, 9)]
    for step, (dtype, length) in enumerate(changes, start=1):
        holder.x = torch.arange(length, dtype=dtype) * step
        engine.state.iteration = step
        checkpoint(engine)
        loaded = _loaded_holder(checkpoint)
        assert loaded.x.dtype == dtype and torch.equal(loaded.x, holder.x), (step, loaded.x)
    return True


@pytest.mark.distributed
def test_a_saver_plans_afresh_when_a_tensor_changes_dtype_or_shape_under_the_same_name(tmp_path):
    assert run_ranks(_save_as_a_tensor_changes, 2, tmp_path) == [True, True]


def _save_after_a_failed_save(rank, world_size, dirname):
    checkpoint, holder, engine = _zero_and_a_holder(rank, dirname)
    engine.state.iteration = 1
    checkpoint(engine)
    holder.x = torch.arange(9, dtype=torch.float32)  # a new shape, in a save that fails on one rank as it writes
    write_plan = sharded.DirectoryWriter.write_plan

    def failing(self, plan, resolve):
        raise OSError(errno.EIO, "Input/output error")

    if rank == 0:
        sharded.DirectoryWriter.write_plan = failing
    engine.state.iteration = 2
    try:
        with pytest.raises(RankFailureError, match="Input/output error"):
            checkpoint(engine)
    finally:
        sharded.DirectoryWriter.write_plan = write_plan
    engine.state.iteration = 3
    checkpoint(engine)
    loaded = _loaded_holder(checkpoint)
    assert torch.equal(loaded.x, holder.x), loaded.x
    return str(checkpoint.last_checkpoint)


@pytest.mark.distributed
def test_a_save_after_a_failed_one_plans_afresh_and_loads(tmp_path):
    assert run_ranks(_save_after_a_failed_save, 2, tmp_path) == [str(tmp_path / "checkpoint_3.dcp")] * 2


def _what_saves_exchange(rank, world_size, dirname):
    """Three saves of a training run, the state unchanged but for its values, then reshaped (the scheduler's state
    gains an entry): for each, whether this rank's offer in the preparation carried its plan, the other rounds it
    took, and the object collectives of the process group it ran."""
    import torch.distributed as dist

    from ignite_zero.agreement import rounds as agreement

    objects = mixed_objects("fsdp2", rank)
    trainer = objects["trainer"]
    checkpoint = Checkpoint(objects, ShardedSaver(dirname), n_saved=1)
    seen = []
    agree = agreement.agree

    def counted(payload, *, what, **kwargs):
        if what.startswith("preparation of"):
            seen.append(("plan offered", payload[1].offer.plan is not None))
        else:
            seen.append(("round", what.split(" of ")[0]))
        return agree(payload, what=what, **kwargs)

    names = ("gather_object", "all_gather_object", "scatter_object_list", "broadcast_object_list", "barrier")
    collectives = {name: getattr(dist, name) for name in names}

    def watched(name):
        def call(*args, **kwargs):
            seen.append(("collective", name))
            return collectives[name](*args, **kwargs)

        return call

    trainer.run([0], max_epochs=1)
    saves = []
    agreement.agree = counted
    for name in names:
        setattr(dist, name, watched(name))
    try:
        for step in (2, 3, 4):
            if step == 4:
                objects["lr_scheduler"].extra = torch.ones(3)  # in the scheduler's state dict, kept by one rank
            trainer.state.iteration = step
            seen.clear()
            checkpoint(trainer)
            saves.append(list(seen))
    finally:
        agreement.agree = agree
        for name, collective in collectives.items():
            setattr(dist, name, collective)
    return saves


@pytest.mark.distributed
def test_a_sharded_save_exchanges_dcp_plans_in_its_own_rounds_and_keeps_them(tmp_path):
    ranks = run_ranks(_what_saves_exchange, 2, tmp_path)
    assert any(("plan offered", True) in reshaped for _, _, reshaped in ranks), ranks  # the rank keeping the tensor
    for first, unchanged, reshaped in ranks:
        assert ("plan offered", True) in first and ("plan offered", False) in unchanged, (first, unchanged)
        for save in (first, unchanged, reshaped):
            assert not [what for kind, what in save if kind == "collective"], save  # DCP's gathers and scatters
            assert ("round", "planning") not in save, save  # no rank kept plans from another agreement


def _metadata_fails_on_the_coordinator(rank, world_size, dirname):
    checkpoint, holder, engine = _zero_and_a_holder(rank, dirname)
    engine.state.iteration = 1
    checkpoint(engine)
    write_metadata = sharded.DirectoryWriter.write_metadata

    def failing(self, metadata_file):
        raise OSError(errno.ENOSPC, "No space left on device")

    # called on the coordinator only; the save's plan is the first one's, so its .metadata is the first one's again
    sharded.DirectoryWriter.write_metadata = failing
    engine.state.iteration = 2
    try:
        with pytest.raises(RankFailureError, match=r"rank 0: OSError: \[Errno 28\] No space left on device"):
            checkpoint(engine)
    finally:
        sharded.DirectoryWriter.write_metadata = write_metadata
    left = sorted(name for name in os.listdir(dirname) if not name.startswith("."))
    holder.x = holder.x * 3
    engine.state.iteration = 3
    checkpoint(engine)
    assert torch.equal(_loaded_holder(checkpoint).x, holder.x)
    return left


@pytest.mark.distributed
def test_a_save_whose_metadata_fails_on_the_coordinator_fails_on_every_rank_and_keeps_the_previous(tmp_path):
    assert run_ranks(_metadata_fails_on_the_coordinator, 2, tmp_path) == [["checkpoint_1.dcp"]] * 2
    assert sorted(name for name in os.listdir(tmp_path) if not name.startswith(".")) == ["checkpoint_3.dcp"]


class _Counter:
    """A ``Stateful`` value of a state saved directly, as DCP takes them."""

    def __init__(self, count):
        self.count = count

    def state_dict(self):
        return {"count": torch.tensor(self.count)}

    def load_state_dict(self, state):
        self.count = int(state["count"])


def _stateful_values_saved_in_the_background(rank, world_size, dirname):
    from ignite_zero.transport.groups import cpu_group

    saver = ShardedSaver(dirname)
    state = {"counter": _Counter(3), "own": {f"x{rank}": torch.full((4,), float(rank))}}
    finish = saver.save_state_async(
        state, "state.dcp", group=cpu_group(dedicated="test"), timeout=60, stream="test", ranks=None
    )
    finish()
    return True


@pytest.mark.distributed
def test_stateful_values_are_saved_by_their_state_dict_in_the_background_too(tmp_path):
    assert run_ranks(_stateful_values_saved_in_the_background, 2, tmp_path) == [True, True]
    with sharded.DirectoryReader(LocalPlace(tmp_path / "state.dcp")) as reader:
        loaded = reader.load(weights_only=True)
    assert int(loaded["counter"]["count"]) == 3
    assert torch.equal(loaded["own"]["x1"], torch.ones(4)) and torch.equal(loaded["own"]["x0"], torch.zeros(4))


def _rounds_of_a_load(rank, world_size, directory, kind):
    from ignite_zero.agreement import rounds as agreement

    rounds = []
    agree = agreement.agree

    def counted(payload, *, what, **kwargs):
        rounds.append(what)
        return agree(payload, what=what, **kwargs)

    agreement.agree = counted
    try:
        Checkpoint.load_objects(mixed_objects(kind, rank, seed=7), directory / "checkpoint_4.dcp")
    finally:
        agreement.agree = agree
    return rounds


@pytest.mark.distributed
def test_a_checkpoint_no_host_replicated_costs_the_search_for_replicas_one_round(saved):
    kind, directory = saved
    for rounds in run_ranks(_rounds_of_a_load, 2, directory, kind):
        assert sum(what.startswith("search for the parts of") for what in rounds) == 1, rounds


@pytest.mark.distributed
def test_loads_into_plain_objects_without_process_group(saved):
    _, directory = saved
    model, side = small_net(), tiny_model(seed=3)
    optimizer, side_optimizer = torch.optim.Adam(model.parameters()), torch.optim.Adam(side.parameters())
    trainer = Engine(lambda e, b: None)
    to_load = {
        "model": model,
        "optimizer": optimizer,
        "side_model": side,
        "side_optimizer": side_optimizer,
        "trainer": trainer,
    }
    Checkpoint.load_objects(to_load, directory / "checkpoint_4.dcp")
    full = torch.load(directory / "full" / "checkpoint_4.pt", weights_only=True)
    assert_state_equal(model.state_dict(), dict(full["model"]))
    assert_state_equal(side.state_dict(), full["side_model"])
    assert_state_equal(side_optimizer.state_dict(), full["side_optimizer"])
    assert trainer.state.iteration == 4


def _async_and_retention(rank, world_size, dirname):
    objects = mixed_objects("fsdp2", rank)
    trainer = objects["trainer"]
    checkpoint = Checkpoint(
        objects,
        ShardedSaver(dirname),
        n_saved=1,
        async_save=True,
        filename_pattern="{name}_{global_step}.{ext}",
        global_step_transform=lambda e, _: e.state.iteration,
    )
    trainer.add_event_handler(Events.EPOCH_COMPLETED, checkpoint)
    trainer.run(range(2), max_epochs=3)  # the end of the run waits for the last save
    Checkpoint({k: v for k, v in objects.items() if k != "trainer"}, dirname / "full")(trainer)
    return str(checkpoint.last_checkpoint)


@pytest.mark.distributed
def test_asynchronous_sharded_saves_and_retention(tmp_path):
    results = run_ranks(_async_and_retention, 2, tmp_path)
    assert results == [str(tmp_path / "checkpoint_6.dcp")] * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_6.dcp", "full"]
    sharded.verify(tmp_path / "checkpoint_6.dcp")
    model = small_net()
    side = tiny_model(seed=3)
    to_load = {"model": model, "side_model": side}
    Checkpoint.load_objects(to_load, tmp_path / "checkpoint_6.dcp")
    full = torch.load(tmp_path / "full" / "checkpoint_6.pt", weights_only=True)
    assert_state_equal(model.state_dict(), dict(full["model"]))
    assert_state_equal(side.state_dict(), full["side_model"])


def _constant_name(rank, world_size, dirname):
    model = DistributedDataParallel(tiny_model())
    optimizer = zero_adam(model)
    checkpoint = Checkpoint(
        {"model": model, "optimizer": optimizer}, ShardedSaver(dirname), filename_pattern="latest.dcp"
    )
    engine = Engine(lambda e, b: None)
    for iteration in (1, 2):
        train_step(model, optimizer, rank, iteration)
        engine.state.iteration = iteration
        checkpoint(engine)
    return model.module.state_dict()


@pytest.mark.distributed
def test_a_constant_name_is_replaced_by_the_complete_new_directory(tmp_path):
    model_state = run_ranks(_constant_name, 2, tmp_path)[0]
    assert [p.name for p in tmp_path.iterdir()] == ["latest.dcp"]
    sharded.verify(tmp_path / "latest.dcp")
    model = tiny_model(seed=4)
    Checkpoint.load_objects({"model": model}, tmp_path / "latest.dcp")
    assert_state_equal(model.state_dict(), model_state)


def _killed_before_sealing(rank, world_size, dirname):
    model = DistributedDataParallel(tiny_model())
    optimizer = zero_adam(model)
    saver = ShardedSaver(dirname)
    checkpoint = Checkpoint({"model": model, "optimizer": optimizer}, saver, n_saved=1, sync_timeout=2.0)
    engine = Engine(lambda e, b: None)
    engine.state.iteration = 1
    checkpoint(engine)
    if rank == 0:  # the recipient dies after every rank wrote its files, before the directory is sealed
        sharded.seal = lambda *args, **kwargs: os.kill(os.getpid(), 9)
    engine.state.iteration = 2
    with pytest.raises(Exception, match=r"waiting for ranks \[0\]"):
        checkpoint(engine)
    return str(checkpoint.last_checkpoint)


@pytest.mark.distributed
def test_a_save_interrupted_before_sealing_leaves_the_previous_checkpoint(tmp_path):
    results = run_ranks(_killed_before_sealing, 2, tmp_path, killed=[0], timeout=60)
    assert results[1] == str(tmp_path / "checkpoint_1.dcp")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [".checkpoint_2.dcp.ignite_zero-partial.tmp", "checkpoint_1.dcp"]  # never taken for a checkpoint
    sharded.verify(tmp_path / "checkpoint_1.dcp")
    Checkpoint.load_objects({"model": tiny_model(seed=2)}, tmp_path / "checkpoint_1.dcp")
    with pytest.warns(UserWarning, match="carries no ignite_zero manifest"):  # never sealed
        sharded.verify(tmp_path / ".checkpoint_2.dcp.ignite_zero-partial.tmp")


@pytest.mark.distributed
def test_corrupt_and_missing_files_are_refused(saved, tmp_path):
    _, directory = saved
    copy = tmp_path / "copy.dcp"
    shutil.copytree(directory / "checkpoint_4.dcp", copy)
    metadata = pickle.loads((copy / ".metadata").read_bytes())
    read = next(info for index, info in metadata.storage_data.items() if index.fqn.startswith("side_model."))
    good = (copy / read.relative_path).read_bytes()
    # a byte that the load reads: caught as it arrives, naming the file and the entry
    data = bytearray(good)
    data[read.offset + read.length // 2] ^= 0x01
    (copy / read.relative_path).write_bytes(bytes(data))
    entry = rf"copy.dcp/{read.relative_path}, entry side_model\..* is corrupt \(CRC-32"
    with pytest.raises(IntegrityError, match=entry):
        Checkpoint.load_objects({"side_model": tiny_model()}, copy)
    with pytest.raises(IntegrityError, match=rf"copy.dcp: file {read.relative_path} is corrupt \(CRC-32"):
        sharded.verify(copy)  # every byte, as `ignite-zero verify` checks it
    (copy / read.relative_path).write_bytes(good)
    # a manifest without the records of a file's entries, which every manifest of ours has: refused, never read
    # otherwise, by a load and by a verification alike
    sealed = (copy / sharded.MANIFEST).read_text()
    manifest = json.loads(sealed)
    del manifest["files"][read.relative_path]["records"]
    (copy / sharded.MANIFEST).write_text(json.dumps(manifest))
    lacks = rf"{sharded.MANIFEST} lacks the records of the entries of {read.relative_path}, .* save it again"
    with pytest.raises(IntegrityError, match=lacks):
        Checkpoint.load_objects({"side_model": tiny_model()}, copy)
    with pytest.raises(IntegrityError, match=lacks):
        sharded.verify(copy)
    (copy / sharded.MANIFEST).write_text(sealed)
    Checkpoint.load_objects({"side_model": tiny_model()}, copy)
    (copy / "__1_0.distcp").unlink()
    with pytest.raises(IntegrityError, match=r"file __1_0.distcp is missing"):
        sharded.verify(copy)


def _filled_in_place(objects):
    """Every tensor that a load should fill in place: the ZeRO optimizer's state and its model's parameters, and
    FSDP2's parameters and optimizer state (FSDP1 reads into copies of its shards)."""

    def state(optimizer):
        return [value for values in optimizer.state.values() for value in values.values()]

    tensors = [*objects["side_model"].parameters(), *state(objects["side_optimizer"].optim)]
    if isinstance(next(objects["model"].parameters()), DTensor):
        tensors += [*objects["model"].parameters(), *state(objects["optimizer"])]
    return [(t.to_local() if isinstance(t, DTensor) else t).detach() for t in tensors if t.dim() > 0]


def _load_in_place(rank, world_size, directory, corrupt):
    objects = mixed_objects("fsdp2" if "fsdp2" in str(directory) else "fsdp1", rank, seed=7)
    objects["trainer"].run(range(1), max_epochs=1)  # the optimizers' state exists
    before = [t.clone() for t in _filled_in_place(objects)]
    # an object that does not fit the checkpoint: refused on every rank, and nothing changes, FSDP shards included
    with pytest.raises(RankFailureError, match="does not fit the model"):
        Checkpoint.load_objects({**objects, "side_model": nn.Linear(3, 3)}, directory / "checkpoint_4.dcp")
    unchanged = all(torch.equal(a, b) for a, b in zip(before, _filled_in_place(objects)))
    pointers = [t.data_ptr() for t in _filled_in_place(objects)]
    Checkpoint.load_objects(objects, directory / "checkpoint_4.dcp")
    in_place = unchanged and [t.data_ptr() for t in _filled_in_place(objects)] == pointers
    again = {k: v for k, v in objects.items() if k != "trainer"}
    Checkpoint(again, directory / "in_place")(objects["trainer"])
    with pytest.raises(RankFailureError) as raised:
        Checkpoint.load_objects(objects, corrupt)
    return in_place, str(raised.value)


@pytest.mark.distributed
def test_a_load_on_several_ranks_reads_into_the_objects_own_tensors(saved, tmp_path):
    """Only once every rank has checked its entries: an object that does not fit changes nothing, FSDP shards
    included; and a corrupt byte that every rank reads is the same error on every rank."""
    _, directory = saved
    corrupt = tmp_path / "corrupt.dcp"
    shutil.copytree(directory / "checkpoint_4.dcp", corrupt)
    metadata = pickle.loads((corrupt / ".metadata").read_bytes())
    read = next(info for index, info in metadata.storage_data.items() if index.fqn == "side_model.0.weight")
    data = bytearray((corrupt / read.relative_path).read_bytes())
    data[read.offset + read.length // 2] ^= 0x01
    (corrupt / read.relative_path).write_bytes(bytes(data))
    results = run_ranks(_load_in_place, 2, directory, corrupt)
    assert [in_place for in_place, _ in results] == [True, True]
    full = torch.load(directory / "full" / "checkpoint_4.pt", weights_only=True)
    assert_state_equal(torch.load(directory / "in_place" / "checkpoint_4.pt", weights_only=True), full)
    # a corrupt byte that every rank reads: the same error on every rank, naming the file and the entry
    errors = {error for _, error in results}
    assert len(errors) == 1 and "ranks [0, 1]: IntegrityError" in errors.pop()
    assert f"corrupt.dcp/{read.relative_path}, entry side_model.0.weight" in results[0][1]


def _flat_fsdp1(seed):
    torch.manual_seed(seed)
    model = FullyShardedDataParallel(small_net(), device_id=torch.device("cpu"))  # flat parameters
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    return {"model": model, "optimizer": optimizer}


def _round_trip_on_one_rank(rank, world_size, dirname):
    objects = _flat_fsdp1(seed=0)
    for _ in range(2):
        objects["model"](torch.randn(4, 7)).sum().backward()
        objects["optimizer"].step()
    trainer = Engine(lambda e, b: None)
    checkpoint = Checkpoint(objects, ShardedSaver(dirname / "sharded"))
    checkpoint(trainer)
    fresh = _flat_fsdp1(seed=7)
    Checkpoint.load_objects(fresh, checkpoint.last_checkpoint)
    for name, state in (("saved", objects), ("loaded", fresh)):
        Checkpoint(state, dirname / name)(trainer)


@pytest.mark.distributed
def test_shards_read_on_the_world_size_that_saved_them(tmp_path):
    """On the world size that saved them, FSDP1's ShardedTensors (here the optimizer state of flat parameters on one
    rank, whose one shard is the whole tensor) load what was saved: DCP reads them, not the reads of plain shards."""
    run_ranks(_round_trip_on_one_rank, 1, tmp_path)

    def read(name):  # FSDP1 restores the keys of each parameter's optimizer state in an order of its own
        state = torch.load(tmp_path / name / "checkpoint_0.pt", weights_only=True)
        optimizer = state["optimizer"]
        optimizer["state"] = {key: dict(sorted(value.items())) for key, value in optimizer["state"].items()}
        return state

    assert_state_equal(read("loaded"), read("saved"))


def _before_the_first_step(rank, world_size, dirname):
    model = DistributedDataParallel(tiny_model())
    zero = zero_adam(model)
    plain = torch.optim.Adam(tiny_model(seed=1).parameters())
    Checkpoint({"model": model, "zero": zero, "plain": plain}, ShardedSaver(dirname))(Engine(lambda e, b: None))
    Checkpoint.load_objects({"zero": zero, "plain": plain}, dirname / "checkpoint_0.dcp")
    return zero.optim.state_dict()["state"], plain.state_dict()["state"]


@pytest.mark.distributed
def test_optimizers_without_state_yet(tmp_path):
    """Empty optimizer state leaves no entry in a sharded checkpoint; it is restored empty."""
    assert run_ranks(_before_the_first_step, 2, tmp_path) == [({}, {})] * 2


@pytest.mark.distributed
def test_every_rank_writes_a_share_of_what_all_ranks_hold():
    state = {"a": torch.zeros(1), "b": {"c": torch.ones(1), "d": 3}, "e": [torch.ones(2)], "f": "x"}
    shares = [share(state, rank, 2, keeper=1) for rank in range(2)]
    assert list(shares[0]) == ["a"] and list(shares[1]) == ["b", "e", "f"]
    assert list(shares[1]["b"]) == ["c", "d"]  # tensors dealt over the ranks; the rest, and lists, with the keeper
    assert share({"x": 1}, 0, 2, keeper=1) is tree.OMIT
    # by size: each tensor to the rank with the fewest bytes so far, not in turn (weights and biases of linear layers)
    layers = {f"{n}.{kind}": torch.zeros(size) for n in range(4) for kind, size in (("weight", 100), ("bias", 10))}
    shares = [share(layers, rank, 2, keeper=0) for rank in range(2)]
    assert [sum(t.numel() for t in part.values()) for part in shares] == [220, 220]


def test_replicas_is_a_count(tmp_path):
    with pytest.raises(ValueError, match=r"`replicas` should be a non-negative integer, got -1"):
        ShardedSaver(tmp_path, replicas=-1)
