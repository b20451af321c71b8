"""Receiving while writing (:mod:`ignite_zero.transport.overlap`): a gather's streams travel in the background, the
recipient takes their bytes from a few slots as a saver does, in any order or not at all, without a deadlock, and a
sender that dies fails the gather without leaving a living sender waiting."""

import os
import signal
import time

import pytest
import torch
from launcher import run_ranks
from training import assert_state_equal

from ignite_zero import transport
from ignite_zero.transport import Overlap
from ignite_zero.transport.overlap import _SLOTS

pytestmark = pytest.mark.distributed


def test_overlap_waits_only_for_memory_still_to_arrive():
    overlap = Overlap()
    overlap._starts, overlap._stops = [100, 300], [200, 400]
    assert not overlap._pending(0, 100) and not overlap._pending(200, 300) and not overlap._pending(400, 500)
    assert overlap._pending(150, 160) and overlap._pending(0, 101) and overlap._pending(399, 1000)
    overlap._cut(120, 160)
    assert (overlap._starts, overlap._stops) == ([100, 160, 300], [120, 200, 400])
    assert not overlap._pending(120, 160) and overlap._pending(119, 121)
    overlap.finish()


def test_memory_with_nothing_to_arrive_is_handed_back_as_it_is():
    # one rank, or every byte in: each of thousands of small tensors is asked for without any bookkeeping
    tensor = torch.arange(8, dtype=torch.float32)
    piece = tensor.view(torch.uint8).numpy().data.cast("B")
    with Overlap() as overlap:
        overlap.receive([], None)
        assert overlap.bytes_of(tensor.data_ptr(), piece)[0] is piece
        overlap._starts, overlap._stops = [tensor.data_ptr() + 64], [tensor.data_ptr() + 96]  # still to arrive
        assert overlap.bytes_of(tensor.data_ptr(), piece[:16])[0] is not piece


def test_a_large_own_part_is_written_from_where_it_is_and_a_small_one_copied():
    # a consolidated save writes the recipient's own shards from where they lie rather than copy them into the
    # result; a small one is copied at once instead, which costs less than keeping track of it
    large_source, small_source = torch.arange(2**15, dtype=torch.float32), torch.arange(16, dtype=torch.float32)
    large, small = torch.zeros(2**15), torch.zeros(16)  # 128 KiB, and 64 bytes
    overlap = Overlap()
    overlap.defer_copy(large, large_source)
    overlap.defer_copy(small, small_source)
    assert torch.equal(small, small_source) and not large.any()  # the large one left where it is
    parts = overlap.bytes_of(large.data_ptr(), large.view(torch.uint8).numpy().data.cast("B"))
    assert b"".join(parts) == large_source.numpy().tobytes()
    assert [torch.frombuffer(part, dtype=torch.uint8).data_ptr() for part in parts] == [large_source.data_ptr()]
    overlap.finish()  # for a saver that reads the result itself: copied there now
    assert torch.equal(large, large_source)


def _sent(count=8, numel=2**19):
    """What rank 1 sends: tensors of 2 MiB, each in messages of its own (two of 1 MiB)."""
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(numel, generator=generator) for _ in range(count)]


def _written(overlap, tensor, slice_bytes=256 << 10):
    """The bytes a saver writes for ``tensor``, a result of the gather, slice by slice as it takes them."""
    memory = tensor.view(torch.uint8).numpy().data.cast("B")
    taken = bytearray()
    for start in range(0, memory.nbytes, slice_bytes):
        taken += b"".join(overlap.bytes_of(tensor.data_ptr() + start, memory[start : start + slice_bytes]))
    return bytes(taken)


def _received_through_slots(rank, world_size, order):
    """Ranks 1.. each send the tensors of :func:`_sent`, rank 0 takes their bytes as a saver does, in ``order``."""
    expected = [tensor for _ in range(1, world_size) for tensor in _sent()]
    with Overlap() as overlap:
        if rank:
            transport.gather_to(_sent(), 0, overlap=overlap)  # in the background: the block ends at once, leaving waits
            return None
        received = [tensor for sent in transport.gather_to(None, 0, overlap=overlap)[1:] for tensor in sent]
        if order == "finished":  # a saver that takes every byte from the result: the slots' messages copied there
            overlap.finish()
            assert_state_equal(received, expected)
            return len(overlap._slots)
        indices = {"in order": range(len(received)), "last first": reversed(range(len(received))), "half": range(4)}
        for index in indices[order]:
            assert _written(overlap, received[index]) == expected[index].numpy().tobytes(), index
        if order == "half":  # bytes handed out of slots are no longer in them: the result cannot be completed
            with pytest.raises(RuntimeError, match="handed out"):
                overlap.finish()
        return len(overlap._slots)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("order", ["in order", "last first", "finished", "half"])
def test_received_bytes_wait_in_a_few_slots_and_never_in_a_deadlock(order, world_size):
    slots = run_ranks(_received_through_slots, world_size, order)[0]
    # 16 messages of 1 MiB a sender went through at most 4 slots, reused; a saver that wants the last message first,
    # or that takes no bytes or stops taking them, has the rest received in place instead of waiting for slots that
    # it would free later (no sender is left waiting: leaving the block waits for every stream)
    assert 1 <= slots <= _SLOTS


def _a_sender_dies_between_two_gathers(rank, world_size):
    """Two gathers in one block, as a model's and an optimizer's: rank 2 dies while its first stream travels."""

    def gathers(overlap):
        first = transport.gather_to(_sent(), 0, overlap=overlap)  # 16 messages of 1 MiB a sender
        transport.gather_to([torch.full((3 * 2**16,), float(rank))], 0, overlap=overlap)  # one packed message
        return first

    if rank:
        with Overlap() as overlap:
            gathers(overlap)
            if rank == 2:
                time.sleep(0.5)  # its first messages taken into slots
                os.kill(os.getpid(), signal.SIGKILL)
        return "sent"  # leaving the block waited until the recipient took both streams
    with pytest.raises(RuntimeError, match="receiving the state of other ranks failed"):
        with Overlap() as overlap:
            first = gathers(overlap)
            time.sleep(1.5)  # the slots fill, rank 2 dies meanwhile
            for peer in (2, 1):
                _written(overlap, torch.empty(0, dtype=torch.uint8).set_(first[peer][0].untyped_storage()))
    return "raised"


def test_a_sender_that_dies_fails_the_gather_and_leaves_no_living_sender_waiting():
    # the recipient raises, its process alive; the living sender's streams are all taken, its second one too, and
    # no message of the first stream is taken for one of the second (gloo would abort the recipient on a size
    # mismatch)
    assert run_ranks(_a_sender_dies_between_two_gathers, 3, killed=[2], timeout=60)[:2] == ["raised", "sent"]
