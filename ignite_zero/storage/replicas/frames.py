"""How the parts of a replica file travel over the transport's wire, and the threads that move them, watched so that a
peer that stops answering fails the move within its timeout.

A file goes to a peer as frames of the wire (:func:`~ignite_zero.transport.post_frame`): its parts, each of at most
:data:`CHUNK_BYTES`, sent straight from their memory while the sender goes on (:class:`Posted`), then an empty frame
at its end. A sender that fails in the middle of a file sends an error message instead
(:func:`~ignite_zero.transport.post_error`), which the receiver raises as :class:`~ignite_zero.transport.PeerError`.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ignite_zero.transport import post_error, post_frame, receive_frame

__all__ = ["CHUNK_BYTES", "END", "Movers", "Posted", "receive_parts"]

#: Bytes of one part of a file. Each rank holds one part per file it sends and up to three per file it receives (one
#: arriving, the others being written); larger messages gain little on gloo over TCP.
CHUNK_BYTES = 16 << 20

#: The frame that ends a file, or a sender's files in place of a name: an empty one.
END = torch.empty(0, dtype=torch.uint8)

# Bytes posted to the peers and not yet seen sent, beyond which a sender waits: what it keeps alive meanwhile.
_IN_FLIGHT_BYTES = 4 * CHUNK_BYTES


class _GivenUp:
    """Sends that their sender stopped waiting for (their peer stopped answering, or another send failed), with the
    tensors they read from, kept by the group they were posted on.

    Its one reason: gloo may still read a message's memory after the wait for it gave up, until the group's
    connections close, and the group outlives the sender that posted on it (torch keeps it until
    ``destroy_process_group``). The sends are kept as long as their group, and released with it.
    """

    def __init__(self) -> None:
        self._by_group: weakref.WeakKeyDictionary[ProcessGroup, list[Any]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()  # senders of several threads give up at once

    def keep(self, group: ProcessGroup | None, works: list[tuple[int, dist.Work]], data: Any) -> None:
        """Keep ``works``, posted on ``group`` (``None``: the default group), and the ``data`` they send."""
        owner = dist.group.WORLD if group is None else group
        assert owner is not None, "posted on a default group that no longer exists"
        with self._lock:
            self._by_group.setdefault(owner, []).append((works, data))


_GIVEN_UP = _GivenUp()


class Posted:
    """Frames posted to peers, sent in gloo's background while the poster goes on; the poster waits for the oldest
    while more than :data:`_IN_FLIGHT_BYTES` are in flight. A message that takes longer than ``timeout`` seconds
    fails the sender: nothing more is sent, and :attr:`failure` says why.

    Args:
        group: the gloo group of the peers.
        timeout: seconds one message may take.
        lost: the error of a message that took longer than ``timeout``, given its peer.
    """

    def __init__(self, group: ProcessGroup | None, timeout: float, lost: Callable[[int], BaseException]) -> None:
        self._group, self._timeout, self._lost = group, timeout, lost
        self._in_flight: deque[tuple[int, list[tuple[int, dist.Work]], Any]] = deque()  # bytes, works, what they send
        self._bytes = 0
        #: the first failure to send, if any
        self.failure: BaseException | None = None

    def post(self, data: torch.Tensor, peers: Sequence[int]) -> None:
        """Send ``data`` (a flat ``uint8`` CPU tensor, kept unchanged until sent) as one frame to each of
        ``peers``."""
        self._post(lambda peer: post_frame(data, peer, self._group), peers, data)

    def post_error(self, error: BaseException, peers: Sequence[int]) -> None:
        """Send ``error``'s message to each of ``peers`` in place of the rest of a file."""
        self._post(lambda peer: post_error(error, peer, self._group), peers, None)

    def drain(self) -> BaseException | None:
        """Wait for every frame posted; return the failure to send, if any."""
        while self._in_flight:
            self._complete_oldest()
        return self.failure

    def _post(self, post: Callable[[int], list[dist.Work]], peers: Sequence[int], data: Any) -> None:
        if self.failure is not None:
            return
        works: list[tuple[int, dist.Work]] = []
        try:
            for peer in peers:
                works += [(peer, work) for work in post(peer)]
        except Exception as error:
            self.failure = error
        size = 0 if data is None else data.numel()
        self._in_flight.append((size, works, data))
        self._bytes += size
        while self._bytes > _IN_FLIGHT_BYTES:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        size, works, data = self._in_flight.popleft()
        self._bytes -= size
        if self.failure is not None:  # a peer gone or stuck: no more waiting for it
            _GIVEN_UP.keep(self._group, works, data)
            return
        for peer, work in works:
            started = time.monotonic()
            try:
                work.wait(timedelta(seconds=self._timeout))
            except Exception as error:
                self.failure = error
                if time.monotonic() - started >= self._timeout:  # the peer gone quiet, or too slow
                    self.failure = self._lost(peer)
                    self.failure.__cause__ = error
                _GIVEN_UP.keep(self._group, works, data)
                return


def receive_parts(
    peer: int, group: ProcessGroup | None, buffer: Callable[[int], torch.Tensor], movers: Movers, what: str
) -> Iterator[torch.Tensor]:
    """The parts of the file that ``peer`` sends, each received into ``buffer(size)``, until its end; each frame
    watched by ``movers``.

    Raises:
        PeerError: the peer failed to send the file (its error message).
    """

    def fit(size: int) -> torch.Tensor:
        if size > CHUNK_BYTES:  # a larger receive would not fit: the order of messages was lost
            raise RuntimeError(f"Rank {peer} announced a part of {size} bytes: the replicas' messages lost their order")
        return buffer(size)

    while True:
        with movers.message():
            part = receive_frame(peer, group, what, fit)
        if not part.numel():
            return
        yield part


class Movers:
    """Threads that move files, each noting how long its message has been on the way: a message that takes longer
    than ``timeout`` seconds (a peer gone quiet, or too slow) fails its thread, and a wait for the threads gives up on
    one still blocked on it, which stays apart with its buffers.

    Args:
        timeout: seconds one message may take.
        lost: the error of a thread that gave up waiting, given its peer.
    """

    def __init__(self, timeout: float, lost: Callable[[int], BaseException]) -> None:
        self._timeout, self._lost = timeout, lost
        self._threads: list[tuple[threading.Thread, int]] = []
        self._since: dict[int, float] = {}  # by thread id: when its message set off
        self._peers: dict[int, int] = {}  # by thread id: the peer it moves files to or from
        #: what the threads raised, and the errors of those given up on
        self.failures: list[BaseException] = []

    def start(self, peer: int, work: Callable[..., None], *args: Any) -> None:
        """Run ``work(*args)``, which moves files to or from ``peer``, in a thread of its own."""

        def run() -> None:
            self._peers[threading.get_ident()] = peer
            try:
                work(*args)
            except Exception as error:
                self.failures.append(error)

        thread = threading.Thread(target=run, name=f"ignite_zero-replicas-{peer}", daemon=True)
        self._threads.append((thread, peer))
        thread.start()

    @contextlib.contextmanager
    def message(self) -> Iterator[None]:
        """In a mover's thread: a message on its way, for the duration of the block; one that took longer than the
        timeout fails the thread when it arrives, as a wait that gave up would have."""
        ident = threading.get_ident()
        self._since[ident] = time.monotonic()
        try:
            yield
        finally:
            since = self._since.pop(ident)
        if time.monotonic() - since > self._timeout:
            raise self._lost(self._peers[ident])

    def join(self) -> None:
        """Wait for every thread, giving up on those whose message takes too long (each a failure)."""
        for thread, peer in self._threads:
            while thread.is_alive():
                thread.join(min(1.0, self._timeout))
                since = self._since.get(thread.ident or 0)
                if thread.is_alive() and since is not None and time.monotonic() - since > self._timeout:
                    self.failures.append(self._lost(peer))
                    break
