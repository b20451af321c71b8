"""``torch.optim.Optimizer`` internals: what its ``load_state_dict`` costs on a state of many parameters."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["load_optimizer_state"]


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(state)``, each parameter group's indices that run on by one given as a ``range``.

    torch's ``load_state_dict`` (2.13 and 2.14 alike) looks each saved tensor's parameter up in its group's indices
    with ``in``, which scans a list: parameters x tensors in all, most of a load of tens of thousands of entries; a
    range answers at once. Only where the optimizer's class keeps ``Optimizer.load_state_dict`` and no hook would see
    the state before it, so that nothing but that lookup meets a range.
    """
    if type(optimizer).load_state_dict is not torch.optim.Optimizer.load_state_dict or (
        optimizer._optimizer_load_state_dict_pre_hooks
    ):
        optimizer.load_state_dict(state)
        return
    groups = []
    for group in state["param_groups"]:
        params = group["params"]
        if params and list(params) == list(range(params[0], params[0] + len(params))):
            group = {**group, "params": range(params[0], params[0] + len(params))}
        groups.append(group)
    optimizer.load_state_dict({**state, "param_groups": groups})
