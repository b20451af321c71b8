"""Objects with every edge case that the transport carries (dtypes, views, aliases, empty and 0-d tensors, nested
containers), and the comparison of what arrived with what was sent: shared by the tests of the transport and of
regions."""

from collections import OrderedDict, namedtuple
from typing import Any

import torch
from torch import nn

from ignite_zero.transport import DEFAULT_CHUNK_BYTES

__all__ = ["CHUNKS", "Point", "assert_same", "edge_case_object"]


# Small chunks force packing, slicing of big tensors and partial rows of non-contiguous ones;
# 100 bytes is not a multiple of 8 or 16 on purpose.
CHUNKS = (64, 100, 1000, DEFAULT_CHUNK_BYTES)


Point = namedtuple("Point", "x y")  # module level so that the skeleton can pickle it


def edge_case_object(rank: int) -> Any:
    """A rank's object with every edge case; rank 2 owns no state at all."""
    if rank == 2:
        return {}
    g = torch.Generator().manual_seed(rank)
    shared = torch.randn(5, 7, generator=g)
    base = torch.randn(400, generator=g)
    return {
        "fp32": shared,
        "alias": shared,  # the same object twice: must arrive once, as one object
        "bf16": torch.randn(33, generator=g).bfloat16(),
        "fp16": torch.randn(4, 4, generator=g).half(),
        "int64": torch.arange(rank, rank + 10),
        "bool": torch.rand(13, generator=g) > 0.5,
        "complex": torch.randn(6, dtype=torch.complex64, generator=g),
        "step": torch.tensor(float(rank + 1)),  # 0-d, like Adam's `step`
        "step_int": torch.tensor(rank + 3),
        "empty": torch.empty(0),
        "empty_3d": torch.empty(3, 0, 2, dtype=torch.bfloat16),
        "big": torch.randn(300, generator=g),
        "slice_of_base": base[7:307],  # contiguous, with a storage offset
        "transposed": torch.randn(40, 30, generator=g).t(),
        "strided": torch.arange(200, dtype=torch.float32)[::3],
        "channels_last": torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last),
        "expanded": torch.randn(1, 5, generator=g).expand(4, 5),
        "conj": torch.randn(5, dtype=torch.complex64, generator=g).conj(),
        "param": nn.Parameter(torch.randn(3, generator=g)),
        "needs_grad": torch.randn(4, generator=g, requires_grad=True),
        "nested": [
            1,
            2.5,
            "s",
            None,
            (torch.ones(2), OrderedDict(deep=torch.zeros(1, dtype=torch.int64))),
            Point(torch.tensor([1.0]), 2),
        ],
        "leaves": {"lr": 0.1, "betas": (0.9, 0.999), "name": "adam", "flag": True, "dtype": torch.bfloat16},
        "rank": rank,
    }


def assert_same(actual: Any, expected: Any, path: str = "obj") -> None:
    """Same structure, same leaves; tensors: on CPU, same dtype and shape, ``torch.equal`` values."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), path
        assert actual.device.type == "cpu", path
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), path
        assert torch.equal(actual, expected.detach().cpu()), path
    elif isinstance(expected, dict):
        assert type(actual) is type(expected), path
        assert list(actual) == list(expected), path
        for key in expected:
            assert_same(actual[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{path}[{i}]")
    else:
        assert type(actual) is type(expected) and actual == expected, path
