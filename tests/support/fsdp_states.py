"""Training and comparing FSDP states, shared by the tests of the FSDP adapters and of regions: every rank trains on
the same batches, and states are compared by parameter name."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from training import assert_state_equal

from ignite_zero.adapters.fsdp import FSDPModelState, FSDPOptimizerState


def train_same_batches(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, tokens: bool = False) -> None:
    for step in steps:  # the same batch on every rank
        generator = torch.Generator().manual_seed(1000 + step)
        x = torch.randint(0, 11, (4, 3), generator=generator) if tokens else torch.randn(4, 7, generator=generator)
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A plain optimizer's state keyed by parameter names, as FSDPOptimizerState saves it."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    names = [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]  # the indices' order
    state = optimizer.state_dict()
    return {
        "state": {names[i]: value for i, value in state["state"].items()},
        "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]],
    }


def assert_states(actual: dict[str, Any], expected: dict[str, Any], exact: bool, bf16: bool = False) -> None:
    """Model: same names in the same order; optimizer: same state per name, same groups (names in any order)."""
    assert list(actual["model"]) == list(expected["model"])
    if exact:
        assert_state_equal(dict(actual["model"]), dict(expected["model"]))
        state, expected_state = actual["optimizer"]["state"], expected["optimizer"]["state"]
        assert_state_equal(dict(sorted(state.items())), dict(sorted(expected_state.items())))
    else:
        tolerance = {"atol": 2e-2, "rtol": 2e-2} if bf16 else {"atol": 1e-5, "rtol": 1e-4}
        torch.testing.assert_close(dict(actual["model"]), dict(expected["model"]), **tolerance)
        torch.testing.assert_close(
            dict(actual["optimizer"]["state"]), dict(expected["optimizer"]["state"]), **tolerance
        )
    groups, expected_groups = actual["optimizer"]["param_groups"], expected["optimizer"]["param_groups"]
    assert [sorted(g["params"]) for g in groups] == [sorted(g["params"]) for g in expected_groups]
    assert [{**g, "params": None} for g in groups] == [{**g, "params": None} for g in expected_groups]


def gather_fsdp_state(model: nn.Module, optimizer: torch.optim.Optimizer, recipient: int) -> dict[str, Any]:
    """The full model and optimizer state on ``recipient``, through the FSDP adapters."""
    return {
        "model": FSDPModelState(model, recipient).state_dict(),
        "optimizer": FSDPOptimizerState(model, optimizer, recipient).state_dict(),
    }
