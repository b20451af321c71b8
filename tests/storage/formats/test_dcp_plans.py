"""DCP's save plans as ranks agree on them (ignite_zero.storage.formats.dcp_plans): each rank's own planning, given
the offers that a round of the saver shares, here handed over in one process; the saves that go through real rounds
are in test_sharded.py, and here the kept plans of real saves, read back by DCP's own reader."""

from collections import OrderedDict
from pathlib import Path
from types import MappingProxyType

import pytest
import torch
from launcher import run_ranks

from ignite_zero.storage.formats.dcp_files import PlaceStorageWriter
from ignite_zero.storage.formats.dcp_plans import ENTRY_BYTES, SavePlanning
from ignite_zero.storage.places import LocalPlace


class _Rank:
    def __init__(self, rank, directory):
        self.rank = rank
        self.planning = SavePlanning()
        self.writer = PlaceStorageWriter(LocalPlace(directory))

    def offer(self, state):
        return self.planning.offer(state, self.writer, [0, 1], self.rank)

    def agree(self, offers):
        return self.planning.make_global_plans(offers, self.writer)


def _save(ranks, states, taking_part=(0, 1), second_round=None):
    """One save's planning: every rank offers; the ranks ``taking_part`` get the round's offers and agree (the others
    failed in the round), with a second round where they need one. Returns the offers of the first round."""
    offers = [rank.offer(state) for rank, state in zip(ranks, states)]
    agreed = [ranks[n].agree(offers) for n in taking_part]
    assert len(set(agreed)) == 1, "every rank decides alike from the same offers"
    if second_round is not None:
        assert second_round == (not agreed[0])
    if not agreed[0]:
        full = [rank.planning.full_offer() for rank in ranks]
        assert all(ranks[n].agree(full) for n in taking_part)
    return offers


def test_plans_are_offered_once_and_kept_while_no_rank_changes(tmp_path):
    ranks = [_Rank(0, tmp_path), _Rank(1, tmp_path)]
    states = [{"shared": torch.ones(4), "own0": torch.zeros(3)}, {"shared": torch.ones(4), "own1": torch.zeros(5)}]
    first = _save(ranks, states)
    assert all(offer.plan is not None for offer in first)
    plans = [rank.planning.central_plan for rank in ranks]
    assert [plan.storage_data.prefix for plan in plans] == ["__0_", "__1_"]
    written = sorted(item.index.fqn for plan in plans for item in plan.items)
    assert written == ["own0", "own1", "shared"]  # what every rank holds, written once
    assert ranks[0].planning.is_coordinator and not ranks[1].planning.is_coordinator

    states[0]["own0"] = torch.full((3,), 7.0)  # new values, the same layout
    second = _save(ranks, states, second_round=False)
    assert all(offer.plan is None for offer in second)
    assert all(rank.planning.central_plan is plan for rank, plan in zip(ranks, plans))  # kept, not planned again

    states[1]["own1"] = torch.zeros(6, dtype=torch.float64)  # one rank's tensor changes shape and dtype
    third = _save(ranks, states)
    assert third[0].plan is None and third[1].plan is not None
    metadata = ranks[0].planning.metadata
    assert metadata.state_dict_metadata["own1"].size == torch.Size([6])
    assert metadata.state_dict_metadata["own1"].properties.dtype == torch.float64


def _written_by_each(tmp_path, states):
    ranks = [_Rank(0, tmp_path), _Rank(1, tmp_path)]
    _save(ranks, states)
    return [sorted(item.index.fqn for item in rank.planning.central_plan.items) for rank in ranks]


def test_what_every_rank_holds_is_shared_out_by_entries_and_bytes(tmp_path):
    shared = {f"step{n}": torch.tensor(float(n)) for n in range(10)}  # Adam's steps: replicated, tiny
    # each rank's own entry first, as a model's parameters come before their optimizer's steps
    written = _written_by_each(tmp_path, [{"own0": torch.ones(8), **shared}, {"own1": torch.ones(8), **shared}])
    assert sorted(written[0] + written[1]) == sorted([*shared, "own0", "own1"]), "each entry once"
    # five each (DCP's own deduplication gives all ten to rank 1): small entries cost their writing, not their bytes
    assert [len(names) for names in written] == [6, 6]
    big = torch.ones(ENTRY_BYTES // 4 * 20)  # rank 0 writes as much as 20 small entries more: rank 1 takes them all
    written = _written_by_each(tmp_path / "big", [{"own0": big, **shared}, {"own1": torch.ones(8), **shared}])
    assert written == [["own0"], sorted([*shared, "own1"])]


def test_ranks_that_kept_plans_from_different_agreements_plan_afresh(tmp_path):
    ranks = [_Rank(0, tmp_path), _Rank(1, tmp_path)]
    states = [{"own0": torch.zeros(3)}, {"own1": torch.zeros(5)}]
    _save(ranks, states)
    states[0]["own0"] = torch.zeros(4)
    _save(ranks, states, taking_part=(0,))  # rank 1 failed in the round: it keeps the first agreement's plans
    # neither rank's plan changed since the agreement it keeps, but those differ: each offers none at first
    offers = _save(ranks, states, second_round=True)
    assert all(offer.plan is None for offer in offers)
    for rank in ranks:
        planned = {item.index.fqn: item.tensor_data.size for item in rank.planning.central_plan.items}
        assert planned == {f"own{rank.rank}": torch.Size([4 if rank.rank == 0 else 5])}
    assert ranks[0].planning.metadata.state_dict_metadata["own0"].size == torch.Size([4])
    again = _save(ranks, states, second_round=False)  # and they keep the same plans since
    assert all(offer.plan is None for offer in again)


def test_an_agreement_among_other_ranks_is_not_kept_for_these(tmp_path):
    planning = SavePlanning()
    writer = PlaceStorageWriter(LocalPlace(tmp_path))
    state = {"x": torch.zeros(2)}
    alone = planning.offer(state, writer, [1], 1)
    assert planning.make_global_plans([alone], writer)
    together = planning.offer(state, writer, [0, 1], 1)
    assert together.plan is not None and together.kept == 0


def test_an_agreement_is_kept_for_the_same_position_among_the_same_ranks_only(tmp_path):
    planning = SavePlanning()
    writer = PlaceStorageWriter(LocalPlace(tmp_path))
    state = {"x": torch.zeros(2)}
    offers = [planning.offer(state, writer, [0, 1], 0), _Rank(1, tmp_path).offer({"y": torch.zeros(3)})]
    assert planning.make_global_plans(offers, writer)
    moved = planning.offer(state, writer, [0, 1], 1)  # the process is another rank of the same job now
    assert moved.plan is not None and moved.kept == 0


def _save_as_the_layout_changes(rank, world_size, dirname):
    """Saves of a DTensor and of each rank's own tensor under the same names, the layout now kept, now changed (on one
    rank alone, then placements, dtype, shape, and whether the tensors require gradients), each read back by DCP's
    own reader; for each save after the first, whether this rank kept the global plan of the one before."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from ignite_zero import ShardedSaver

    mesh = init_device_mesh("cpu", (world_size,))
    saver = ShardedSaver(dirname)
    layouts = [  # placements, dtype, shape, length of rank 1's own tensor, which of the two require gradients
        ([Shard(0)], torch.float32, (4, 6), 3, ()),
        ([Shard(0)], torch.float32, (4, 6), 3, ()),
        ([Shard(0)], torch.float32, (4, 6), 5, ()),
        ([Shard(1)], torch.float32, (4, 6), 5, ()),
        ([Replicate()], torch.float32, (4, 6), 5, ()),
        ([Replicate()], torch.float64, (4, 6), 5, ()),
        ([Replicate()], torch.float64, (6, 4), 5, ()),
        ([Replicate()], torch.float64, (6, 4), 5, ("w",)),
        ([Replicate()], torch.float64, (6, 4), 5, ("w",)),
        ([Replicate()], torch.float64, (6, 4), 5, ("w", "own")),
    ]
    plans = []
    for step, (placements, dtype, shape, length, learnt) in enumerate(layouts):
        full = (torch.arange(24) * (step + 1)).to(dtype).reshape(shape)
        own = torch.full((length if rank == 1 else 3,), float(step), requires_grad="own" in learnt)
        shards = distribute_tensor(full, mesh, placements).requires_grad_("w" in learnt)
        saver.save_state({"w": shards, f"own{rank}": own}, f"save{step}")
        whole = distribute_tensor(torch.zeros_like(full), mesh, [Replicate()])
        read = {"w": whole, f"own{rank}": torch.zeros_like(own)}
        dcp.load(read, checkpoint_id=dirname / f"save{step}")
        assert torch.equal(read["w"].to_local(), full) and torch.equal(read[f"own{rank}"], own.detach()), step
        plans.append(saver.kept.planning["main"].central_plan)
    return [later is earlier for earlier, later in zip(plans, plans[1:])]


@pytest.mark.distributed
def test_plans_are_kept_while_the_layout_holds_and_made_afresh_when_it_changes(tmp_path):
    kept = [True, False, False, False, False, False, False, True, False]
    assert run_ranks(_save_as_the_layout_changes, 2, tmp_path) == [kept] * 2


def _metadata_of_kept_plans(rank, world_size, dirname):
    """Saves of a DTensor and a value under one plan, the value's pickle now as long as before, now longer, each read
    back by DCP's own reader; on the coordinator, whether each save after the first wrote the ``.metadata`` bytes of
    the one before, and what each ``.metadata`` says of its save."""
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from ignite_zero import ShardedSaver

    mesh = init_device_mesh("cpu", (world_size,))
    saver = ShardedSaver(dirname)
    files, facts = [], []
    for step, note in enumerate(["abc", "xyz", "a longer note" * 20, "a longer note" * 20]):
        full = torch.arange(24.0).reshape(4, 6) * (step + 1)
        saver.save_state({"w": distribute_tensor(full, mesh, [Shard(0)]), "note": note}, f"save{step}")
        read = {"w": distribute_tensor(torch.zeros_like(full), mesh, [Replicate()]), "note": ""}
        dcp.load(read, checkpoint_id=dirname / f"save{step}")
        assert torch.equal(read["w"].to_local(), full) and read["note"] == note, step
        files.append(saver.kept.planning["main"].metadata_file)
        metadata = pickle.loads((dirname / f"save{step}" / ".metadata").read_bytes())
        facts.append((metadata.storage_meta.checkpoint_id, metadata.storage_meta.save_id))
    if rank != 0:
        return None
    # the directory the save wrote into (it is renamed into place once sealed)
    assert [Path(where).parent for where, _ in facts] == [dirname] * 4
    assert all(f"save{step}" in Path(where).name for step, (where, _) in enumerate(facts)), facts
    assert len({save_id for _, save_id in facts}) == 4
    return [later is earlier for earlier, later in zip(files, files[1:])]


@pytest.mark.distributed
def test_metadata_is_pickled_again_only_where_an_entry_moved(tmp_path):
    assert run_ranks(_metadata_of_kept_plans, 2, tmp_path)[0] == [True, False, True]


def _nested_states():
    tensor = torch.ones(2)
    yield {
        "model": OrderedDict([("w", tensor), ("b", torch.zeros(3))]),
        "optimizer": {"state": {0: {"step": tensor, "exp_avg": tensor}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        7: {8: tensor},  # keys made strings
        "lists": {"values": [1, 2], "tensors": [tensor, 3], "deep": [[1], [tensor]], "dicts": [{"x": 1}], "empty": []},
        "kept_whole": {"tuple": (tensor, 1), "nested": [[[1]]], "text": "s", "none": None, "no_entries": {}},
        "parameters": [torch.nn.Parameter(torch.ones(3)), {"p": torch.nn.Parameter(torch.ones(1))}],
    }
    yield {"mapping": MappingProxyType({"w": tensor})}  # not a dict: DCP's own walk
    yield {"in_a_list": [MappingProxyType({"w": tensor})]}
    yield {"a.b": 1, "a": {"b": 2}}  # one key, two paths: DCP's own error


@pytest.mark.parametrize("state", _nested_states(), ids=["nested", "mapping", "mapping in a list", "same key"])
def test_the_state_is_flattened_as_dcp_flattens_it(state):
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from ignite_zero.storage.formats.dcp_flat import flatten
    from ignite_zero.storage.formats.dcp_plans import _LocalTensorSavePlanner

    flattened = flatten(state)
    ours, theirs = _LocalTensorSavePlanner(), DefaultSavePlanner()
    try:
        theirs.set_up_planner(state, None, True)
    except ValueError:
        assert flattened is None
        with pytest.raises(ValueError, match="duplicated flatten key a.b"):
            ours.set_up_planner(state, None, True)
        return
    ours.set_up_planner(state, None, True)
    assert (flattened is None) == (state.keys() & {"mapping", "in_a_list"} != set())
    assert list(ours.state_dict) == list(theirs.state_dict)  # the same keys, in the same order
    assert all(ours.state_dict[key] is value for key, value in theirs.state_dict.items())
    assert list(ours.mappings.items()) == list(theirs.mappings.items())
    plan = ours.create_local_plan()
    assert plan == theirs.create_local_plan()
    # each item resolved to what DCP's own planner resolves it to: the same tensor, the same pickled bytes
    resolved = [theirs.resolve_data(item) for item in plan.items]
    ours_resolved = ours.resolve_items(plan.items)
    assert [type(value) for value in ours_resolved] == [type(value) for value in resolved]
    for mine, their in zip(ours_resolved, resolved, strict=True):
        assert mine is their if isinstance(their, torch.Tensor) else mine.getvalue() == their.getvalue()


def test_plain_values_are_pickled_again_only_where_they_changed(tmp_path, monkeypatch):
    """A value equal to the one saved under its name before (type and every bit of a float alike) is not pickled
    again; one that changed is, a list changed in place too, and a list of lists always (which of them are one
    object, the key cannot tell). Every save reads back as it was."""
    import struct

    import torch.distributed.checkpoint as dcp

    from ignite_zero import ShardedSaver

    pickled = []
    save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, *args, **kwargs: pickled.append(obj) or save(obj, *args, **kwargs))
    names, one = ["a", "b"], [1]
    steps = [  # the values, and those pickled; lists of lists at every save: [one, one] loads back as one list twice
        (
            {"lr": 0.1, "zero": 0.0, "flag": 1, "names": names, "pairs": [[1], [1]]},
            ["lr", "zero", "flag", "names", "pairs"],
        ),
        ({"lr": 0.1, "zero": 0.0, "flag": 1, "names": names, "pairs": [one, one]}, ["pairs"]),
        (
            {"lr": 0.05, "zero": -0.0, "flag": 1.0, "names": names, "pairs": [one, one]},
            ["lr", "zero", "flag", "names", "pairs"],
        ),
        ({"lr": 0.05, "zero": -0.0, "flag": True, "names": names, "pairs": [[1], [1]]}, ["flag", "pairs"]),
    ]
    saver = ShardedSaver(tmp_path)
    for step, (values, changed) in enumerate(steps):
        if step == 2:
            names.append("c")
        pickled.clear()
        saver.save_state({"w": torch.full((3,), float(step)), **values}, f"save{step}")
        assert sorted(map(repr, pickled)) == sorted(repr(values[name]) for name in changed), step
        read = {"w": torch.zeros(3), **{name: None for name in values}}
        dcp.load(read, checkpoint_id=tmp_path / f"save{step}")
        for name, value in values.items():
            assert type(read[name]) is type(value) and read[name] == value, (step, name)
        assert struct.pack("<d", read["zero"]) == struct.pack("<d", values["zero"])
        assert (read["pairs"][0] is read["pairs"][1]) == (values["pairs"][0] is values["pairs"][1])
