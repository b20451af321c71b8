"""A nested state taken apart into its structure and its tensors, and put together again (ignite_zero.pickling)."""

import dataclasses
from collections import OrderedDict
from typing import NamedTuple

import torch
from torch import nn

from ignite_zero.pickling import join_tensors, split_tensors


class _Pair(NamedTuple):
    left: torch.Tensor
    right: object


@dataclasses.dataclass
class _Holder:
    tensor: torch.Tensor
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
