"""Files sent to other hosts as they are written: a rank's relay sends what it writes to its partners meanwhile, and
writes what its sources send into its own host's directory."""

from __future__ import annotations

import contextlib
import functools
import queue
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, cast

import numpy
import torch
from torch.distributed import ProcessGroup

from ignite_zero.storage.formats.base import crc32
from ignite_zero.storage.places import LocalPlace, Place
from ignite_zero.storage.replicas.frames import CHUNK_BYTES, END, Movers, receive_parts, send_end, send_part
from ignite_zero.transport import PeerError, receive_bytes, send_bytes, send_error

__all__ = ["Relay"]

# Writes smaller than this are gathered (copied) into one part: the zip records around each tensor's bytes. Larger
# writes of tensor memory are sent from where they lie, adjacent ones as one part (the writer hands them over in
# slices of 256 KiB).
_SMALL = 64 << 10
# Bytes a relay's sender has handed to its threads and not yet seen sent: what it keeps alive meanwhile.
_IN_FLIGHT_BYTES = 4 * CHUNK_BYTES

# A message for one partner, sent by its thread: what sends it to a peer over the relay's group, and its bytes.
_Frame = tuple[Callable[[int], None], int]


class Relay:
    """Replication as a rank writes: every file it writes through :attr:`place` goes to its partners on other hosts
    while it is written, and the files that its sources send are written into its own host's directory meanwhile,
    each as it arrives, durably, with its size and CRC-32 counted on the way.

    Collective among the ranks of a synchronous save (each one makes its relay, with its own partners and sources):
    each file is written and sent in one pass, its tensors' bytes sent from their own memory, instead of written, then
    mapped and sent (:func:`~ignite_zero.storage.replicas.exchange`) once every rank is done, so that across hosts the
    disk's write and the network's copy overlap rather than add up, and one agreement round fewer. The tensors must
    not change until :meth:`finish` returns, as in a synchronous save.

    Args:
        directory: this host's directory of the checkpoint being written.
        partners: the ranks that keep this rank's files.
        sources: the ranks whose files this rank keeps.
        group: a gloo group of the ranks for the relay alone: its messages travel while the writer's collectives run.
        timeout: seconds to wait for one message.
    """

    def __init__(
        self, directory: Place, partners: Sequence[int], sources: Sequence[int], group: ProcessGroup, timeout: float
    ) -> None:
        self.place = _Relayed(directory, self)
        self._group = group
        self._gathered = bytearray()
        self._run: tuple[torch.Tensor, int, int] | None = None  # adjacent tensor memory not sent yet: base, start, end
        self._senders = _Senders(partners, group, timeout)
        self._receivers = _Receivers(directory, sources, group, timeout)

    def relay(self, name: str, stream: IO[bytes], dump: Callable[[IO[bytes]], object]) -> None:
        """Run ``dump`` on ``stream``, the file ``name`` of :attr:`place`, sending what it writes to the partners."""
        group, header = self._group, name.encode()
        self._senders.post(functools.partial(send_bytes, header, group=group), 0)
        try:
            dump(cast(IO[bytes], _Tee(stream, self)))
        except BaseException as error:
            self._flush()
            self._senders.post(functools.partial(send_error, error, group=group), 0)
            raise
        self._flush()
        self._senders.post(functools.partial(send_end, group=group), 0)

    def finish(self) -> dict[str, tuple[int, int]]:
        """Tell the partners that no file follows, wait for every message sent and every file received; return the
        size and CRC-32 of each file received, as it arrived.

        Raises:
            the first failure to send, to receive or to write a file received.
        """
        group = self._group
        self._senders.post(functools.partial(send_bytes, END, group=group), 0)  # in place of a name: no file follows
        failures = [*self._senders.close(), *self._receivers.join()]
        if failures:
            raise failures[0]
        return dict(self._receivers.received)

    def write(self, data: Any) -> None:
        """Send ``data``, bytes that the file being written got, after those before it."""
        if self._senders.failed:  # a partner that cannot be reached: reported at the end
            return
        view = memoryview(data).cast("B")
        memory = _tensor_memory(view) if view.nbytes >= _SMALL else None
        if memory is None:
            self._send_run()
            self._gathered += view
            if len(self._gathered) >= _SMALL:
                self._send_gathered()
            return
        self._send_gathered()
        base, start = memory
        run = self._run
        if run is not None and run[0].data_ptr() == base.data_ptr() and run[2] == start:
            self._run = (base, run[1], start + view.nbytes)
        else:
            self._send_run()
            self._run = (base, start, start + view.nbytes)
        if self._run[2] - self._run[1] >= CHUNK_BYTES:
            self._send_run()

    def _flush(self) -> None:
        self._send_gathered()
        self._send_run()

    def _send_gathered(self) -> None:
        if self._gathered:
            self._send_parts(torch.frombuffer(self._gathered, dtype=torch.uint8))
            self._gathered = bytearray()

    def _send_run(self) -> None:
        if self._run is not None:
            base, start, end = self._run
            self._run = None
            self._send_parts(base[start:end])

    def _send_parts(self, data: torch.Tensor) -> None:
        group = self._group
        for begin in range(0, data.numel(), CHUNK_BYTES):  # no part larger than the receiver's buffer
            part = data[begin : begin + CHUNK_BYTES]
            self._senders.post(functools.partial(send_part, part, group=group), part.numel())


class _Senders:
    """A thread per partner that sends it, in order, the messages posted for every partner; the poster waits while
    more than :data:`_IN_FLIGHT_BYTES` are posted to one partner and not yet sent."""

    def __init__(self, partners: Sequence[int], group: ProcessGroup, timeout: float) -> None:
        self._timeout = timeout
        self._movers = Movers(timeout, lambda peer: TimeoutError(f"Rank {peer} took no file within {timeout} s"))
        self._queues: dict[int, queue.Queue[_Frame | None]] = {partner: queue.Queue() for partner in partners}
        self._posted = dict.fromkeys(partners, 0)  # bytes posted to each partner and not yet sent
        self._room = threading.Condition()
        self._failure: BaseException | None = None
        for partner in partners:
            self._movers.start(partner, self._send, partner)

    @property
    def failed(self) -> bool:
        """Whether sending failed (a partner gone or stuck): nothing more is sent."""
        return self._failure is not None or self._check()

    def post(self, send: Callable[[int], None], size: int) -> None:
        """Have ``send`` run for every partner, once fewer than :data:`_IN_FLIGHT_BYTES` wait for each."""
        if self.failed:
            return
        with self._room:
            for partner, waiting in self._queues.items():
                waiting.put((send, size))
                self._posted[partner] += size
            while self._posted and max(self._posted.values()) > _IN_FLIGHT_BYTES and not self._check():
                self._room.wait(min(1.0, self._timeout))

    def close(self) -> list[BaseException]:
        """Let every thread end once it has sent what was posted; return the failure to send, if any."""
        for waiting in self._queues.values():
            waiting.put(None)
        self._movers.join()
        self._check()
        return [] if self._failure is None else [self._failure]

    def _send(self, partner: int) -> None:
        while (frame := self._queues[partner].get()) is not None:
            send, size = frame
            with self._movers.message():
                send(partner)
            with self._room:
                self._posted[partner] -= size
                self._room.notify_all()

    def _check(self) -> bool:
        """Whether sending failed, noting the failure the first time."""
        if self._failure is None and self._movers.failures:
            self._failure = self._movers.failures[0]
        elif self._failure is None and self._movers.stalled():
            self._failure = TimeoutError(f"A partner took no message of the relay within {self._timeout} s")
        return self._failure is not None


class _Receivers:
    """A thread per source that writes the files it sends into this host's directory, until it sends no more; a
    write that fails takes in the rest of its file, so that the sender goes on."""

    def __init__(self, directory: Place, sources: Sequence[int], group: ProcessGroup, timeout: float) -> None:
        self._directory, self._group = directory, group
        self._movers = Movers(
            timeout,
            lambda peer: _Unreachable(f"Lost rank {peer} while it sent its files: no message within {timeout} s"),
        )
        #: the size and CRC-32 of each file received, as it arrived
        self.received: dict[str, tuple[int, int]] = {}
        self._failures: list[BaseException] = []  # to write what arrived
        for source in sources:
            self._movers.start(source, self._receive, source)

    def join(self) -> list[BaseException]:
        """Wait for every file; return the failures to receive or to write one."""
        self._movers.join()
        return [*self._failures, *self._movers.failures]

    def _receive(self, source: int) -> None:
        buffer = torch.empty(CHUNK_BYTES, dtype=torch.uint8)
        while name := self._next_name(source):
            sums = [0, 0, 0]  # size, CRC-32, whether the file's end arrived

            def dump(stream: IO[bytes], sums: list[int] = sums) -> None:
                for part in self._parts(source, buffer):
                    data = part.numpy().data
                    stream.write(data)
                    sums[1] = crc32(data, sums[1])
                    sums[0] += part.numel()
                sums[2] = 1

            try:
                self._directory.write(name, dump, atomic=False)
            except PeerError:
                continue  # the sender failed to write it, and reports why
            except _Unreachable:
                raise
            except Exception as error:  # this host's write: the rest of the file is taken in, the sender goes on
                self._failures.append(error)
                if not sums[2]:  # else it failed once the file had arrived (its flush, say): nothing to take in
                    with contextlib.suppress(PeerError):
                        for _ in self._parts(source, buffer):
                            pass
                continue
            self.received[name] = (sums[0], sums[1])

    def _next_name(self, source: int) -> str:
        """The name of the next file ``source`` sends; empty when it sends no more."""
        try:
            with self._movers.message():
                header = receive_bytes(source, self._group, "its files")
            return "" if header == END else header.decode()
        except _Unreachable:
            raise
        except Exception as error:
            raise _Unreachable(f"Lost rank {source} while it sent its files: {error}") from error

    def _parts(self, source: int, buffer: torch.Tensor) -> Iterator[torch.Tensor]:
        try:
            yield from receive_parts(source, self._group, lambda size: buffer[:size], self._movers, "its files")
        except (PeerError, _Unreachable):
            raise
        except Exception as error:
            raise _Unreachable(f"Lost rank {source} while it sent its files: {error}") from error


def _tensor_memory(view: memoryview) -> tuple[torch.Tensor, int] | None:
    """Where ``view`` lies in the flat array it was taken from (the bytes of a tensor, as the writer hands them
    over): that array as a tensor, and the offset; ``None`` for other bytes."""
    array = view.obj
    if not isinstance(array, numpy.ndarray) or array.ndim != 1 or array.dtype != numpy.uint8:
        return None
    if not array.flags.c_contiguous:
        return None
    base = torch.from_numpy(array)
    with warnings.catch_warnings():  # only read: sends never write into it
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        start = torch.frombuffer(view, dtype=torch.uint8).data_ptr() - base.data_ptr()
    return base, start


class _Unreachable(RuntimeError):
    """A rank that sends files stopped sending (gone, or too slow)."""


class _Tee:
    """A file's stream that also hands everything written to it to a relay."""

    def __init__(self, stream: IO[bytes], relay: Relay) -> None:
        self._stream, self._relay = stream, relay

    def write(self, data: Any) -> int:
        written = self._stream.write(data)
        self._relay.write(data)
        return written

    def __getattr__(self, name: str) -> Any:  # flush, fileno...: the file's own
        return getattr(self._stream, name)


class _Relayed(LocalPlace):
    """A checkpoint directory whose files, as they are written, are relayed to other hosts."""

    def __init__(self, directory: Place, relay: Relay) -> None:
        super().__init__(Path(directory.location()))
        self._relay = relay

    def write(self, name: str, dump: Callable[[IO[bytes]], object], atomic: bool = True) -> None:
        super().write(name, lambda stream: self._relay.relay(name, stream, dump), atomic)
