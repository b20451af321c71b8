"""FSDP through ignite_zero.Checkpoint, as users write it: one import changed, a mixed ``to_save`` (an FSDP model
and its optimizer, a DDP model with a ZeRO optimizer, a trainer, a learning-rate scheduler, a GradScaler), saved on
N ranks to any recipient and loaded on M ranks or in one process without a process group."""

import pytest
import torch
import torch.distributed as dist
from ignite.engine import Engine, Events
from launcher import run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial
from training import assert_state_equal, mixed_objects, mixed_twin, shard, small_net, tiny_model

from ignite_zero import Checkpoint, DiskSaver, RankFailureError

pytestmark = pytest.mark.distributed


def _save(rank, world_size, dirname, kind, recipient):
    objects = mixed_objects(kind, rank)
    trainer = objects["trainer"]
    checkpoint = Checkpoint(objects, DiskSaver(dirname), n_saved=1, consolidate_recipient_rank=recipient)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, checkpoint)
    trainer.run(range(2), max_epochs=2)
    side_optimizer = objects["side_optimizer"]
    side_optimizer.consolidate_state_dict(to=recipient)
    return side_optimizer.state_dict() if rank == recipient else None


@pytest.fixture(scope="module", params=[("fsdp1", 1), ("fsdp2", 0)], ids=["fsdp1 to rank 1", "fsdp2 to rank 0"])
def saved(request, tmp_path_factory):
    kind, recipient = request.param
    directory = tmp_path_factory.mktemp(kind)
    side_optimizer_state = run_ranks(_save, 2, directory, kind, recipient)[recipient]
    return kind, directory / "checkpoint_4.pt", side_optimizer_state


def test_the_file_holds_the_unsharded_model_and_optimizer(saved):
    kind, path, side_optimizer_state = saved
    state = torch.load(path, weights_only=True)
    assert sorted(state) == sorted(
        ["model", "optimizer", "lr_scheduler", "scaler", "side_model", "side_optimizer", "trainer"]
    )
    twin, twin_optimizer = mixed_twin()
    # the unwrapped model's own names and tensors, and the optimizer keyed by those names
    assert list(state["model"]) == list(twin.state_dict())
    torch.testing.assert_close(dict(state["model"]), dict(twin.state_dict()))
    names = [name for name, _ in twin.named_parameters()]
    assert list(state["optimizer"]["state"]) == names
    for index, name in enumerate(names):
        torch.testing.assert_close(state["optimizer"]["state"][name], twin_optimizer.state_dict()["state"][index])
    assert state["optimizer"]["param_groups"][0]["lr"] == 0.0025 == twin_optimizer.param_groups[0]["lr"]
    assert state["lr_scheduler"]["last_epoch"] == 4 and state["trainer"]["iteration"] == 4
    assert_state_equal(state["side_optimizer"], side_optimizer_state)


def _load(rank, world_size, path, kind):
    objects = mixed_objects(kind, rank)
    Checkpoint.load_objects(objects, path)
    # gathered again, on this world size, to compare with the file
    restored = {"model": objects["model"], "optimizer": objects["optimizer"]}
    Checkpoint(restored, DiskSaver(path.parent / f"re{world_size}"))(Engine(lambda e, b: None))
    return objects["trainer"].state.iteration, objects["lr_scheduler"].last_epoch, objects["scaler"].get_scale()


@pytest.mark.parametrize("world_size", [3, 1])
def test_loads_on_another_number_of_ranks(saved, world_size):
    kind, path, _ = saved
    results = run_ranks(_load, world_size, path, kind)
    assert results == [(4, 4, 1024.0)] * world_size
    state = torch.load(path, weights_only=True)
    again = torch.load(path.parent / f"re{world_size}" / "checkpoint_0.pt", weights_only=True)
    assert_state_equal(again["model"], dict(state["model"]))
    assert_state_equal(again["optimizer"], state["optimizer"])


def test_loads_into_plain_objects_without_process_group(saved):
    _, path, _ = saved
    model = small_net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.5)
    side = tiny_model(seed=3)
    side_optimizer = torch.optim.Adam(side.parameters())
    Checkpoint.load_objects(
        {"model": model, "optimizer": optimizer, "side_model": side, "side_optimizer": side_optimizer}, path
    )
    twin, twin_optimizer = mixed_twin()
    torch.testing.assert_close(model.state_dict(), twin.state_dict())
    torch.testing.assert_close(optimizer.state_dict(), twin_optimizer.state_dict())
    state = torch.load(path, weights_only=True)
    assert_state_equal(side_optimizer.state_dict(), state["side_optimizer"])


def _misuse(rank, world_size, directory):
    model = shard(small_net(), "fsdp2")
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 7)).sum().backward()
    optimizer.step()
    with pytest.raises(RankFailureError, match=r"The optimizer \['optimizer'\] updates parameters sharded by FSDP"):
        Checkpoint({"optimizer": optimizer}, DiskSaver(directory))(Engine(lambda e, b: None))
    pending = shard(small_net(), "fsdp2")
    mesh = init_device_mesh("cpu", (world_size,))
    pending[0].weight = nn.Parameter(DTensor.from_local(torch.ones(9, 7), mesh, [Partial()]))
    with pytest.raises(RankFailureError, match=r"0.weight has placements \(Partial\(sum\),\).*pending reduction"):
        Checkpoint({"model": pending}, DiskSaver(directory))(Engine(lambda e, b: None))
    value = torch.ones(1)
    dist.all_reduce(value)
    return value.item()


def test_an_optimizer_without_its_model_and_a_pending_reduction_are_clear_errors(tmp_path):
    assert run_ranks(_misuse, 2, tmp_path) == [2.0, 2.0]
    assert list(tmp_path.iterdir()) == []
