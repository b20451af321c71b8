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
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.nn.parallel import DistributedDataParallel
from training import assert_state_equal, tiny_model, zero_adam

from ignite_zero import Checkpoint, DiskSaver, RankFailureError

pytestmark = pytest.mark.distributed


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 9), nn.ReLU(), nn.Sequential(nn.Linear(9, 5), nn.Linear(5, 3)))


def _shard(net: nn.Module, kind: str) -> nn.Module:
    if kind == "fsdp1":
        return FullyShardedDataParallel(net, device_id=torch.device("cpu"), use_orig_params=True)
    fully_shard(net[2])
    return fully_shard(net)


def _objects(kind: str, rank: int) -> dict:
    """Everything a user would checkpoint; each rank sees the same FSDP batches, and its own DDP batches."""
    model = _shard(_net(), kind)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    side = DistributedDataParallel(tiny_model())
    side_optimizer = zero_adam(side)

    def step(engine, _):
        generator = torch.Generator().manual_seed(engine.state.iteration)
        model(torch.randn(4, 7, generator=generator)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        side(
            torch.randn(4, 7, generator=torch.Generator().manual_seed(100 * rank + engine.state.iteration))
        ).sum().backward()
        side_optimizer.step()
        side_optimizer.zero_grad()

    trainer = Engine(step)
    return {
        "model": model,
        "optimizer": optimizer,
        "lr_scheduler": scheduler,
        "scaler": scaler,
        "side_model": side,
        "side_optimizer": side_optimizer,
        "trainer": trainer,
    }


def _twin() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The FSDP model's unsharded twin: the same batches, averaged over identical ranks, give the same steps."""
    model = _net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for iteration in range(1, 5):
        model(torch.randn(4, 7, generator=torch.Generator().manual_seed(iteration))).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return model, optimizer


def _save(rank, world_size, dirname, kind, recipient):
    objects = _objects(kind, rank)
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
    twin, twin_optimizer = _twin()
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
    objects = _objects(kind, rank)
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
    model = _net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.5)
    side = tiny_model(seed=3)
    side_optimizer = torch.optim.Adam(side.parameters())
    Checkpoint.load_objects(
        {"model": model, "optimizer": optimizer, "side_model": side, "side_optimizer": side_optimizer}, path
    )
    twin, twin_optimizer = _twin()
    torch.testing.assert_close(model.state_dict(), twin.state_dict())
    torch.testing.assert_close(optimizer.state_dict(), twin_optimizer.state_dict())
    state = torch.load(path, weights_only=True)
    assert_state_equal(side_optimizer.state_dict(), state["side_optimizer"])


def _misuse(rank, world_size, directory):
    model = _shard(_net(), "fsdp2")
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 7)).sum().backward()
    optimizer.step()
    with pytest.raises(ValueError, match=r"The optimizer \['optimizer'\] updates parameters sharded by FSDP"):
        Checkpoint({"optimizer": optimizer}, DiskSaver(directory))(Engine(lambda e, b: None))
    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("replicate", "shard"))
    hybrid = fully_shard(_net(), mesh=mesh)
    with pytest.raises(RankFailureError, match="not supported yet"):
        Checkpoint({"model": hybrid}, DiskSaver(directory))(Engine(lambda e, b: None))
    value = torch.ones(1)
    dist.all_reduce(value)
    return value.item()


def test_an_optimizer_without_its_model_and_hsdp_are_clear_errors(tmp_path):
    assert run_ranks(_misuse, 2, tmp_path) == [2.0, 2.0]
    assert list(tmp_path.iterdir()) == []
