"""Tensor streams (:mod:`ignite_zero.transport.streams`): the plan of messages both sides derive alike, and the
copy of ranges of non-contiguous tensors into them."""

import pytest
import torch
from transported import CHUNKS, edge_case_object

from ignite_zero import pickling
from ignite_zero.transport import DEFAULT_CHUNK_BYTES, streams


@pytest.mark.parametrize(
    "src",
    [
        torch.arange(6 * 5 * 4).reshape(6, 5, 4).permute(2, 0, 1),
        torch.arange(7 * 9).reshape(7, 9)[1:, ::2],
        torch.arange(5).expand(3, 5),
        torch.arange(4 * 3 * 2).reshape(4, 3, 2).transpose(0, 2)[:, 1:],
    ],
)
def test_copy_flat_range(src: torch.Tensor) -> None:
    """Every range of a non-contiguous tensor is copied in row-major order."""
    flat = src.reshape(-1)
    for start in range(flat.numel()):
        for stop in range(start + 1, flat.numel() + 1):
            out = torch.full((stop - start,), -1, dtype=src.dtype)
            streams._copy_flat_range(src, start, stop, out)
            assert torch.equal(out, flat[start:stop]), (start, stop)


@pytest.mark.parametrize("chunk", CHUNKS[:3])
def test_plan_covers_each_element_once(chunk: int) -> None:
    """Messages carry every element of every tensor once, in order, within the chunk, aligned in packs."""
    _, tensors = pickling.split_tensors(edge_case_object(1))
    metas = [(t.dtype, t.numel()) for t in tensors]
    covered = [0] * len(metas)
    for message in streams._plan(metas, chunk):
        assert message.nbytes <= max(chunk, max(dtype.itemsize for dtype, _ in metas))
        for (index, first, end), offset in zip(message.pieces, message.offsets):
            assert first == covered[index] and end > first
            assert offset % 16 == 0
            covered[index] = end
    assert covered == [numel for _, numel in metas]


def test_plan_packs_small_tensors_and_sends_big_ones_alone() -> None:
    """Adam over big layers: the 0-d steps share one message; each moment goes alone, so it is sent in place."""
    metas = ([(torch.float32, 1)] + [(torch.float32, 2**20)] * 2) * 3 + [(torch.bfloat16, 5)]
    messages = streams._plan(metas, DEFAULT_CHUNK_BYTES)
    assert [[index for index, _, _ in m.pieces] for m in messages] == [[0, 3, 6, 9], [1], [2], [4], [5], [7], [8]]
    assert [m.own for m in messages] == [False] + [True] * 6
