"""How the parts of a replica file travel over the transport's wire, and the threads that move them, watched so that a
peer that stops answering fails the move within its timeout.

A file goes to a peer as parts of at most :data:`CHUNK_BYTES`, each a header (its size, framed as
:func:`~ignite_zero.transport.send_bytes` frames bytes) and a stream of its bytes
(:func:`~ignite_zero.transport.send_stream`: large parts straight from their memory), then :data:`END` at its end.
A sender that fails in the middle of a file sends :func:`~ignite_zero.transport.send_error` instead, which the
receiver raises as :class:`~ignite_zero.transport.PeerError`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed import ProcessGroup

from ignite_zero.transport import StreamReceiver, receive_all, receive_bytes, send_bytes, send_stream

__all__ = ["CHUNK_BYTES", "END", "Movers", "receive_parts", "send_end", "send_part"]

#: Bytes of one part of a file. Each rank holds one part per file it sends and up to three per file it receives (one
#: arriving, the others being written); 16 MiB is where gloo over TCP stops gaining from larger messages.
CHUNK_BYTES = 16 << 20

#: The header that ends a file, or a relay's files in place of a name (the wire frames no empty message, and no file
#: name nor size header is one zero byte).
END = b"\x00"


def send_part(part: torch.Tensor, peer: int, group: ProcessGroup | None) -> None:
    """Send ``part``, at most :data:`CHUNK_BYTES` bytes of a file (a flat ``uint8`` tensor), to ``peer``."""
    send_bytes(part.numel().to_bytes(8, "little"), peer, group)
    send_stream([part], peer, group, CHUNK_BYTES)


def send_end(peer: int, group: ProcessGroup | None) -> None:
    """Tell ``peer`` that the file being sent ends here."""
    send_bytes(END, peer, group)


def receive_parts(
    peer: int, group: ProcessGroup | None, buffer: Callable[[int], torch.Tensor], movers: Movers, what: str
) -> Iterator[torch.Tensor]:
    """The parts of the file that ``peer`` sends, each received into ``buffer(size)``, until its end; each message
    watched by ``movers``.

    Raises:
        PeerError: the peer failed to send the file (its error message).
    """
    while True:
        with movers.message():
            header = receive_bytes(peer, group, what)
        if header == END:
            return
        size = int.from_bytes(header, "little")
        if size > CHUNK_BYTES:  # a larger receive would not fit: the order of messages was lost
            raise RuntimeError(f"Rank {peer} announced a part of {size} bytes: the replicas' messages lost their order")
        part = buffer(size)
        with movers.message():
            receive_all([StreamReceiver(peer, [part], CHUNK_BYTES)], group)
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

    def stalled(self) -> bool:
        """Whether a message has taken longer than the timeout."""
        now = time.monotonic()
        return any(now - since > self._timeout for since in list(self._since.values()))

    def join(self) -> None:
        """Wait for every thread, giving up on those whose message takes too long (each a failure)."""
        for thread, peer in self._threads:
            while thread.is_alive():
                thread.join(min(1.0, self._timeout))
                since = self._since.get(thread.ident or 0)
                if thread.is_alive() and since is not None and time.monotonic() - since > self._timeout:
                    self.failures.append(self._lost(peer))
                    break
