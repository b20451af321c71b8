"""Files sent to other hosts as they are written: a rank's relay sends what it writes to its partners meanwhile, and
writes what its sources send into its own host's directory."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, cast

import numpy
import torch
from torch.distributed import ProcessGroup

from ignite_zero.storage.formats.base import crc32
from ignite_zero.storage.places import LocalPlace, Place
from ignite_zero.storage.replicas.frames import CHUNK_BYTES, END, Movers, Posted, receive_parts
from ignite_zero.transport import PeerError, receive_bytes

__all__ = ["Relay"]

# Writes smaller than this are gathered (copied) into one part: the zip records around each tensor's bytes. Larger
# writes of tensor memory are sent from where they lie, adjacent ones as one part (the writer hands them over in
# slices of 256 KiB).
_SMALL = 64 << 10


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
        self._partners = list(partners)
        self._gathered = bytearray()
        self._run: tuple[torch.Tensor, int, int] | None = None  # adjacent tensor memory not sent yet: base, start, end
        self._posted = Posted(group, timeout, lambda peer: TimeoutError(f"Rank {peer} took no file within {timeout} s"))
        self._receivers = _Receivers(directory, sources, group, timeout)

    def relay(self, name: str, stream: IO[bytes], dump: Callable[[IO[bytes]], object]) -> None:
        """Run ``dump`` on ``stream``, the file ``name`` of :attr:`place`, sending what it writes to the partners."""
        self._posted.post(torch.frombuffer(bytearray(name.encode()), dtype=torch.uint8), self._partners)
        try:
            dump(cast(IO[bytes], _Tee(stream, self)))
        except BaseException as error:
            self._flush()
            self._posted.post_error(error, self._partners)
            raise
        self._flush()
        self._posted.post(END, self._partners)

    def finish(self) -> dict[str, tuple[int, int]]:
        """Tell the partners that no file follows, wait for every message sent and every file received; return the
        size and CRC-32 of each file received, as it arrived.

        Raises:
            the first failure to send, to receive or to write a file received.
        """
        self._posted.post(END, self._partners)  # in place of a name: no file follows
        sent = self._posted.drain()
        failures = [*([] if sent is None else [sent]), *self._receivers.join()]
        if failures:
            raise failures[0]
        return dict(self._receivers.received)

    def write(self, data: Any) -> None:
        """Send ``data``, bytes that the file being written got, after those before it."""
        if self._posted.failure is not None:  # a partner that cannot be reached: reported at the end
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
        for begin in range(0, data.numel(), CHUNK_BYTES):  # no part larger than the receiver's buffer
            self._posted.post(data[begin : begin + CHUNK_BYTES], self._partners)


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
                return receive_bytes(source, self._group, "its files").decode()
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
