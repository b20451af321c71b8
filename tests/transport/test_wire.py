"""Frames and errors between two real gloo ranks (:mod:`ignite_zero.transport.wire`)."""

import pytest
import torch
from launcher import run_ranks

from ignite_zero.transport import PeerError, post_error, post_frame, receive_bytes, receive_frame, send_bytes


def _test_frames(rank: int, world_size: int) -> None:
    peer = 1 - rank
    if rank == 0:
        data = torch.arange(10, dtype=torch.uint8)
        works = [*post_frame(data, peer, None), *post_frame(torch.empty(0, dtype=torch.uint8), peer, None)]
        works += post_error(ValueError("unreadable"), peer, None)
        for work in works:
            work.wait()
        send_bytes(b"header", peer, None)
        return
    buffer = torch.full((16,), 255, dtype=torch.uint8)
    received = receive_frame(peer, None, "a part", lambda size: buffer[:size])
    assert received.data_ptr() == buffer.data_ptr() and received.tolist() == list(range(10))
    assert receive_frame(peer, None, "a part").numel() == 0  # an empty frame: its length alone
    with pytest.raises(PeerError, match="rank 0 could not send a part: rank 0: ValueError: unreadable"):
        receive_frame(peer, None, "a part")
    assert receive_bytes(peer, None, "a header") == b"header"  # the frames after an error keep their order


@pytest.mark.distributed
def test_frames() -> None:
    """Frames posted from a tensor's memory arrive in a caller's buffer, empty frames and errors in their order."""
    run_ranks(_test_frames, 2)
