"""Moving sharded state to one rank (and back) as raw tensors, once, in bounded memory.

``ZeroRedundancyOptimizer.consolidate_state_dict`` (and fairscale's ``OSS``) ``torch.save`` every rank's
local optimizer state and *broadcast* it to every rank: about 0.01 GB/s, and each non-recipient's memory
grows by about 11 times its shard. Here every rank sends what the recipient needs, to the recipient only,
over point-to-point messages:

* a small **header**: pickled structure and metadata, no tensor data, length first;
* a **tensor stream**: the values of a list of tensors as raw bytes. Both sides cut the stream into the
  same messages from the list of ``(dtype, numel)`` alone (see :func:`_plan`), so no per-message metadata
  travels: gloo aborts the receiving *process* on a size mismatch, it cannot be left to chance. Tensors
  under 1 MiB are packed into shared messages (one message costs about 1 ms on gloo/TCP whatever its
  size; Adam's 0-d ``step`` tensors all travel together); bigger ones get messages of their own, of at most
  ``chunk_bytes``, sent straight from the tensor's memory and received straight into their destination (or, in a
  consolidated save, into a slot that the saver writes from).
  Anything else (packs, non-contiguous or CUDA tensors) goes through one reusable staging buffer (pinned
  for CUDA), so a sender's extra memory is bounded whatever the size of its state.

Whole objects travel on the stream: :func:`send_to` / :func:`receive_from` point to point, and
:func:`gather_to` (e.g. each rank's local ZeRO optimizer state) to one rank, which gets views of one flat buffer
per (sender, dtype). :func:`ignite_zero.adapters.regions.gather_pieces` builds on the headers and streams to
assemble full tensors from the regions that ranks hold (FSDP shards). The gloo groups they run on come from
:mod:`ignite_zero.transport.groups`.

Within :func:`overlapped` (a consolidated save), every rank sends or receives the streams of its gathers in the
background, one after the other in a thread of its own, and the gathers return at once: the saver writes the
checkpoint while its bytes arrive, waiting (:meth:`Overlap.bytes_of`) only for the bytes it is about to write, and
the received bytes wait for it in a few slots reused from message to message, not in the gather's result. Headers and
streams travel under different tags, so the headers of the next gather, sent and received in the caller's thread,
never take the place of a stream's message.

A rank that cannot send tells the receiver instead of leaving it waiting (a negative header length
announces an error message), so an error never turns into a hang. Headers are unpickled on the receiving
rank: a rank trusts its peers exactly as ``torch.distributed``'s own object collectives do.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import contextlib
import contextvars
import math
import pickle
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ignite_zero import staging
from ignite_zero.pickling import join_tensors, split_tensors
from ignite_zero.transport.groups import cpu_backend

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "Overlap",
    "PeerError",
    "StreamReceiver",
    "chunk_bytes_for",
    "fill",
    "gather_to",
    "overlapped",
    "receive_all",
    "receive_bytes",
    "receive_from",
    "resolve",
    "send_bytes",
    "send_error",
    "send_failure",
    "send_stream",
    "send_to",
]

#: Largest message and staging buffer. Gathering 400 MB over gloo/TCP on a 2-core host took 0.37 s with
#: 4 MiB, 0.28-0.33 s with 16 MiB and 0.27 s with 64 MiB; only staged data costs memory.
DEFAULT_CHUNK_BYTES = 16 * 2**20

# Tensors below this size are packed (copied) into shared messages; bigger ones get their own.
_PACK_BELOW_BYTES = 2**20

# A sender stages at most 1/_STAGING_SHARE of what it sends (1 MiB at least): the staging buffer stays a
# small share of a rank's shard at any world size, so that a rank never holds much more than its own part.
_STAGING_SHARE = 16
_MIN_AUTO_CHUNK_BYTES = 2**20

# The tag of the messages of tensor streams; headers go untagged (0). A stream received in the background and the
# next header, received meanwhile in the caller's thread, are then never matched to each other's receives.
_STREAM_TAG = 1

# Within :func:`overlapped`, up to this many received messages wait for the saver in slots of their own, each of the
# size of the largest message (a larger one goes in place): 64 MiB against the 0.3 GB that the other rank sends at a
# consolidated FSDP2 save of 0.6 GB on 2 ranks.
_SLOTS = 4
_SLOT_BYTES = DEFAULT_CHUNK_BYTES

# Pieces inside a packed message start at multiples of this, so that typed views of the byte buffer are
# aligned for every dtype (complex128 included).
_ALIGN = 16

# --------------------------------------------------------------------------------------------------
# Ranks


@dataclass(frozen=True)
class Ranks:
    group: ProcessGroup | None
    size: int
    rank: int  # this rank, within the group
    root: int  # the gathering (scattering) rank, within the group

    def peer(self, group_rank: int) -> int:
        """Global rank of a group rank (point-to-point calls take global ranks)."""
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank


def resolve(group: ProcessGroup | None, root: int, name: str) -> Ranks:
    """Ranks involved, with the same checks on every rank; ``root`` is a global rank."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None or root != 0:
            raise ValueError(f"Without a process group `{name}` must be 0 and `group` None, but given {root}, {group}")
        return Ranks(None, 1, 0, 0)
    group = dist.group.WORLD if group is None else group
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("This rank is not part of `group`")
    ranks = dist.get_process_group_ranks(group)
    if root not in ranks:
        raise ValueError(f"Argument `{name}` should be a global rank in the group {ranks}, but given {root}")
    if group is not None and cpu_backend(group) in ("", "nccl"):
        raise ValueError("`group` has no backend for CPU tensors (NCCL only?): pass `cpu_group(group)` instead")
    return Ranks(group, len(ranks), rank, ranks.index(root))


# --------------------------------------------------------------------------------------------------
# Headers: length-prefixed bytes, or an error message in their place


class PeerError(RuntimeError):
    """A peer reported that it could not send what was expected of it."""


def send_bytes(data: bytes, peer: int, group: ProcessGroup | None, length: int | None = None) -> None:
    dist.send(torch.tensor([len(data) if length is None else length], dtype=torch.int64), peer, group)
    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), peer, group)


def send_error(error: BaseException | str, peer: int, group: ProcessGroup | None) -> None:
    # A negative length announces an error message instead of a header: the peer raises, not hangs.
    text = error if isinstance(error, str) else f"rank {dist.get_rank()}: {type(error).__name__}: {error}"
    message = text.encode()
    send_bytes(message, peer, group, -len(message))


def receive_bytes(peer: int, group: ProcessGroup | None, what: str) -> bytes:
    """Receive a header; raise :class:`PeerError` if the peer sent an error message instead."""
    length = torch.zeros(1, dtype=torch.int64)
    dist.recv(length, peer, group)
    n = int(length.item())
    data = bytearray(abs(n))
    dist.recv(torch.frombuffer(data, dtype=torch.uint8), peer, group)
    if n < 0:
        raise PeerError(f"rank {peer} could not send {what}: {data.decode(errors='replace')}")
    return bytes(data)


# --------------------------------------------------------------------------------------------------
# Tensor streams


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
    # A small shard gets a smaller chunk, so that staging stays a small share of it (invariant 4).
    payload = sum(t.numel() * t.element_size() for t in tensors)
    return min(chunk_bytes, max(_MIN_AUTO_CHUNK_BYTES, payload // _STAGING_SHARE))


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    # gloo moves bytes; a uint8 view sidesteps any per-dtype support (bool, bf16, complex).
    return t.detach().reshape(-1).view(torch.uint8)


def _memory(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(cast(Any, t.numpy())).cast("B")


def _is_direct(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.is_contiguous() and not (t.is_conj() or t.is_neg())


def send_stream(tensors: Sequence[torch.Tensor], peer: int, group: ProcessGroup | None, chunk_bytes: int) -> None:
    """Send the values of ``tensors``; the peer runs :class:`StreamReceiver` with the same ``chunk_bytes``. Within
    :func:`overlapped`, in the background, after the streams sent before: ``tensors`` must stay as they are until it
    ends."""
    overlap = _overlap.get()
    if overlap is not None:
        overlap.send(tensors, peer, group, chunk_bytes)
        return
    _send_stream(tensors, peer, group, chunk_bytes)


def _send_stream(tensors: Sequence[torch.Tensor], peer: int, group: ProcessGroup | None, chunk_bytes: int) -> None:
    messages = _plan([(t.dtype, t.numel()) for t in tensors], chunk_bytes)
    staging: torch.Tensor | None = None
    for message in messages:
        if message.own and _is_direct(tensors[message.pieces[0][0]]):
            index, first, end = message.pieces[0]
            dist.send(_flat_bytes(tensors[index][...].reshape(-1)[first:end]), peer, group, tag=_STREAM_TAG)
            continue
        if staging is None:
            largest = max(m.nbytes for m in messages if not (m.own and _is_direct(tensors[m.pieces[0][0]])))
            pin = torch.cuda.is_available() and any(t.device.type == "cuda" for t in tensors)
            staging = torch.empty(largest, dtype=torch.uint8, pin_memory=pin)
        for (index, first, end), offset in zip(message.pieces, message.offsets):
            source = tensors[index].detach()
            target = staging[offset : offset + (end - first) * source.element_size()].view(source.dtype)
            _copy_flat_range(source, first, end, target)
        dist.send(staging[: message.nbytes], peer, group, tag=_STREAM_TAG)  # returns once gloo is done with it


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
        return _flat_bytes(self._destinations[index].reshape(-1)[first:end])

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
            buffer = _flat_bytes(self._destinations[index].reshape(-1)[first:end])
            if slot is not None:
                self.held = (buffer, slot)
                buffer = slot[: buffer.numel()]
        else:
            if self._staging is None or self._staging.numel() < self._current.nbytes:
                self._staging = torch.empty(self._current.nbytes, dtype=torch.uint8)
            buffer = self._staging[: self._current.nbytes]
        work = dist.irecv(buffer, self.peer, group, tag=_STREAM_TAG)
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


def _overlaps(destination: torch.Tensor, memory: tuple[int, int] | None) -> bool:
    """Whether the bytes ``destination`` overlap the memory ``[start, stop)`` (addresses)."""
    start = destination.data_ptr()
    return memory is not None and start < memory[1] and memory[0] < start + destination.numel()


def receive_all(receivers: Sequence[StreamReceiver], group: ProcessGroup | None) -> None:
    """Receive every stream, round-robin with one receive in flight per peer; within :func:`overlapped`, in the
    background, after the streams posted before.

    With 4 ranks on 2 cores, receiving from all senders at once beat receiving rank by rank by 13-20%;
    more than one receive in flight per sender did not help further.
    """
    overlap = _overlap.get()
    if overlap is not None:
        overlap.post(receivers, group)
        return
    _receive(receivers, group)


def _receive(receivers: Sequence[StreamReceiver], group: ProcessGroup | None) -> None:
    pending = [(receiver, work) for receiver in receivers if (work := receiver.post(group)) is not None]
    while pending:
        still = []
        for receiver, work in pending:
            work.wait()
            receiver.unpack()
            if (work := receiver.post(group)) is not None:
                still.append((receiver, work))
        pending = still


@dataclass(eq=False)  # each is itself: removed from lists by identity, never by comparing tensors
class _Held:
    """A received message kept in a slot until the saver has written it: the bytes of the gather's result that it is
    for, the slot, and how many of its bytes were handed out."""

    destination: torch.Tensor
    slot: torch.Tensor
    taken: int = 0

    @property
    def start(self) -> int:
        """The address of the memory it is for."""
        return self.destination.data_ptr()

    @property
    def stop(self) -> int:
        return self.start + self.destination.numel()

    def put_in_place(self) -> None:
        """Copy the message from its slot into the gather's result."""
        self.destination.copy_(self.slot[: self.destination.numel()])


class Overlap:
    """The streams a rank sends or receives in the background within :func:`overlapped`, and the memory they are
    still to fill.

    One thread receives them, stream after stream in the order posted (the order in which the senders send them),
    so that the recipient of a consolidated save writes block k of the checkpoint while block k + 1 arrives. A sender
    sends its streams from a thread too, so that it tells the recipient what its next gather holds while the bytes of
    the one before still travel: the recipient knows the whole checkpoint, and starts writing it, at once, not once
    the first object's bytes have arrived (80 ms of a consolidated FSDP2 save of 0.6 GB on 2 ranks).

    A message of one tensor's bytes goes into one of :data:`_SLOTS` slots, which the saver writes from
    (:meth:`bytes_of`) and then frees, and not into the gather's result, which is not written but for packed messages
    and the few below: the recipient's memory grows by the slots, not by what the other ranks send (17-42 MB, against
    0.15-0.3 GB received, at consolidated saves of 0.6 GB on 2-4 ranks). A message that finds no free slot is posted
    later, its sender waiting meanwhile, first the one the saver most likely takes next; it goes into the result
    instead when the saver waits for it, or, with nothing in flight, for a message that is no peer's next (then every
    peer's next goes there), or takes no more bytes from slots (:meth:`finish`, :meth:`drain`): the thread and the
    saver never wait for each other.
    """

    def __init__(self) -> None:
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ignite_zero-streams")
        self._done: list[concurrent.futures.Future[None]] = []
        self._lock = threading.Condition()
        self._starts: list[int] = []  # memory still to be filled, as sorted, disjoint [start, stop) addresses
        self._stops: list[int] = []
        self._error: BaseException | None = None
        self._fill_starts: list[int] = []  # memory that is to take a rank's own part, sorted by start address
        self._fills: list[tuple[int, int, memoryview]] = []
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._slots: list[torch.Tensor] = []  # made as needed, up to _SLOTS
        self._free: list[torch.Tensor] = []
        self._held: list[_Held] = []  # received into slots, not yet written
        self._written: list[_Held] = []  # handed out whole: their slots are free once the bytes handed out are written
        self._stall: tuple[int, int] | None = None  # the memory (addresses) whose bytes the saver waits for
        self._taken = 0  # the end (address) of the memory whose bytes the saver took last
        self._drained = False  # drained: every byte still to come goes in place
        self._handed_out = False  # bytes_of handed out bytes of slots: finish cannot complete the result
        self._send_failure: BaseException | None = None
        self._lost: set[int] = set()  # peers whose streams failed

    def post(self, receivers: Sequence[StreamReceiver], group: ProcessGroup | None) -> None:
        """Receive ``receivers``' streams after those posted before."""
        with self._lock:
            for start, stop in (r for receiver in receivers for r in receiver.expected()):
                index = bisect.bisect(self._starts, start)
                self._starts.insert(index, start)
                self._stops.insert(index, stop)
        self._done.append(self._worker.submit(self._run, receivers, group))

    def send(self, tensors: Sequence[torch.Tensor], peer: int, group: ProcessGroup | None, chunk_bytes: int) -> None:
        """Send a stream after those sent before, once the work of this thread's CUDA streams that made ``tensors`` is
        done; a failure is raised when the streams are drained, and no stream is sent after it: the peer would take
        its messages for those of the stream that failed."""
        producers = staging.current_streams() if any(t.device.type == "cuda" for t in tensors) else {}
        self._done.append(self._worker.submit(self._send, tensors, peer, group, chunk_bytes, producers))

    def _send(
        self,
        tensors: Sequence[torch.Tensor],
        peer: int,
        group: ProcessGroup | None,
        chunk_bytes: int,
        producers: staging.Streams,
    ) -> None:
        if self._send_failure is not None:
            raise RuntimeError(f"not sent: an earlier stream to rank {peer} failed") from self._send_failure
        try:
            for index, producer in producers.items():
                torch.cuda.current_stream(index).wait_stream(producer)
            _send_stream(tensors, peer, group, chunk_bytes)
        except BaseException as error:
            self._send_failure = error
            raise

    def _run(self, receivers: Sequence[StreamReceiver], group: ProcessGroup | None) -> None:
        try:
            failure = self._receive(receivers, group)
        except BaseException as error:  # here, not a peer's (no memory for a slot, say): its streams are given up
            for receiver in receivers:
                self._lose(receiver.peer, error)
            raise
        if failure is not None:
            raise failure

    def _receive(self, receivers: Sequence[StreamReceiver], group: ProcessGroup | None) -> BaseException | None:
        """Receive every stream, one message in flight per peer as :func:`receive_all`, each message of one tensor's
        bytes into a slot: one that finds none free is posted later (its sender waits meanwhile), unless the saver
        waits for it, or takes no bytes from slots. Return the first failure: a peer that fails (dies) is given up,
        here and in the streams received after, but the others' messages are all received, so that no living sender
        is left waiting, and no later stream takes a message of this one."""
        failure = None
        pending: list[tuple[StreamReceiver, dist.Work]] = []
        idle = [r for r in receivers if not r.done and r.peer not in self._lost]  # next message not posted yet
        while pending or idle:
            with self._lock:
                posts = self._placements(idle, bool(pending))
                while not posts and not pending:
                    self._lock.wait()
                    posts = self._placements(idle, False)
            for receiver, slot in posts:
                idle.remove(receiver)
                try:
                    pending.append((receiver, cast(dist.Work, receiver.post(group, slot))))
                except Exception as error:
                    failure = failure or self._lose(receiver.peer, error)
            if not pending:
                continue
            receiver, work = pending.pop(0)
            try:
                work.wait()
                receiver.unpack()
            except Exception as error:
                failure = failure or self._lose(receiver.peer, error)
                continue
            self._arrived(receiver)
            if not receiver.done:
                idle.append(receiver)
        return failure

    def _lose(self, peer: int, error: BaseException) -> BaseException:
        """Give up on ``peer``, which failed with ``error``: the saver learns it at once, and what is still to come
        goes in place."""
        with self._lock:
            self._lost.add(peer)
            self._error = self._error or error
            self._lock.notify_all()
        return error

    def _placements(
        self, idle: list[StreamReceiver], receiving: bool
    ) -> list[tuple[StreamReceiver, torch.Tensor | None]]:
        """Which of the receivers ``idle`` post their next message now, each into a slot or in place (``None``);
        under the lock. Free slots go first to the message that fills the memory nearest after what the saver took
        last, which it most likely takes next: the rest of a peer's flat buffer in a ZeRO gather, the next peer's
        rows of an FSDP tensor."""
        posts: list[tuple[StreamReceiver, torch.Tensor | None]] = []
        # what the saver waits for, unless it arrived meanwhile (the saver is woken, but may not have run yet)
        stall = self._stall if self._stall is not None and self._pending(*self._stall) else None
        for receiver in sorted(idle, key=self._nearness):
            destination = receiver.upcoming()
            if destination is None or destination.numel() > _SLOT_BYTES:  # packed, or too big for a slot
                posts.append((receiver, None))
            elif self._free or len(self._slots) < _SLOTS:
                if not self._free:
                    self._free.append(torch.empty(_SLOT_BYTES, dtype=torch.uint8))
                    self._slots.append(self._free[-1])
                posts.append((receiver, self._free.pop()))
            elif self._drained or self._error is not None or _overlaps(destination, stall):
                posts.append((receiver, None))  # no saver to free a slot, or it waits for this very message
        if not posts and not receiving and stall is not None:
            # the saver waits for a message that is no peer's next: receive on in place rather than wait for it
            posts = [(receiver, None) for receiver in idle]
        return posts

    def _nearness(self, receiver: StreamReceiver) -> tuple[int, int]:
        """How soon the saver takes ``receiver``'s next message, most likely; before it takes any bytes, all alike:
        the peers in turn, as their gathers came (peer by peer in a ZeRO gather, row block by row block in FSDP's)."""
        destination = receiver.upcoming()
        distance = -1 if destination is None or not self._taken else destination.data_ptr() - self._taken
        return (0, distance) if distance >= 0 else (1, 0)

    def _arrived(self, receiver: StreamReceiver) -> None:
        with self._lock:
            for start, stop in receiver.ranges():
                self._cut(start, stop)
            if receiver.held is not None:
                self._held.append(_Held(*receiver.held))
            self._lock.notify_all()

    def _cut(self, start: int, stop: int) -> None:
        """Remove ``[start, stop)`` from the memory still to be filled (it lies within one expected range)."""
        index = bisect.bisect(self._starts, start) - 1
        if index < 0 or self._stops[index] < stop:
            return
        low, high = self._starts[index], self._stops[index]
        del self._starts[index], self._stops[index]
        for piece_start, piece_stop in ((low, start), (stop, high)):
            if piece_start < piece_stop:
                position = bisect.bisect(self._starts, piece_start)
                self._starts.insert(position, piece_start)
                self._stops.insert(position, piece_stop)

    def _pending(self, start: int, stop: int) -> bool:
        index = bisect.bisect_left(self._stops, start + 1)  # the first range that ends after `start`
        return index < len(self._starts) and self._starts[index] < stop

    def fill(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """Let ``target`` (memory the gather's result holds) take ``source``'s bytes later: a saver that writes them
        takes them from ``source`` itself (:meth:`bytes_of`), and :meth:`finish` copies them for any other. Both are
        single runs of CPU memory of the same size, and ``source`` stays as it is until then."""
        start = target.data_ptr()
        view = _memory(_flat_bytes(source))
        index = bisect.bisect(self._fill_starts, start)
        self._fill_starts.insert(index, start)
        self._fills.insert(index, (start, start + view.nbytes, view))
        self._copies.append((target, source))

    def bytes_of(self, start: int, piece: memoryview) -> list[memoryview]:
        """The bytes to write for ``piece``, the memory ``[start, start + len(piece))`` (addresses) of the gather's
        result, in order, once every byte of it has arrived: where a rank's own part is to go (:meth:`fill`), that
        part itself; where a received message waits in a slot, the slot; elsewhere ``piece``.

        The views returned stay valid until the next call: the caller writes them before it asks for more.
        """
        with self._lock:
            if self._written:  # the bytes handed out last time are written: their slots take new messages
                self._free += [held.slot for held in self._written]
                self._written.clear()
                self._lock.notify_all()
        stop = start + piece.nbytes
        parts: list[memoryview] = []
        position = start
        index = max(0, bisect.bisect(self._fill_starts, start) - 1)
        while index < len(self._fills) and self._fills[index][0] < stop:
            fill_start, fill_stop, view = self._fills[index]
            index += 1
            if fill_stop <= position:
                continue
            if position < fill_start:  # received memory before it
                parts += self._received(position, fill_start, start, piece)
                position = fill_start
            end = min(fill_stop, stop)
            parts.append(view[position - fill_start : end - fill_start])
            position = end
        if position < stop:
            parts += self._received(position, stop, start, piece)
        self._taken = stop
        return parts

    def _received(self, first: int, last: int, start: int, piece: memoryview) -> list[memoryview]:
        """The received bytes of the memory ``[first, last)`` within ``piece`` (which starts at ``start``), once
        they have all arrived: from the slots that hold them, elsewhere from ``piece`` itself."""
        self._await(first, last)
        parts: list[memoryview] = []
        with self._lock:
            for held in sorted((h for h in self._held if h.start < last and first < h.stop), key=lambda h: h.start):
                low, high = max(first, held.start), min(last, held.stop)
                if first < low:
                    parts.append(piece[first - start : low - start])
                parts.append(_memory(held.slot)[low - held.start : high - held.start])
                held.taken += high - low
                self._handed_out = True
                if held.taken == held.stop - held.start:
                    self._held.remove(held)
                    self._written.append(held)
                first = high
        if first < last:
            parts.append(piece[first - start : last - start])
        return parts

    def wait_for(self, start: int, stop: int) -> None:
        """Return once the memory ``[start, stop)`` (addresses) of the gather's result holds every byte it receives
        (those waiting in slots are copied there).

        Raises:
            RuntimeError: receiving failed (a peer died, say); the cause is chained.
        """
        self._refuse_after_bytes_of("wait_for")
        self._await(start, stop)
        with self._lock:
            for held in [h for h in self._held if h.start < stop and start < h.stop]:
                held.put_in_place()
                self._held.remove(held)
                self._free.append(held.slot)
            self._lock.notify_all()

    def _refuse_after_bytes_of(self, name: str) -> None:
        if self._handed_out:
            raise RuntimeError(
                f"{name} after bytes_of: bytes handed out of slots are no longer there to copy into the gather's "
                "result, which cannot be completed. Take every byte through bytes_of, or none."
            )

    def _await(self, start: int, stop: int) -> None:
        """Return once every byte that the memory ``[start, stop)`` receives has arrived, in place or in a slot."""
        with self._lock:
            try:
                while self._error is None and self._pending(start, stop):
                    self._stall = (start, stop)  # its message goes in place if no slot is free
                    self._lock.notify_all()
                    self._lock.wait()
            finally:
                self._stall = None
            if self._error is not None:
                raise RuntimeError(f"receiving the state of other ranks failed: {self._error}") from self._error

    def finish(self) -> None:
        """Complete the gather's result: wait until every stream is received (raising the first failure), then copy
        in the parts left to :meth:`fill` and the messages still in slots.

        Raises:
            RuntimeError: :meth:`bytes_of` handed out bytes of slots, which are no longer there to copy.
        """
        self.drain()
        self._refuse_after_bytes_of("finish")
        for target, source in self._copies:
            target.copy_(source)
        for held in self._held:
            held.put_in_place()
        self._copies.clear()
        self._fills.clear()
        self._fill_starts.clear()
        self._held.clear()

    def drain(self) -> None:
        """Wait until every stream is sent and received, so that no peer is left waiting; raise the first failure."""
        with self._lock:
            self._drained = True  # no saver is to free a slot any more: receive in place
            self._lock.notify_all()
        try:
            for done in self._done:
                done.result()
        finally:
            self._worker.shutdown()


_overlap: contextvars.ContextVar[Overlap | None] = contextvars.ContextVar("ignite_zero_overlap", default=None)


@contextlib.contextmanager
def overlapped() -> Iterator[Overlap]:
    """Send and receive the streams of the gathers made within in the background, and leave a rank's own parts where
    they are (see :class:`Overlap`); on leaving, wait for every stream, so that no sender is left waiting, and raise
    the first failure (unless the block raised). A result that the block neither wrote through
    :meth:`Overlap.bytes_of` nor completed with :meth:`Overlap.finish` must not be used after it, and the tensors a
    rank sends must stay as they are until it ends."""
    overlap = Overlap()
    token = _overlap.set(overlap)
    try:
        yield overlap
    except BaseException:
        with contextlib.suppress(Exception):
            overlap.drain()
        raise
    else:
        overlap.drain()
    finally:
        _overlap.reset(token)


def fill(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target.copy_(source)`` (same shape); within :func:`overlapped`, left to :meth:`Overlap.fill` where both are
    single runs of CPU memory of one dtype: a 0.3 GB FSDP2 shard is then written from where it is, never copied."""
    overlap = _overlap.get()
    if overlap is None or not (_is_direct(target) and _is_direct(source) and target.dtype == source.dtype):
        target.copy_(source)
        return
    overlap.fill(target, source.detach())


# --------------------------------------------------------------------------------------------------
# Objects: a skeleton pickled with its tensors replaced by indices, then the tensors


def _to_cpu(obj: Any) -> Any:
    structure, tensors = split_tensors(obj)  # also applies the senders' checks, so any rank may be the root
    if all(t.device.type == "cpu" for t in tensors):
        return obj
    return join_tensors(structure, [t.cpu() for t in tensors])


@dataclass
class _OutgoingObject:
    header: bytes
    tensors: list[torch.Tensor]
    chunk_bytes: int


def _prepare(obj: Any, chunk_bytes: int) -> _OutgoingObject:
    """Serialize the skeleton; raises before anything is sent if ``obj`` cannot be sent."""
    structure, tensors = split_tensors(obj)
    chunk_bytes = chunk_bytes_for(tensors, chunk_bytes)
    metas = [(t.dtype, tuple(t.shape)) for t in tensors]
    header = pickle.dumps((chunk_bytes, metas, structure), protocol=pickle.HIGHEST_PROTOCOL)
    return _OutgoingObject(header, tensors, chunk_bytes)


def _send_object(outgoing: _OutgoingObject, peer: int, group: ProcessGroup | None) -> None:
    send_bytes(outgoing.header, peer, group)
    send_stream(outgoing.tensors, peer, group, outgoing.chunk_bytes)


class _IncomingObject:
    """An object being received: one flat CPU buffer per dtype, and the views its tensors will be."""

    def __init__(self, peer: int, header: bytes) -> None:
        chunk_bytes, metas, self._structure = pickle.loads(header)
        numels: dict[torch.dtype, int] = {}
        offsets = []
        for dtype, shape in metas:
            offsets.append(numels.get(dtype, 0))
            numels[dtype] = offsets[-1] + math.prod(shape)
        buffers = {dtype: torch.empty(numel, dtype=dtype) for dtype, numel in numels.items()}
        self._tensors = [
            buffers[dtype][offset : offset + math.prod(shape)].view(shape)
            for (dtype, shape), offset in zip(metas, offsets)
        ]
        self.receiver = StreamReceiver(peer, self._tensors, chunk_bytes)

    def result(self) -> Any:
        return join_tensors(self._structure, self._tensors)


def send_to(obj: Any, dst: int, group: ProcessGroup | None = None, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
    """Send ``obj`` to the global rank ``dst``, which calls :func:`receive_from`; point to point.

    Raises:
        TypeError: ``obj`` holds a tensor without plain strided data; ``dst`` is told and raises too.
    """
    ranks = resolve(group, dst, "dst")
    try:
        outgoing = _prepare(obj, chunk_bytes)
    except Exception as error:  # an unpicklable leaf or an unsupported tensor: tell `dst`, then fail here
        send_error(error, dst, ranks.group)
        raise
    _send_object(outgoing, dst, ranks.group)


def send_failure(error: BaseException, dst: int, group: ProcessGroup | None = None) -> None:
    """Tell the global rank ``dst``, waiting in :func:`receive_from`, that its object will not come: it raises."""
    send_error(error, dst, resolve(group, dst, "dst").group)


def receive_from(src: int, group: ProcessGroup | None = None) -> Any:
    """Receive the object the global rank ``src`` sends with :func:`send_to`.

    Returns:
        The object; its tensors are CPU views of one flat buffer per dtype.

    Raises:
        RuntimeError: ``src`` could not send it.
    """
    ranks = resolve(group, src, "src")
    incoming = _IncomingObject(src, receive_bytes(src, ranks.group, "the object"))
    receive_all([incoming.receiver], ranks.group)
    return incoming.result()


def gather_to(
    obj: Any, dst: int, group: ProcessGroup | None = None, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> list[Any] | None:
    """Gather every rank's object on ``dst``; a collective over ``group``.

    Args:
        obj: this rank's object: dicts, lists, tuples and other picklable containers of tensors and small
            picklable leaves. Its tensors travel as raw bytes, to ``dst`` only.
        dst: global rank that receives the objects.
        group: process group whose CPU backend is gloo (see :func:`cpu_group`); ``None`` for the default
            group. Without a process group this is a one-rank gather.
        chunk_bytes: most bytes a sender stages at a time, and the largest message; a sender whose tensors
            hold less than 16 times as much uses 1/16 of their size (1 MiB at least).

    Returns:
        On ``dst``, the objects of all ranks in group-rank order: received tensors are CPU views of one flat
        buffer per (sender, dtype); ``dst``'s own object comes back as is (with CPU copies of any device
        tensors). ``None`` on other ranks.

    Raises:
        ValueError: ``dst`` or this rank is not in ``group``.
        TypeError: on a sender, its object holds a tensor without plain strided data (sparse, meta...).
        RuntimeError: on ``dst``, some rank could not send its object; every sender is drained first, so no
            rank hangs and the group stays usable.

    Note:
        ``torch.save`` of received tensors writes their whole flat buffer: save all of a sender's tensors,
        or clone the ones kept.
    """
    ranks = resolve(group, dst, "dst")
    if ranks.rank != ranks.root:
        send_to(obj, dst, group, chunk_bytes=chunk_bytes)
        return None
    incoming: dict[int, _IncomingObject] = {}
    failures: dict[int, str] = {}
    for peer in range(ranks.size):
        if peer != ranks.rank:
            try:
                incoming[peer] = _IncomingObject(
                    ranks.peer(peer), receive_bytes(ranks.peer(peer), ranks.group, "its object")
                )
            except PeerError as error:
                failures[peer] = str(error)
    receive_all([item.receiver for item in incoming.values()], ranks.group)
    try:
        own = _to_cpu(obj)
    except Exception as error:  # only now: every sender has been drained, so none of them hangs
        failures[ranks.rank] = f"rank {dst}: {type(error).__name__}: {error}"
    if failures:
        raise RuntimeError("Some ranks could not send their state: " + "; ".join(failures[p] for p in sorted(failures)))
    return [own if peer == ranks.rank else incoming[peer].result() for peer in range(ranks.size)]
