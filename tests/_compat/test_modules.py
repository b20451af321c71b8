"""``_compat.load_module_state``: ``nn.Module.load_state_dict``'s walk, each module's entries sorted among its
children in one pass; the same calls, results and errors as torch's own."""

import copy

import pytest
import torch
from torch import nn

from ignite_zero._compat import load_module_state


class _Versioned(nn.Module):
    """Extra state, a non-persistent buffer, a pre hook that renames an old key and a post hook that drops a key it
    handled, as real modules do."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 2)
        self.register_buffer("scratch", torch.zeros(2), persistent=False)
        self.extra = None
        self._register_load_state_dict_pre_hook(self._rename)
        self.register_load_state_dict_post_hook(self._forgive)

    def get_extra_state(self):
        return {"calls": 3}

    def set_extra_state(self, state):
        self.extra = state

    @staticmethod
    def _rename(state_dict, prefix, *_):
        if prefix + "old_weight" in state_dict:
            state_dict[prefix + "linear.weight"] = state_dict.pop(prefix + "old_weight")

    @staticmethod
    def _forgive(module, incompatible):
        if "ignored" in incompatible.unexpected_keys:
            incompatible.unexpected_keys.remove("ignored")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Linear(2, 2) for _ in range(12)],  # more than ten: "1." is a prefix of "10." and "11."
        nn.BatchNorm1d(2),  # its _load_from_state_dict reads the saved version from the metadata
        nn.Sequential(_Versioned(), nn.ReLU()),
        nn.ModuleDict({"head": nn.Linear(2, 1), "none": None}),
    )


def _state():
    state = _model().state_dict()
    for value in state.values():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            value.add_(1.5)
    return state


def _both(state, strict):
    """What torch's ``load_state_dict`` and ``load_module_state`` give for ``state``: (result or error, module)."""
    outcomes = []
    for load in (lambda m, s: m.load_state_dict(s, strict=strict), lambda m, s: load_module_state(m, s, strict)):
        model = _model()
        try:
            outcome = load(model, copy.deepcopy(state))
        except RuntimeError as error:
            outcome = str(error)
        outcomes.append((outcome, model))
    return outcomes


def _assert_same(outcomes):
    (expected, expected_model), (actual, actual_model) = outcomes
    assert actual == expected
    for (name, value), (_, other) in zip(expected_model.state_dict().items(), actual_model.state_dict().items()):
        assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, name
    assert actual_model[13][0].extra == expected_model[13][0].extra
    return expected


def test_a_state_loads_as_load_state_dict_loads_it():
    state = _state()
    state._metadata = _model().state_dict()._metadata  # as torch.load gives it
    result = _assert_same(_both(state, strict=True))
    assert result == ((), ()) or (result.missing_keys, result.unexpected_keys) == ([], [])


@pytest.mark.parametrize("strict", [True, False])
def test_missing_unexpected_and_misshapen_entries_end_as_load_state_dict_ends(strict):
    state = _state()
    del state["3.bias"], state["14.head.weight"]
    state["7.surplus"] = torch.ones(1)
    state["ignored"] = torch.ones(1)  # dropped by a post hook
    state["13.0.old_weight"] = state.pop("13.0.linear.weight")  # renamed by a pre hook
    state["5.weight"] = torch.ones(4, 4)
    outcome = _assert_same(_both(state, strict))
    assert "size mismatch for 5.weight" in outcome and ("3.bias" in outcome) == strict


def test_a_module_with_its_own_load_state_dict_is_loaded_by_it():
    class Own(nn.Linear):
        def load_state_dict(self, state_dict, strict=True, assign=False):
            self.called = True
            return super().load_state_dict(state_dict, strict, assign)

    module = Own(2, 2)
    load_module_state(module, nn.Linear(2, 2).state_dict())
    assert module.called
