"""Tensor streams between two ranks: the values of a list of tensors as raw bytes, in bounded memory.

Both sides cut a stream into the same messages from the list of ``(dtype, numel)`` alone (see :func:`_plan`), so no
per-message metadata travels: gloo aborts the receiving *process* on a size mismatch, it cannot be left to chance.
Tensors under 1 MiB are packed into shared messages, since a message costs about the same whatever its size (Adam's
0-d ``step`` tensors all travel together); bigger ones get messages of their own, of at most ``chunk_bytes``, sent
straight from the tensor's memory and received straight into their destination (or, in a consolidated save, into a
slot that the saver writes from: :class:`~ignite_zero.transport.overlap.Overlap`). Anything else (packs,
non-contiguous or CUDA tensors) goes through one reusable staging buffer (pinned for CUDA), so a sender's extra
memory is bounded whatever the size of its state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "STREAM_TAG",
    "StreamReceiver",
    "chunk_bytes_for",
    "flat_bytes",
    "is_direct",
    "memory_of",
    "receive_all",
    "send_stream",
]

#: Largest message and staging buffer: larger messages gain little on gloo over TCP, and only staged data costs
#: memory.
DEFAULT_CHUNK_BYTES = 16 * 2**20

# Tensors below this size are packed (copied) into shared messages; bigger ones get their own.
_PACK_BELOW_BYTES = 2**20

# A sender stages at most 1/_STAGING_SHARE of what it sends (1 MiB at least): the staging buffer stays a
# small share of a rank's shard at any world size, so that a rank never holds much more than its own part.
_STAGING_SHARE = 16
_MIN_AUTO_CHUNK_BYTES = 2**20

#: The tag of the messages of tensor streams; headers go untagged (0). A stream received in the background and the
#: next header, received meanwhile in the caller's thread, are then never matched to each other's receives.
STREAM_TAG = 1

# Pieces inside a packed message start at multiples of this, so that typed views of the byte buffer are
# aligned for every dtype (complex128 included).
_ALIGN = 16


@dataclass
class _Message:
    """One point-to-point message: the element ranges ``(tensor, first, end)`` it carries, in order."""

    pieces: list[tuple[int, int, int]] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # byte offset of each piece in a packed message
    nbytes: int = 0
    own: bool = False  # a slice of one big tensor, sent and received in place


def _plan(metas: Sequence[tuple[torch.dtype, int]], chunk_bytes: int) -> list[_Message]:
    """Cut the values of tensors ``(dtype, numel)`` into messages; the same on sender and receiver."""
    messages: list[_Message] = []
    pack: _Message | None = None
    for index, (dtype, numel) in enumerate(metas):
        size = numel * dtype.itemsize
        if size == 0:
            continue
        if size < _PACK_BELOW_BYTES and size <= chunk_bytes:
            start = -(-(pack.nbytes if pack else 0) // _ALIGN) * _ALIGN
            if pack is None or start + size > chunk_bytes:
                pack, start = _Message(), 0
                messages.append(pack)
            pack.pieces.append((index, 0, numel))
            pack.offsets.append(start)
            pack.nbytes = start + size
            continue
        capacity = max(1, chunk_bytes // dtype.itemsize)
        for first in range(0, numel, capacity):
            end = min(first + capacity, numel)
            messages.append(_Message([(index, first, end)], [0], (end - first) * dtype.itemsize, own=True))
    return messages


def chunk_bytes_for(tensors: Sequence[torch.Tensor], chunk_bytes: int) -> int:
    """The largest message of a stream of ``tensors``: ``chunk_bytes``, or less for a small shard, so that staging
    stays a small share of it."""
    payload = sum(t.numel() * t.element_size() for t in tensors)
    return min(chunk_bytes, max(_MIN_AUTO_CHUNK_BYTES, payload // _STAGING_SHARE))


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``, flat: gloo moves bytes, and a uint8 view sidesteps any per-dtype support (bool, bf16,
    complex)."""
    return t.detach().reshape(-1).view(torch.uint8)


def memory_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(cast(Any, t.numpy())).cast("B")


def is_direct(t: torch.Tensor) -> bool:
    """Whether ``t`` is one run of CPU memory that messages can be sent from, or received into, as it is."""
    return t.device.type == "cpu" and t.is_contiguous() and not (t.is_conj() or t.is_neg())


def send_stream(tensors: Sequence[torch.Tensor], peer: int, group: ProcessGroup | None, chunk_bytes: int) -> None:
    """Send the values of ``tensors``; the peer runs :class:`StreamReceiver` with the same ``chunk_bytes``."""
    messages = _plan([(t.dtype, t.numel()) for t in tensors], chunk_bytes)
    staging: torch.Tensor | None = None
    for message in messages:
        if message.own and is_direct(tensors[message.pieces[0][0]]):
            index, first, end = message.pieces[0]
            dist.send(flat_bytes(tensors[index][...].reshape(-1)[first:end]), peer, group, tag=STREAM_TAG)
            continue
        if staging is None:
            largest = max(m.nbytes for m in messages if not (m.own and is_direct(tensors[m.pieces[0][0]])))
            pin = torch.cuda.is_available() and any(t.device.type == "cuda" for t in tensors)
            staging = torch.empty(largest, dtype=torch.uint8, pin_memory=pin)
        for (index, first, end), offset in zip(message.pieces, message.offsets):
            source = tensors[index].detach()
            target = staging[offset : offset + (end - first) * source.element_size()].view(source.dtype)
            _copy_flat_range(source, first, end, target)
        dist.send(staging[: message.nbytes], peer, group, tag=STREAM_TAG)  # returns once gloo is done with it


def _copy_flat_range(src: torch.Tensor, start: int, stop: int, out: torch.Tensor) -> None:
    """Copy elements ``[start, stop)`` of ``src`` in row-major order into ``out``, never all of ``src``.

    A non-contiguous tensor cannot be flattened without a full copy, so whole rows along dim 0 are copied
    as blocks, and the partial rows at both ends recursively.
    """
    if src.dim() <= 1 or src.is_contiguous():
        out.copy_(src.reshape(-1)[start:stop])  # a view: a device-to-host copy moves just this slice
        return
    row = src[0].numel()
    pos = start
    if pos % row:  # head: the end of a row
        r = pos // row
        end = min(stop, (r + 1) * row)
        _copy_flat_range(src[r], pos - r * row, end - r * row, out[: end - start])
        pos = end
    body_end = stop - stop % row
    if body_end > pos:  # body: whole rows
        out[pos - start : body_end - start].view(-1, *src.shape[1:]).copy_(src[pos // row : body_end // row])
        pos = body_end
    if pos < stop:  # tail: the start of a row
        r = pos // row
        _copy_flat_range(src[r], pos - r * row, stop - r * row, out[pos - start :])


class StreamReceiver:
    """Receives a stream from one peer into contiguous CPU ``destinations``, one message at a time."""

    def __init__(self, peer: int, destinations: Sequence[torch.Tensor], chunk_bytes: int) -> None:
        self.peer = peer
        self._destinations = destinations
        self._messages = _plan([(t.dtype, t.numel()) for t in destinations], chunk_bytes)
        self._next = 0
        self._staging: torch.Tensor | None = None
        self._current: _Message | None = None
        # the message being received, when it goes into a slot: (its destination's bytes, the slot)
        self.held: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def done(self) -> bool:
        """Whether every message was posted."""
        return self._next == len(self._messages)

    def upcoming(self) -> torch.Tensor | None:
        """The destination's bytes of the next message, where it carries one tensor's bytes (which a slot may take
        instead); ``None`` for a packed message, or at the end."""
        if self.done or not self._messages[self._next].own:
            return None
        index, first, end = self._messages[self._next].pieces[0]
        return flat_bytes(self._destinations[index].reshape(-1)[first:end])

    def post(self, group: ProcessGroup | None, slot: torch.Tensor | None = None) -> dist.Work | None:
        """Post the receive of the next message, into ``slot`` if given (a message of one tensor's bytes, see
        :attr:`held`); ``None`` once the stream is complete."""
        self.held = None
        self._current = None if self.done else self._messages[self._next]
        if self._current is None:
            return None
        self._next += 1
        if self._current.own:
            index, first, end = self._current.pieces[0]
            buffer = flat_bytes(self._destinations[index].reshape(-1)[first:end])
            if slot is not None:
                self.held = (buffer, slot)
                buffer = slot[: buffer.numel()]
        else:
            if self._staging is None or self._staging.numel() < self._current.nbytes:
                self._staging = torch.empty(self._current.nbytes, dtype=torch.uint8)
            buffer = self._staging[: self._current.nbytes]
        work = dist.irecv(buffer, self.peer, group, tag=STREAM_TAG)
        if work is None:  # only for a rank outside `group`, which `resolve` rules out
            raise RuntimeError("This rank is not part of `group`")
        return work

    def unpack(self) -> None:
        """Copy the pieces of a received packed message to their destinations."""
        message = self._current
        if message is None or message.own or self._staging is None:
            return
        for (index, first, end), offset in zip(message.pieces, message.offsets):
            destination = self._destinations[index]
            nbytes = (end - first) * destination.element_size()
            destination.reshape(-1)[first:end].copy_(self._staging[offset : offset + nbytes].view(destination.dtype))

    def ranges(self) -> list[tuple[int, int]]:
        """The memory ``[start, stop)`` (addresses) that the message being received fills in the destinations."""
        message = self._current
        if message is None:
            return []
        found = []
        for index, first, end in message.pieces:
            destination = self._destinations[index]
            address, size = destination.data_ptr(), destination.element_size()
            found.append((address + first * size, address + end * size))
        return found

    def expected(self) -> list[tuple[int, int]]:
        """The memory (addresses) that the whole stream fills, before any of it is received."""
        return [
            (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in self._destinations if t.numel() > 0
        ]


def receive_all(receivers: Sequence[StreamReceiver], group: ProcessGroup | None) -> None:
    """Receive every stream, round-robin with one receive in flight per peer: receiving from all senders at once
    beats receiving rank by rank, and more than one receive in flight per sender does not help further."""
    pending = [(receiver, work) for receiver in receivers if (work := receiver.post(group)) is not None]
    while pending:
        still = []
        for receiver, work in pending:
            work.wait()
            receiver.unpack()
            if (work := receiver.post(group)) is not None:
                still.append((receiver, work))
        pending = still
