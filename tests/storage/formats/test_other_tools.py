"""Checkpoints written by other tools load through Checkpoint.load_objects: directories of plain ``dcp.save`` of
``get_state_dict`` state dicts (as torchtitan writes them) and plain ``torch.save`` files, into FSDP1, FSDP2, ZeRO and
plain models on any world size, with a warning that there is nothing to verify them against."""

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from ignite.engine import Engine
from launcher import run_ranks
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.nn.parallel import DistributedDataParallel
from training import assert_state_equal, shard, small_net, zero_adam

from ignite_zero import Checkpoint

pytestmark = pytest.mark.distributed


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
