"""A nested state taken apart into its structure and its tensors, and put together again (ignite_zero.pickling)."""

import dataclasses
from collections import OrderedDict
from typing import NamedTuple

import torch
from torch import nn

from ignite_zero.pickling import immutable, join_tensors, rebuilt, split_plain, split_tensors


class _Pair(NamedTuple):
    left: torch.Tensor
    right: object


@dataclasses.dataclass
class _Holder:
    tensor: torch.Tensor
    values: list


@immutable
@dataclasses.dataclass(frozen=True)
class _Fixed:
    name: str
    shape: tuple


@dataclasses.dataclass(frozen=True)
class _FrozenOnly:  # frozen, but not marked: it may refer to what changes
    values: list


def test_tensors_come_out_once_each_in_order_and_go_back_where_they_were():
    shared, parameter, other = torch.ones(2), nn.Parameter(torch.zeros(3)), torch.arange(4)
    state = {
        "a": OrderedDict(w=shared, p=parameter),
        "pair": _Pair(shared, (1, "x", None, torch.float16)),
        "holder": _Holder(other, [shared, 2.5, b"bytes"]),
    }

    structure, tensors = split_tensors(state)

    assert [t is s for t, s in zip(tensors, [shared, parameter, other], strict=True)] == [True] * 3
    assert b"\x00\x00\x80?" not in structure  # tensors' data stay out of the structure
    replaced = [torch.full_like(tensor, 7) for tensor in tensors]
    joined = join_tensors(structure, replaced)
    assert (
        joined["a"]["w"] is replaced[0]
        and joined["pair"].left is replaced[0]
        and joined["holder"].values[0] is replaced[0]
    )
    assert joined["a"]["p"] is replaced[1] and joined["holder"].tensor is replaced[2]
    assert type(joined["a"]) is OrderedDict and type(joined["pair"]) is _Pair and type(joined["holder"]) is _Holder
    assert joined["pair"].right == (1, "x", None, torch.float16) and joined["holder"].values[1:] == [2.5, b"bytes"]


def test_a_rebuilt_copy_shares_immutable_objects_and_copies_everything_else():
    tensor, fixed, values = torch.arange(3), _Fixed("w", (3,)), [1, 2]
    state = {"fixed": fixed, "again": fixed, "frozen": _FrozenOnly(values), "holder": _Holder(tensor, values)}
    seen = []

    def copies(tensors):
        seen.extend(tensors)
        return [t + 10 for t in tensors]

    copy = rebuilt(state, copies)

    assert seen == [tensor] and torch.equal(copy["holder"].tensor, tensor + 10)
    assert copy["fixed"] is fixed and copy["again"] is fixed
    assert copy["frozen"] == state["frozen"] and copy["frozen"].values is not values
    assert copy["holder"].values == values and copy["holder"].values is not values
    # the structure split for another process pickles them: nothing refers to this process's objects
    structure, _ = split_tensors(state)
    assert join_tensors(structure, [tensor])["fixed"] is not fixed


def test_a_plain_split_takes_values_of_plain_types_and_accepted_tensors_only():
    weight, step = torch.randn(3, 2), torch.tensor(4.0)
    plain = OrderedDict(
        weight=weight,
        again=weight,
        state={0: {"step": step}},
        values=[1, 2.5, 1 + 2j, "s", b"b", bytearray(b"ba"), None, True, (torch.Size([3, 2]), torch.int8)],
        where=[torch.device("cpu"), torch.channels_last],
    )
    structure, tensors = split_plain(plain, lambda tensor: tensor.dim() > 0 or tensor.item() == 4.0)
    assert tensors[0] is weight and tensors[1] is step and len(tensors) == 2
    joined = join_tensors(structure, [tensor.clone() for tensor in tensors])
    assert joined["again"] is joined["weight"] and joined["values"] == plain["values"]
    assert type(joined) is OrderedDict and joined["where"] == plain["where"]
    assert split_plain(plain, lambda tensor: tensor.dim() > 0) is None  # a tensor not accepted
    for other in (_Holder(weight, []), _Pair(weight, 1), dataclasses.replace, nn.Linear, {1: {2: object()}}):
        assert split_plain({"other": other}, lambda tensor: True) is None, other
