"""Loading an optimizer's state with each group's indices as a range (ignite_zero._compat.load_optimizer_state)."""

import copy

import torch
from torch import nn
from training import assert_state_equal

from ignite_zero import _compat


def _trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(*(nn.Linear(3, 3) for _ in range(12)))
    params = list(model.parameters())
    optimizer = torch.optim.Adam([{"params": params[:10], "lr": 0.1}, {"params": params[10:]}], lr=0.01)
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_the_state_loads_as_torch_loads_it_and_stays_as_given():
    saved = _trained(0)[1].state_dict()
    given = copy.deepcopy(saved)
    ours, theirs = _trained(1)[1], _trained(1)[1]

    _compat.load_optimizer_state(ours, given)
    theirs.load_state_dict(copy.deepcopy(saved))

    assert_state_equal(ours.state_dict(), theirs.state_dict())
    assert all(type(group["params"]) is list for group in ours.param_groups)  # the live parameters, in lists
    assert_state_equal(given, saved)  # its groups' indices still lists
    assert all(type(group["params"]) is list for group in given["param_groups"])


def test_what_another_load_state_dict_or_a_hook_sees_is_the_state_as_given():
    seen = []

    class Recording(torch.optim.Adam):
        def load_state_dict(self, state_dict):
            seen.append([type(group["params"]) for group in state_dict["param_groups"]])
            super().load_state_dict(state_dict)

    model, _ = _trained(1)
    saved = _trained(0)[1].state_dict()
    params = list(model.parameters())
    _compat.load_optimizer_state(Recording([{"params": params[:10], "lr": 0.1}, {"params": params[10:]}]), saved)
    hooked = torch.optim.Adam([{"params": params[:10], "lr": 0.1}, {"params": params[10:]}])
    hooked.register_load_state_dict_pre_hook(
        lambda optimizer, state_dict: seen.append([type(group["params"]) for group in state_dict["param_groups"]])
    )
    _compat.load_optimizer_state(hooked, saved)
    assert seen == [[list, list], [list, list]]
