"""Tiny models, data and comparisons shared by the distributed scenarios."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from ignite.engine import Engine
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel


def tiny_model(seed: int = 0) -> nn.Module:
    """Sizes not divisible by 2, 3 or 4 ranks, so that partitions are uneven."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3), nn.Linear(3, 1))


def zero_adam(model: nn.Module, **kwargs: Any) -> ZeroRedundancyOptimizer:
    return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01, **kwargs)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 7, generator=generator), torch.randn(4, 1, generator=generator)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, step: int) -> float:
    x, y = batch(rank, step)
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.item()


def small_net() -> nn.Module:
    """Two FSDP units, and sizes not divisible by 2, 3 or 4 ranks."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 9), nn.ReLU(), nn.Sequential(nn.Linear(9, 5), nn.Linear(5, 3)))


def shard(net: nn.Module, kind: str) -> nn.Module:
    """FSDP1 (``use_orig_params=True``) over the whole net, or FSDP2 over its inner block and then the whole."""
    if kind == "fsdp1":
        return FullyShardedDataParallel(net, device_id=torch.device("cpu"), use_orig_params=True)
    fully_shard(net[2])
    return fully_shard(net)


def mixed_objects(kind: str, rank: int, seed: int = 0) -> dict:
    """Everything a user would checkpoint: an FSDP model (``kind``: ``"fsdp1"`` or ``"fsdp2"``) with its optimizer,
    a learning-rate scheduler, a GradScaler, a DDP model with a ZeRO optimizer, a trainer. Each rank sees the same
    FSDP batches, and its own DDP batches."""
    model = shard(small_net(), kind)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    side = DistributedDataParallel(tiny_model(seed))
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


def mixed_twin() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The FSDP model's unsharded twin: the same batches, averaged over identical ranks, give the same steps."""
    model = small_net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for iteration in range(1, 5):
        model(torch.randn(4, 7, generator=torch.Generator().manual_seed(iteration))).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return model, optimizer


def assert_state_equal(actual: Any, expected: Any, path: str = "") -> None:
    """Same structure, same leaves; tensors equal in dtype, shape and every value."""
    if isinstance(expected, Mapping):
        assert isinstance(actual, Mapping), f"{path}: {type(actual)} is not a mapping"
        assert list(actual.keys()) == list(expected.keys()), f"{path}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_state_equal(actual[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), f"{path}: {actual} != {expected}"
        for index, (a, e) in enumerate(zip(actual, expected)):
            assert_state_equal(a, e, f"{path}[{index}]")
    elif isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{path}: {type(actual)} is not a tensor"
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, f"{path}: {actual} != {expected}"
        assert torch.equal(actual.cpu(), expected.cpu()), f"{path}: values differ"
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"
