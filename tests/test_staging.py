"""Host copies of what a save writes (ignite_zero.staging): CPU tensors as a writer takes them."""

import torch
from torch import nn

from ignite_zero.adapters.regions import Box, Pieces
from ignite_zero.staging import Stager, on_host


def test_cpu_tensors_come_out_of_autograd_owning_their_bytes_and_nothing_else():
    plain = torch.arange(6.0)
    learnt = torch.arange(6.0, requires_grad=True)
    marked = torch.arange(6.0)
    marked.note = "an attribute of its own"
    parameter = nn.Parameter(torch.arange(6.0))
    part = torch.arange(12.0)[3:9]  # six elements of a storage of twelve
    transposed = torch.arange(6.0).reshape(2, 3).t()
    values = [plain, learnt, marked, parameter, part, transposed, "a value", 7]

    out = list(on_host(values, {}))

    assert out[0] is plain  # nothing to change: no copy, no new tensor
    assert out[-2:] == ["a value", 7]
    for tensor, original in zip(out[:-2], values[:-2], strict=True):
        assert type(tensor) is torch.Tensor and not tensor.requires_grad and not tensor.__dict__
        assert tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.nbytes
        assert torch.equal(tensor, original.detach())
    assert out[1].data_ptr() == learnt.data_ptr() and out[3].data_ptr() == parameter.data_ptr()  # views, not copies


def test_a_staged_snapshot_shares_its_regions_and_copies_its_tensors_and_values():
    pieces = Pieces()
    pieces.add(("w",), Box.whole((2,)), torch.ones(2))
    pieces.add_whole(("lr",), {"values": [0.1]})
    staged = Stager().stage((pieces, [{"params": ["w"]}]))[0]
    assert staged.regions is pieces.regions and staged.order is pieces.order, "complete: shared, not rebuilt"
    assert staged.tensors[0] is not pieces.tensors[0] and torch.equal(staged.tensors[0], pieces.tensors[0])
    assert staged.values == pieces.values and staged.values[("lr",)] is not pieces.values[("lr",)]


def test_staging_buffers_are_kept_while_shapes_and_dtypes_hold():
    stager = Stager()
    first = stager.stage({"a": torch.ones(2), "b": torch.ones(3)}, "x")
    again = stager.stage({"a": torch.zeros(2), "b": torch.zeros(3, dtype=torch.float64)}, "x")
    assert again["a"].data_ptr() == first["a"].data_ptr() and not again["a"].any(), "kept, with the new values"
    assert again["b"].dtype == torch.float64 and again["b"].data_ptr() != first["b"].data_ptr()
    other = stager.stage({"a": torch.ones(2)}, "y")
    assert other["a"].data_ptr() != again["a"].data_ptr(), "each name its own buffers"
    stager.stage({"a": torch.ones(2)}, "x")
    assert stager.nbytes == 2 * 4 + 2 * 4, "buffers of tensors gone are let go"
