"""Files sent to other hosts once written: each rank sends its files to the ranks that keep them, which write them
through their host's place, checked against the size and CRC-32 that the writer recorded."""

from __future__ import annotations

import mmap
import queue
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ignite_zero.storage.formats.base import IntegrityError, crc32, read_exactly
from ignite_zero.storage.places import Place
from ignite_zero.storage.replicas.frames import CHUNK_BYTES, END, Movers, Posted, receive_parts
from ignite_zero.storage.replicas.placement import ReplicaHosts
from ignite_zero.transport import PeerError

__all__ = ["Transfer", "check_arrived", "exchange"]

# Parts received and not yet written, per file: writing the previous part overlaps receiving the next.
_QUEUED_CHUNKS = 2


@dataclass(frozen=True)
class Transfer:
    """One file sent from one rank to another: its name, and the size and CRC-32 it must arrive with."""

    source: int
    target: int
    name: str
    size: int
    crc: int


def exchange(
    transfers: Sequence[Transfer],
    source: Place,
    target: Place,
    group: ProcessGroup | None,
    timeout: float,
    atomic: bool = False,
) -> None:
    """Collective among the ranks of ``transfers``: send the files this rank is the source of, read from
    ``source``, and write those it is the target of into ``target``, each checked against its size and CRC-32.

    Each rank sends to each of its targets in a thread of its own, file after file by name, and receives from each
    of its sources likewise, so no pair of ranks waits on each other. A file that cannot be read is sent as an error
    message, and its receiver fails its check instead of waiting.

    Args:
        transfers: every transfer of the exchange, the same list on every rank.
        source: where this rank reads the files it sends.
        target: where it writes the files it receives.
        group: a gloo group of the ranks; ``None`` for the default group.
        timeout: seconds to wait for one message.
        atomic: write each file under a temporary name first (into a directory that is already committed).

    Raises:
        IntegrityError: a file arrived with another size or CRC-32 than expected.
        OSError: a file could not be read or written here.
    """
    rank = dist.get_rank()
    movers = Movers(timeout, lambda peer: TimeoutError(f"Rank {peer} sent or took no file within {timeout} s"))
    unreadable: list[BaseException] = []
    written: list[BaseException] = []
    for peer in sorted({t.target for t in transfers if t.source == rank}):
        files = sorted((t.name, t.size) for t in transfers if t.source == rank and t.target == peer)
        movers.start(peer, _send_files, files, source, peer, group, timeout, unreadable)
    for peer in sorted({t.source for t in transfers if t.target == rank}):
        incoming = sorted((t for t in transfers if t.target == rank and t.source == peer), key=lambda t: t.name)
        movers.start(peer, _receive_files, incoming, target, atomic, group, movers, written)
    movers.join()
    errors = [*movers.failures, *unreadable, *written]
    if errors:
        raise errors[0]


def _send_files(
    files: Sequence[tuple[str, int]],
    place: Place,
    peer: int,
    group: ProcessGroup | None,
    timeout: float,
    unreadable: list[BaseException],
) -> None:
    """Send ``files`` (names and sizes) of ``place`` to ``peer``, each part posted while the next one is read; one
    that cannot be read as an error message."""
    posted = Posted(group, timeout, lambda peer: TimeoutError(f"Rank {peer} sent or took no file within {timeout} s"))
    for name, size in files:
        parts = _parts_of(place, name, size)
        while posted.failure is None:
            try:
                part = next(parts, None)
            except Exception as error:  # this file only: its receiver learns why, and the next one follows
                unreadable.append(error)
                posted.post_error(error, [peer])
                break
            posted.post(END if part is None else part, [peer])
            if part is None:
                break
    failure = posted.drain()
    if failure is not None:
        raise failure


def _receive_files(
    incoming: Sequence[Transfer],
    place: Place,
    atomic: bool,
    group: ProcessGroup | None,
    movers: Movers,
    written: list[BaseException],
) -> None:
    """Write the files of ``incoming``, all from one source and sorted by name, through ``place`` as they arrive."""
    writings = []
    try:
        for transfer in incoming:  # each file written while the next ones arrive
            writing = _Writing(place, transfer, atomic)
            writings.append(writing)
            try:
                for _ in receive_parts(transfer.source, group, writing.receive_into, movers, transfer.name):
                    writing.arrived()
            except PeerError:
                pass  # the sender could not read it: the file ends short, which its check names
            finally:
                writing.end()
    finally:
        for writing in writings:
            writing.join()
            if writing.error is not None:
                written.append(writing.error)


def _parts_of(place: Place, name: str, size: int) -> Iterator[torch.Tensor]:
    """The parts of the file ``name`` of ``place``, of ``size`` bytes: straight from its pages where the place maps
    files, else each read into a buffer of its own, since the parts before it may still travel."""
    with place.open(name) as file:
        if place.maps_files and size:
            mapped = _mapped(file, size)  # sent from the page cache: a copy of every byte fewer
            for begin in range(0, size, CHUNK_BYTES):
                yield mapped[begin : begin + CHUNK_BYTES]
            return
        for begin in range(0, size, CHUNK_BYTES):
            part = torch.empty(min(CHUNK_BYTES, size - begin), dtype=torch.uint8)  # its own: the last one may travel
            if not read_exactly(file, part.numpy().data):
                raise IntegrityError(f"{place.location(name)} ends before its {size} bytes")
            yield part


def _mapped(file: IO[bytes], size: int) -> torch.Tensor:
    """The ``size`` bytes of ``file``, mapped read-only, as a tensor that gloo sends from."""
    pages = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    if len(pages) != size:
        raise IntegrityError(f"{getattr(file, 'name', file)} has {len(pages)} bytes, {size} expected")
    with warnings.catch_warnings():  # only read: sends never write into it
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(pages, dtype=torch.uint8)


class _Writing:
    """A file being received: a thread writes its parts through the place while the next ones arrive, and checks
    its size and CRC-32 at the end; a failed write drains the chunks still to come."""

    def __init__(self, place: Place, transfer: Transfer, atomic: bool) -> None:
        self.transfer = transfer
        self.error: BaseException | None = None
        self._place, self._atomic = place, atomic
        self._receiving: tuple[torch.Tensor, torch.Tensor] | None = None  # the buffer being received into, and its part
        # (buffer, the part of it that holds a chunk)
        self._chunks: queue.Queue[tuple[torch.Tensor, torch.Tensor] | None] = queue.Queue()
        # buffers cycle between receiving and writing: one being received, the others queued or being written
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        for _ in range(_QUEUED_CHUNKS + 1):
            self._free.put(torch.empty(min(transfer.size, CHUNK_BYTES), dtype=torch.uint8))
        self._thread = threading.Thread(target=self._run, name="ignite_zero-replica", daemon=True)
        self._thread.start()

    def receive_into(self, size: int) -> torch.Tensor:
        """A buffer to receive the next part of ``size`` bytes into, once the writer is done with it."""
        buffer = self._free.get()
        if size > buffer.numel():  # a receive into a smaller buffer would not fit
            self._free.put(buffer)
            raise IntegrityError(f"A part of {size} bytes arrived for {self.transfer.name} of {self.transfer.size}")
        self._receiving = (buffer, buffer[:size])
        return self._receiving[1]

    def arrived(self) -> None:
        """Write the part received into the last buffer handed out."""
        if self._receiving is not None:
            self._chunks.put(self._receiving)
            self._receiving = None

    def end(self) -> None:
        """Let the writer end the file once it has written what arrived."""
        self._chunks.put(None)

    def join(self) -> None:
        """Wait for the writer to end the file."""
        self._thread.join()

    def _arriving(self) -> Iterator[torch.Tensor]:
        while (item := self._chunks.get()) is not None:
            buffer, chunk = item
            yield chunk
            self._free.put(buffer)

    def _run(self) -> None:
        expected = self.transfer
        sums = {"size": 0, "crc": 0}

        def dump(stream: IO[bytes]) -> None:
            for chunk in self._arriving():
                data = chunk.numpy().data
                stream.write(data)
                sums["crc"] = crc32(data, sums["crc"])
                sums["size"] += len(data)
            if (sums["size"], sums["crc"]) != (expected.size, expected.crc):
                raise IntegrityError(
                    f"{self._place.location(expected.name)} from rank {expected.source} arrived with {sums['size']} "
                    f"bytes and CRC-32 {sums['crc']:#010x}, {expected.size} bytes and {expected.crc:#010x} expected"
                )

        try:
            self._place.write(expected.name, dump, atomic=self._atomic)
        except Exception as error:
            self.error = error
            for _ in self._arriving():  # the sender goes on: take what it sends
                pass


def check_arrived(
    replica_hosts: ReplicaHosts,
    files: Mapping[int, Mapping[str, tuple[int, int]]],
    arrived: Mapping[int, Mapping[str, tuple[int, int]]],
    where: Any,
) -> None:
    """Check that every rank received each of its sources' ``files`` with the size and CRC-32 its writer recorded,
    from what each rank reports it received (``arrived``); the same verdict on every rank.

    Raises:
        IntegrityError: naming the copies that did not arrive whole.
    """
    wrong = [
        f"{name} of rank {source} on rank {target}"
        for source, written in files.items()
        for target in replica_hosts.partners(source)
        for name, record in written.items()
        if tuple(arrived[target].get(name, ())) != tuple(record)
    ]
    if wrong:
        raise IntegrityError(
            f"The copies of {where} on other hosts did not arrive whole: {', '.join(wrong)}. Nothing was sealed; "
            "earlier checkpoints are kept."
        )
