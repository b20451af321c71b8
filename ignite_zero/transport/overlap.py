"""Receiving while writing: the streams of a consolidated save's gathers travel in the background, and the saver
writes each received message from one of a few slots as soon as it has arrived.

A rank makes one :class:`Overlap` for a save and passes it to every gather of the save
(``gather_to(..., overlap=arriving)``): those gathers send or receive their streams in the background, one after the
other in a thread of its own, and return at once. The saver writes the checkpoint while its bytes arrive, waiting
(:meth:`Overlap.bytes_of`) only for the bytes it is about to write, and the received bytes wait for it in a few slots
reused from message to message, not in the gather's result. Headers and streams travel under different tags
(:data:`~ignite_zero.transport.streams.STREAM_TAG`), so the headers of the next gather, sent and received in the
caller's thread, never take the place of a stream's message.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import contextlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ignite_zero import staging
from ignite_zero.transport.streams import (
    DEFAULT_CHUNK_BYTES,
    StreamReceiver,
    flat_bytes,
    is_direct,
    memory_of,
    send_stream,
)

__all__ = ["Overlap"]

# Up to this many received messages wait for the saver in slots of their own, each of the size of the largest
# message (a larger one goes in place): a small share of what the other ranks send at a consolidated save.
_SLOTS = 4
_SLOT_BYTES = DEFAULT_CHUNK_BYTES
# Copies of at least this many bytes are deferred (Overlap.defer_copy); below it, the copy costs less than the
# bookkeeping, which a state of thousands of small tensors pays for each of them.
_DEFERRED_BYTES = 64 << 10


def _overlaps(destination: torch.Tensor, memory: tuple[int, int] | None) -> bool:
    """Whether the bytes ``destination`` overlap the memory ``[start, stop)`` (addresses)."""
    start = destination.data_ptr()
    return memory is not None and start < memory[1] and memory[0] < start + destination.numel()


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
    """The streams a rank sends or receives in the background during a consolidated save, and the memory they are
    still to fill; a context manager whose exit waits for every stream (see :meth:`__exit__`).

    One thread receives them, stream after stream in the order posted (the order in which the senders send them),
    so that the recipient of a consolidated save writes block k of the checkpoint while block k + 1 arrives. A sender
    sends its streams from a thread too, so that it tells the recipient what its next gather holds while the bytes of
    the one before still travel: the recipient knows the whole checkpoint, and starts writing it, at once, not once
    the first object's bytes have arrived.

    A message of one tensor's bytes goes into one of :data:`_SLOTS` slots, which the saver writes from
    (:meth:`bytes_of`) and then frees, and not into the gather's result, which is not written but for packed messages
    and the few below: the recipient's memory grows by the slots, not by what the other ranks send. A message that
    finds no free slot is posted later, its sender waiting meanwhile, first the one the saver most likely takes next;
    it goes into the result instead when the saver waits for it, or, with nothing in flight, for a message that is no
    peer's next (then every peer's next goes there), or takes no more bytes from slots (:meth:`finish`,
    :meth:`drain`): the thread and the saver never wait for each other.

    A consolidating saver uses it so (``write`` stands for the saver's writer)::

        with Overlap() as arriving:  # leaving it waits for every stream: no sender is left waiting
            full = gather_to(state, 0, group, overlap=arriving)  # returns at once
            if full is not None:
                write(full, arriving)  # takes each tensor's bytes through arriving.bytes_of
    """

    def __init__(self) -> None:
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ignite_zero-streams")
        self._done: list[concurrent.futures.Future[None]] = []
        self._lock = threading.Condition()
        self._starts: list[int] = []  # memory still to be filled, as sorted, disjoint [start, stop) addresses
        self._stops: list[int] = []
        self._error: BaseException | None = None
        self._deferred_starts: list[int] = []  # memory that is to take a rank's own part, sorted by start address
        self._deferred: list[tuple[int, int, memoryview]] = []
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

    def __enter__(self) -> Overlap:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        """Wait for every stream, so that no sender is left waiting, and raise the first failure (unless the block
        raised). A result that the block neither wrote through :meth:`bytes_of` nor completed with :meth:`finish`
        must not be used after it, and the tensors a rank sends must stay as they are until it ends."""
        if error is None:
            self.drain()
            return
        with contextlib.suppress(Exception):
            self.drain()

    def receive(self, receivers: Sequence[StreamReceiver], group: ProcessGroup | None) -> None:
        """:func:`~ignite_zero.transport.streams.receive_all` in the background, after the streams received before:
        returns at once."""
        with self._lock:
            for start, stop in (r for receiver in receivers for r in receiver.expected()):
                index = bisect.bisect(self._starts, start)
                self._starts.insert(index, start)
                self._stops.insert(index, stop)
        self._done.append(self._worker.submit(self._run, receivers, group))

    def send(self, tensors: Sequence[torch.Tensor], peer: int, group: ProcessGroup | None, chunk_bytes: int) -> None:
        """:func:`~ignite_zero.transport.streams.send_stream` in the background, after the streams sent before, once
        the work of this thread's CUDA streams that made ``tensors`` is done; returns at once, and ``tensors`` must stay
        as they are until the streams are drained. A failure is raised when they are drained, and no stream is sent
        after it: the peer would take its messages for those of the stream that failed."""
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
            send_stream(tensors, peer, group, chunk_bytes)
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
        """Receive every stream, one message in flight per peer as :func:`~ignite_zero.transport.streams.receive_all`,
        each message of one tensor's bytes into a slot: one that finds none free is posted later (its sender waits
        meanwhile), unless the saver waits for it, or takes no bytes from slots. Return the first failure: a peer that
        fails (dies) is given up, here and in the streams received after, but the others' messages are all received,
        so that no living sender is left waiting, and no later stream takes a message of this one."""
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
        """Remove ``[start, stop)`` from the memory still to be received (it lies within one expected range)."""
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

    def defer_copy(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """``target.copy_(source)`` (same shape), deferred where both are single runs of CPU memory of one dtype: a
        saver that writes ``target``'s bytes takes them from ``source`` itself (:meth:`bytes_of`), and :meth:`finish`
        copies them for any other, so that a rank's own shard is written from where it is, never copied. ``source``
        must stay as it is until then. A small one is copied at once: its copy costs less than keeping track of it."""
        small = target.numel() * target.element_size() < _DEFERRED_BYTES
        if small or not (is_direct(target) and is_direct(source) and target.dtype == source.dtype):
            target.copy_(source)
            return
        start = target.data_ptr()
        view = memory_of(flat_bytes(source.detach()))
        index = bisect.bisect(self._deferred_starts, start)
        self._deferred_starts.insert(index, start)
        self._deferred.insert(index, (start, start + view.nbytes, view))
        self._copies.append((target, source.detach()))

    def bytes_of(self, start: int, piece: memoryview) -> list[memoryview]:
        """The bytes to write for ``piece``, the memory ``[start, start + len(piece))`` (addresses) of the gather's
        result, in order, once every byte of it has arrived: where a rank's own part is to go (:meth:`defer_copy`), that
        part itself; where a received message waits in a slot, the slot; elsewhere ``piece``.

        The views returned stay valid until the next call: the caller writes them before it asks for more.
        """
        with self._lock:
            if self._written:  # the bytes handed out last time are written: their slots take new messages
                self._free += [held.slot for held in self._written]
                self._written.clear()
                self._lock.notify_all()
            # nothing still to arrive nor waiting in a slot (one rank, or every byte in): ``piece`` itself, unless a
            # deferred part lies in it; the common case of a state of many small tensors, asked of each
            arrived = not self._starts and not self._held and self._error is None
        stop = start + piece.nbytes
        if arrived and not self._deferred:
            self._taken = stop
            return [piece]
        parts: list[memoryview] = []
        position = start
        index = max(0, bisect.bisect(self._deferred_starts, start) - 1)
        while index < len(self._deferred) and self._deferred[index][0] < stop:
            own_start, own_stop, view = self._deferred[index]
            index += 1
            if own_stop <= position:
                continue
            if position < own_start:  # received memory before it
                parts += self._received(position, own_start, start, piece)
                position = own_start
            end = min(own_stop, stop)
            parts.append(view[position - own_start : end - own_start])
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
                parts.append(memory_of(held.slot)[low - held.start : high - held.start])
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
        in the parts left to :meth:`defer_copy` and the messages still in slots.

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
        self._deferred.clear()
        self._deferred_starts.clear()
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
