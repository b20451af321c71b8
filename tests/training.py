"""Tiny models, data and comparisons shared by the distributed scenarios."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer


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
