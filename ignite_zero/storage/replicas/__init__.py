"""Sharded checkpoints on node-local disks, kept on several hosts: who keeps whose files, and moving files between
hosts over the process group.

A replicated :class:`~ignite_zero.ShardedSaver` (``replicas=k``) writes into a directory that has the same path on
every host and different contents on each (a local NVMe under ``/local``, say). Each rank writes its files on its own
host, and :func:`exchange` sends them to ``k`` ranks on ``k`` other hosts (:class:`Layout`: partners chosen by host
name), which write them on theirs; every host's directory is then sealed with the same manifest. Before a load,
:func:`repair` completes each host's copy of a checkpoint from the hosts that hold its files, whatever the format
reads of them, :func:`survival` tells :func:`~ignite_zero.find_latest` which of its files verify on a host, and
:func:`holding` tells ``ignite-zero verify`` what one host's directory holds and which files live elsewhere.

Files travel as raw bytes in chunks of :data:`CHUNK_BYTES`, checked on arrival against the size and CRC-32 that the
writer recorded, and written through the :class:`~ignite_zero.storage.places.Place` of the receiving host.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import queue
import socket
import threading
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import IO, Any, cast

import numpy
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ignite_zero.agreement import rank_and_world, settle
from ignite_zero.storage.formats.base import IntegrityError, crc32
from ignite_zero.storage.formats.directory import MANIFEST, file_crc, read_manifest
from ignite_zero.storage.places import LocalPlace, Place, split
from ignite_zero.transport.groups import cpu_group

__all__ = [
    "CHUNK_BYTES",
    "Holding",
    "Layout",
    "Relay",
    "Survival",
    "Transfer",
    "check_arrived",
    "complete",
    "exchange",
    "holding",
    "layout_of",
    "manifest_facts",
    "survival",
]

logger = logging.getLogger(__name__)

#: Bytes of one message of a file. Each rank holds one chunk per file it sends and two per file it receives (one
#: arriving, one being written); 16 MiB is where gloo over TCP stops gaining from larger messages (see transport).
CHUNK_BYTES = 16 << 20
# Chunks received and not yet written, per file: writing the previous chunk overlaps receiving the next.
_QUEUED_CHUNKS = 2


@dataclass(frozen=True)
class Layout:
    """The hosts of the ranks of a save, and the ranks on other hosts that keep each rank's files.

    Attributes:
        members: the ranks of the save, sorted.
        hosts: the host name of each member, in the same order.
        replicas: copies of each rank's files on other hosts (0 on a single host).
    """

    members: tuple[int, ...]
    hosts: tuple[str, ...]
    replicas: int

    @property
    def host_names(self) -> list[str]:
        """The hosts, sorted by name: the ring along which files are replicated."""
        return sorted(set(self.hosts))

    def host_of(self, rank: int) -> str:
        return self.hosts[self.members.index(rank)]

    def ranks_on(self, host: str) -> list[int]:
        return [rank for rank, name in zip(self.members, self.hosts) if name == host]

    def leader(self, rank: int) -> int:
        """The rank that prepares, seals and removes the directory of ``rank``'s host: its host's first."""
        return self.ranks_on(self.host_of(rank))[0]

    def partners(self, rank: int) -> list[int]:
        """The ranks that keep ``rank``'s files: on each of the next ``replicas`` hosts by name, the rank at the same
        position among its host's ranks."""
        names = self.host_names
        host = self.host_of(rank)
        position = self.ranks_on(host).index(rank)
        start = names.index(host)
        return [self.ranks_on(names[(start + step) % len(names)])[position] for step in range(1, self.replicas + 1)]

    def kept_on(self, host: str) -> list[int]:
        """The ranks whose files ``host``'s directory holds: its own, and those it keeps replicas of."""
        return [rank for rank in self.members if self.host_of(rank) == host or self._partner_on(rank, host)]

    def _partner_on(self, rank: int, host: str) -> bool:
        return any(self.host_of(partner) == host for partner in self.partners(rank))


def layout_of(members: Sequence[int], hosts: Sequence[str], replicas: int, dirname: Any) -> Layout:
    """The layout of a save of ``replicas`` copies by ranks ``members`` on ``hosts``; the same on every rank, and so
    are its errors.

    Raises:
        ValueError: ``replicas`` not below the number of hosts, or hosts with different numbers of ranks.
    """
    names = sorted(set(hosts))
    if len(names) == 1:
        warnings.warn(
            f"ShardedSaver({str(dirname)!r}, replicas={replicas}): every rank runs on one host ({names[0]}), so each "
            "checkpoint is kept once, on its disk. Replicas need ranks on several hosts.",
            stacklevel=4,
        )
        return Layout(tuple(members), tuple(hosts), 0)
    if replicas >= len(names):
        raise ValueError(
            f"ShardedSaver(replicas={replicas}) keeps every rank's files on {replicas} hosts besides its own, but the "
            f"job runs on {len(names)} hosts ({', '.join(names)}). Pass `replicas` of at most {len(names) - 1}."
        )
    counts = {name: hosts.count(name) for name in names}
    if len(set(counts.values())) > 1:
        listing = ", ".join(f"{name}: {count}" for name, count in counts.items())
        raise ValueError(
            f"Hosts run different numbers of ranks ({listing}), and a replicated ShardedSaver pairs each rank with the "
            "rank at the same position on other hosts. Run as many ranks on every host, or save to a directory that "
            "every rank shares with `replicas=0`."
        )
    return Layout(tuple(members), tuple(hosts), replicas)


def manifest_facts(layout: Layout, files: Mapping[int, Iterable[str]]) -> dict[str, Any]:
    """What a replicated checkpoint's manifest says of its copies, given the ``files`` of each rank: how many, on
    which hosts, and which hosts keep each file (so that one host's directory tells what lives elsewhere). Their
    presence marks the checkpoint replicated."""
    keepers = {
        name: [layout.host_of(rank), *(layout.host_of(partner) for partner in layout.partners(rank))]
        for rank, names in files.items()
        for name in names
    }
    return {"replicas": layout.replicas, "hosts": layout.host_names, "keepers": dict(sorted(keepers.items()))}


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

    Every rank steps through the chunks of its own transfers in the same order, posting all of one step's sends and
    receives before waiting for any, so no pair of ranks waits on each other; a rank whose transfers end early
    leaves. A file that cannot be read is sent as zeros, so that its receiver fails its check instead of waiting.

    Args:
        transfers: every transfer of the exchange, the same list on every rank.
        source: where this rank reads the files it sends.
        target: where it writes the files it receives.
        group: a gloo group of the ranks; ``None`` for the default group.
        timeout: seconds to wait for one step's messages.
        atomic: write each file under a temporary name first (into a directory that is already committed).

    Raises:
        IntegrityError: a file arrived with another size or CRC-32 than expected.
        OSError: a file could not be read or written here.
    """
    rank = dist.get_rank()
    outgoing = sorted({(t.name, t.size) for t in transfers if t.source == rank})
    incoming = sorted((t for t in transfers if t.target == rank), key=lambda t: (t.source, t.name))
    targets = {name: sorted(t.target for t in transfers if t.source == rank and t.name == name) for name, _ in outgoing}
    readers = {name: _Reading(source, name, size) for name, size in outgoing}
    writers = [_Writing(target, transfer, atomic) for transfer in incoming]
    steps = max((_chunks(size) for _, size in outgoing), default=0)
    steps = max([steps, *(_chunks(t.size) for t in incoming)])
    wait = timedelta(seconds=timeout)
    try:
        for step in range(steps):
            works = []
            for name, size in outgoing:
                if step < _chunks(size):
                    chunk = readers[name].chunk(step)
                    works += [dist.isend(chunk, peer, group) for peer in targets[name]]
            arrived = []
            for writer in writers:
                if step < _chunks(writer.transfer.size):
                    buffer = writer.free_buffer(_chunk_size(writer.transfer.size, step))
                    works.append(dist.irecv(buffer[1], writer.transfer.source, group))
                    arrived.append((writer, buffer))
            for reading in readers.values():  # the next chunk is read (if it is read) while this one travels
                reading.chunk(step + 1)
            for work in works:
                if work is not None:  # None: not in the group, which a transfer's ranks always are
                    work.wait(wait)
            for writer, buffer in arrived:
                writer.put(buffer)
    finally:
        for writer in writers:
            writer.finish()
        for reading in readers.values():
            reading.close()
    errors = [reading.error for reading in readers.values() if reading.error is not None]
    errors += [writer.error for writer in writers if writer.error is not None]
    if errors:
        raise errors[0]


def _chunks(size: int) -> int:
    return -(-size // CHUNK_BYTES)


def _chunk_size(size: int, step: int) -> int:
    return min(CHUNK_BYTES, size - step * CHUNK_BYTES)


class _Reading:
    """A file being sent, chunk by chunk: straight from its pages where the place maps files, else each chunk read
    while the one before travels; zeros in place of what cannot be read."""

    def __init__(self, place: Place, name: str, size: int) -> None:
        self.place, self.name, self.size = place, name, size
        self.error: BaseException | None = None
        self._file: IO[bytes] | None = None
        self._mapped: torch.Tensor | None = None
        # else two buffers, reused: one travels while the next chunk is read into the other (a fresh 16 MiB buffer
        # would cost its page faults every time)
        self._buffers: list[torch.Tensor] = []
        self._read = -1  # the last chunk read
        try:
            self._file = place.open(name)
            if place.maps_files and size:
                self._mapped = _mapped(self._file, size)
        except Exception as error:
            self.error = error
        if self._mapped is None:
            self._buffers = [torch.empty(min(size, CHUNK_BYTES), dtype=torch.uint8) for _ in range(2)]

    def chunk(self, step: int) -> torch.Tensor:
        """The chunk ``step`` (read now unless it was read ahead); the one before it must have been sent."""
        if step >= _chunks(self.size):
            return torch.empty(0, dtype=torch.uint8)
        if self._mapped is not None:  # sent from the page cache: a copy of every byte fewer (0.11 s of 0.53 s)
            return self._mapped[step * CHUNK_BYTES : step * CHUNK_BYTES + _chunk_size(self.size, step)]
        buffer = self._buffers[step % 2][: _chunk_size(self.size, step)]
        if step == self._read:
            return buffer
        self._read = step
        if self._file is None or self.error is not None:
            return buffer.zero_()
        try:
            view = buffer.numpy().data
            done = 0
            while done < len(view):
                read = self._file.readinto(view[done:])  # type: ignore[attr-defined]
                if not read:
                    raise IntegrityError(f"{self.place.location(self.name)} ends before its {self.size} bytes")
                done += read
        except Exception as error:
            self.error = error
            buffer.zero_()
        return buffer

    def close(self) -> None:
        self._mapped = None
        if self._file is not None:
            self._file.close()


def _mapped(file: IO[bytes], size: int) -> torch.Tensor:
    """The ``size`` bytes of ``file``, mapped read-only, as a tensor that gloo sends from."""
    pages = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    if len(pages) != size:
        raise IntegrityError(f"{getattr(file, 'name', file)} has {len(pages)} bytes, {size} expected")
    with warnings.catch_warnings():  # only read: sends never write into it
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(pages, dtype=torch.uint8)


class _Writing:
    """A file being received: a thread writes its chunks through the place while the next ones arrive, and checks
    its size and CRC-32 at the end; a failed write drains the chunks still to come."""

    def __init__(self, place: Place, transfer: Transfer, atomic: bool) -> None:
        self.transfer = transfer
        self.error: BaseException | None = None
        self._place, self._atomic = place, atomic
        # (buffer, the part of it that holds a chunk)
        self._chunks: queue.Queue[tuple[torch.Tensor, torch.Tensor] | None] = queue.Queue()
        # buffers cycle between receiving and writing: one being received, the others queued or being written
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        for _ in range(_QUEUED_CHUNKS + 1):
            self._free.put(torch.empty(min(transfer.size, CHUNK_BYTES), dtype=torch.uint8))
        self._thread = threading.Thread(target=self._run, name="ignite_zero-replica", daemon=True)
        self._thread.start()

    def free_buffer(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A buffer to receive the next chunk of ``size`` bytes into, once the writer is done with it; and the part
        of it that the chunk fills."""
        buffer = self._free.get()
        return buffer, buffer[:size]

    def put(self, chunk: tuple[torch.Tensor, torch.Tensor]) -> None:
        self._chunks.put(chunk)

    def finish(self) -> None:
        self._chunks.put(None)
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
    layout: Layout,
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
        for target in layout.partners(source)
        for name, record in written.items()
        if tuple(arrived[target].get(name, ())) != tuple(record)
    ]
    if wrong:
        raise IntegrityError(
            f"The copies of {where} on other hosts did not arrive whole: {', '.join(wrong)}. Nothing was sealed; "
            "earlier checkpoints are kept."
        )


# What relays handed to the process group for a rank that stopped answering, kept alive for good: a message still in
# flight reads from (or writes into) its tensor after the wait for it gave up.
_abandoned: list[list[Any]] = []

# The messages of a relay, each a header (its kind, and the bytes that follow) and those bytes: a file begins (its name
# follows), a part of it, its end, its writing failed on the sender, no more files.
_BEGIN, _PART, _END, _FAILED, _CLOSED = range(5)
# Writes smaller than this are gathered (copied) into one part: the zip records around each tensor's bytes. Larger
# writes of tensor memory are sent from where they lie, adjacent ones as one part (the writer hands them over in
# slices of 256 KiB).
_SMALL = 64 << 10
# Bytes a relay's sender has handed to the process group and not yet seen arrive: what it keeps alive meanwhile.
_IN_FLIGHT_BYTES = 4 * CHUNK_BYTES


class Relay:
    """Replication as a rank writes: every file it writes through :attr:`place` goes to its partners on other hosts
    while it is written, and the files that its sources send are written into its own host's directory meanwhile,
    each as it arrives, durably, with its size and CRC-32 counted on the way.

    Collective among the ranks of a synchronous save (each one makes its relay, with its own partners and sources):
    each file is written and sent in one pass, its tensors' bytes sent from their own memory, instead of written, then
    mapped and sent (:func:`exchange`) once every rank is done, so that across hosts the disk's write and the
    network's copy overlap rather than add up, and one agreement round fewer. Where both simulated hosts of
    ``benchmarks/replicas.py`` share 2 cores, the copies are bound by the CPU (0.3 CPU-seconds a rank, against 0.1
    for an unreplicated save), and either way costs 2.8x an unreplicated save. The tensors must not change until
    :meth:`finish` returns, as in a synchronous save.

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
        self._directory, self._partners, self._group = directory, list(partners), group
        self._wait = timedelta(seconds=timeout)
        self._gathered = bytearray()
        self._run: tuple[torch.Tensor, int, int] | None = None  # adjacent tensor memory not sent yet: base, start, end
        self._in_flight: list[tuple[int, list[Any]]] = []  # bytes, and the works and tensors of each message
        self._sent_failure: BaseException | None = None
        self._received: dict[str, tuple[int, int]] = {}
        self._failures: list[BaseException] = []
        self._threads = [
            threading.Thread(target=self._receive, args=(source,), name="ignite_zero-relay", daemon=True)
            for source in sources
        ]
        for thread in self._threads:
            thread.start()

    def relay(self, name: str, stream: IO[bytes], dump: Callable[[IO[bytes]], object]) -> None:
        """Run ``dump`` on ``stream``, the file ``name`` of :attr:`place`, sending what it writes to the partners."""
        self._send(_BEGIN, torch.frombuffer(bytearray(name.encode()), dtype=torch.uint8))
        try:
            dump(cast(IO[bytes], _Tee(stream, self)))
        except BaseException:
            self._flush()
            self._send(_FAILED)
            raise
        self._flush()
        self._send(_END)

    def finish(self) -> dict[str, tuple[int, int]]:
        """Tell the partners that no file follows, wait for every message sent and every file received; return the
        size and CRC-32 of each file received, as it arrived.

        Raises:
            the first failure to send, to receive or to write a file received.
        """
        self._send(_CLOSED)
        while self._in_flight:
            self._complete_oldest()
        for thread in self._threads:
            thread.join()
        if self._failures:
            raise self._failures[0]
        return dict(self._received)

    def write(self, data: Any) -> None:
        """Send ``data``, bytes that the file being written got, after those before it."""
        if self._sent_failure is not None:  # a partner that cannot be reached: reported at the end
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
            self._send(_PART, data[begin : begin + CHUNK_BYTES])

    def _send(self, kind: int, payload: torch.Tensor | None = None) -> None:
        """Send a message to every partner, once fewer than :data:`_IN_FLIGHT_BYTES` are still travelling."""
        header = torch.tensor([kind, 0 if payload is None else payload.numel()], dtype=torch.int64)
        works: list[Any] = []
        if self._sent_failure is None:
            try:
                for partner in self._partners:
                    works.append(dist.isend(header, partner, self._group))
                    if payload is not None:
                        works.append(dist.isend(payload, partner, self._group))
            except Exception as error:
                self._fail_to_send(error)
        # the tensors are kept until their messages arrived
        self._in_flight.append((0 if payload is None else payload.numel(), [*works, header, payload]))
        while sum(size for size, _ in self._in_flight) > _IN_FLIGHT_BYTES:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        _, pending = self._in_flight.pop(0)
        if self._sent_failure is not None:  # a partner gone or stuck: no more waiting for it
            _abandoned.append(pending)
            return
        try:
            for work in pending:
                if isinstance(work, dist.Work):
                    work.wait(self._wait)
        except Exception as error:
            self._fail_to_send(error)
            _abandoned.append(pending)

    def _fail_to_send(self, error: BaseException) -> None:
        """Stop sending: the file is written here all the same, and the failure reported at the end."""
        if self._sent_failure is None:
            self._sent_failure = error
            self._failures.append(error)

    def _receive(self, source: int) -> None:
        """Write the files that ``source`` sends, until it sends no more; a write that fails takes in the rest of its
        file, so that the sender goes on."""
        buffer = torch.empty(CHUNK_BYTES, dtype=torch.uint8)
        try:
            while True:
                kind, size = self._header(source)
                if kind == _CLOSED:
                    return
                name = bytes(self._payload(source, buffer, size).numpy()).decode()
                sums = [0, 0, 0]  # size, CRC-32, whether the file's end arrived

                def dump(stream: IO[bytes], sums: list[int] = sums) -> None:
                    for part in self._parts(source, buffer):
                        stream.write(part)
                        sums[1] = crc32(part, sums[1])
                        sums[0] += part.nbytes
                    sums[2] = 1

                try:
                    self._directory.write(name, dump, atomic=False)
                except _SenderFailed:
                    continue  # the sender reports why
                except _Unreachable:
                    raise
                except Exception as error:  # this host's write: the rest of the file is taken in, the sender goes on
                    self._failures.append(error)
                    if not sums[2]:  # else it failed once the file had arrived (its flush, say): nothing to take in
                        with contextlib.suppress(_SenderFailed):
                            for _ in self._parts(source, buffer):
                                pass
                    continue
                self._received[name] = (sums[0], sums[1])
        except Exception as error:
            self._failures.append(error)
            _abandoned.append([buffer])

    def _parts(self, source: int, buffer: torch.Tensor) -> Iterator[memoryview]:
        while True:
            kind, size = self._header(source)
            if kind == _END:
                return
            if kind == _FAILED:
                raise _SenderFailed
            if kind != _PART:
                raise _Unreachable(
                    f"Rank {source} sent a message of kind {kind} inside a file: the relay lost its order"
                )
            yield self._payload(source, buffer, size).numpy().data

    def _header(self, source: int) -> tuple[int, int]:
        header = torch.empty(2, dtype=torch.int64)
        self._arrive(header, source)
        kind, size = header.tolist()
        return kind, size

    def _payload(self, source: int, buffer: torch.Tensor, size: int) -> torch.Tensor:
        payload = buffer[:size]
        self._arrive(payload, source)
        return payload

    def _arrive(self, tensor: torch.Tensor, source: int) -> None:
        try:
            work = dist.irecv(tensor, source, self._group)
            if work is not None:  # None: not in the group, which a relay's ranks always are
                work.wait(self._wait)
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


class _SenderFailed(Exception):
    """The sender of a file failed to write it (it reports why)."""


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


@dataclass(frozen=True)
class Survival:
    """What one host holds of a replicated checkpoint: its manifest's checksum (the checkpoint's identity), the
    files the manifest lists, and those present here with their listed size and CRC-32."""

    identity: int
    files: dict[str, tuple[int, int]]
    good: frozenset[str]


def survival(place: Place, name: str, verify: bool = True) -> Survival | None:
    """What this host holds of the checkpoint ``name`` of ``place``, if it is a replicated one: every file present
    checked against the manifest (sizes only, when not ``verify``); ``None`` when ``name`` is no replicated
    checkpoint here (absent, uncommitted, or not replicated)."""
    found = _replicated(place, name)
    if found is None:
        return None
    directory, manifest = found
    files = {file: (int(record["size"]), int(record["crc32"])) for file, record in manifest["files"].items()}
    present = directory.file_sizes()
    good = []
    for file, (size, crc) in files.items():
        if present.get(file) != size:
            continue
        if verify and file_crc(directory, file) != crc:
            logger.warning("%s is corrupt: its CRC-32 differs from the manifest's", directory.location(file))
            continue
        good.append(file)
    identity = zlib.crc32(json.dumps(files, sort_keys=True).encode())
    return Survival(identity, files, frozenset(good))


def _replicated(place: Place, name: str) -> tuple[Place, dict[str, Any]] | None:
    """The directory of the checkpoint ``name`` of ``place`` and its manifest, if it is a sealed, replicated one."""
    directory = place.child(name)
    if not directory.is_whole(MANIFEST) or not directory.is_file(MANIFEST):
        return None
    manifest = read_manifest(directory)
    if manifest is None or "replicas" not in manifest:
        return None
    return directory, manifest


@dataclass(frozen=True)
class Holding:
    """What one host's directory holds of a replicated checkpoint, every file of it checked against the manifest.

    Attributes:
        host: the host it was checked on.
        hosts: the hosts of the checkpoint.
        replicas: the copies of each file on other hosts than its writer's.
        here: the files here, whose sizes and CRC-32 match the manifest.
        elsewhere: the files that live on other hosts only, each with the hosts that keep it.
    """

    host: str
    hosts: list[str]
    replicas: int
    here: list[str]
    elsewhere: dict[str, list[str]]


def holding(place: Place, name: str, host: str | None = None) -> Holding | None:
    """Check what this host (``host``, by default this machine's name) holds of the replicated checkpoint ``name``
    of ``place``: every file present against the manifest, and every file that the manifest says this host keeps
    present. ``None`` when ``name`` is no sealed replicated checkpoint here.

    Raises:
        IntegrityError: a file here is truncated or corrupt, a file this host keeps is missing, or a ``.distcp``
            file here is not in the manifest.
    """
    found = _replicated(place, name)
    if found is None:
        return None
    directory, manifest = found
    host = socket.gethostname() if host is None else host
    keepers: dict[str, list[str]] = manifest.get("keepers", {})
    present = directory.file_sizes()
    here, elsewhere = [], {}
    for file, record in sorted(manifest["files"].items()):
        kept_by = keepers.get(file, [])
        if file not in present:
            if host in kept_by:
                raise IntegrityError(
                    f"{directory}: file {file} is missing, and this host ({host}) is one of those that keep it "
                    f"({', '.join(kept_by)}): load the checkpoint on every host once to fetch it again"
                )
            elsewhere[file] = kept_by
            continue
        if present[file] != record["size"]:
            raise IntegrityError(
                f"{directory}: file {file} has {present[file]} bytes, {record['size']} expected (truncated?)"
            )
        crc = file_crc(directory, file)
        if crc != record["crc32"]:
            raise IntegrityError(
                f"{directory}: file {file} is corrupt (CRC-32 {crc:#010x}, {record['crc32']:#010x} expected)"
            )
        here.append(file)
    unlisted = sorted(file for file in present if file.endswith(".distcp") and file not in manifest["files"])
    if unlisted:
        raise IntegrityError(f"{directory}: files {unlisted} are not in its manifest")
    return Holding(host, list(manifest["hosts"]), int(manifest["replicas"]), here, elsewhere)


def complete(where: str | os.PathLike, storage_options: Mapping[str, Any] | None, timeout: float) -> None:
    """Collective, before a load of the checkpoint ``where``: if it is a replicated one, every host's first rank
    fetches the files its host's directory lacks (all of them, for a host replaced by an empty one) from ranks whose
    hosts hold them, checked against the manifest, so that the load then reads from its own host's directory alone.

    A no-op for a checkpoint that is not replicated, or that lies where every host sees the same contents.

    Raises:
        IntegrityError: on every rank, when a file of the checkpoint survives on no host (naming the files), or the
            hosts hold different checkpoints under its name.
    """
    parent, name, failure = None, "", None
    replicated_here = False
    try:
        parent, name = split(where, storage_options)
        if parent.seen_alike_by_every_host:
            return
        replicated_here = _replicated(parent, name) is not None
    except Exception as error:
        failure = error
    rank, _ = rank_and_world()
    # one round when no host holds a replicated checkpoint under the name: a plain sharded load pays no second one
    found = settle(
        failure,
        what=f"search for the parts of {where}",
        timeout=timeout,
        payload=(socket.gethostname(), replicated_here),
    )
    if not any(replicated for _, replicated in found):
        return
    hosts = [host for host, _ in found]
    assert parent is not None
    held, manifest, failure = None, None, None
    if hosts.index(hosts[rank]) == rank:  # the first rank of each host reads for its host
        try:
            held = survival(parent, name)  # a corrupt copy is fetched again
            manifest = None if held is None else parent.child(name).read(MANIFEST)
        except Exception as error:
            failure = error
    reports = settle(
        failure, what=f"search for the parts of {where} (holdings)", timeout=timeout, payload=(held, manifest)
    )
    plan = _fetches(str(where), hosts, reports)
    if plan is None:
        return
    transfers, raw = plan
    committed = parent.child(name)
    failure = None
    try:
        new = any(t.target == rank for t in transfers) and not committed.exists()  # a host replaced by an empty one
        target = committed
        if new:
            parent.make()
            target = parent.begin_directory(name)
        exchange(transfers, committed, target, cpu_group(), timeout, atomic=not new)
        if new:
            parent.commit_directory(name, lambda written: written.write(MANIFEST, lambda f: f.write(raw)))
    except Exception as error:
        failure = error
    settle(failure, what=f"fetch of the missing parts of {where}", timeout=timeout)
    fetched = [t for t in transfers if t.target == rank]
    if fetched:
        logger.info("Fetched %d missing files of %s (%.1f MB)", len(fetched), where, sum(t.size for t in fetched) / 1e6)


def _fetches(
    where: str, hosts: Sequence[str], reports: Sequence[tuple[Survival | None, bytes | None]]
) -> tuple[list[Transfer], bytes] | None:
    """What each host's first rank fetches, and from which rank, to hold every file of the checkpoint; ``None`` if
    the checkpoint is no replicated one, or every host holds it whole. The same on every rank."""
    held = {rank: survival for rank, (survival, _) in enumerate(reports) if survival is not None}
    if not held:
        return None
    identities = {survival.identity for survival in held.values()}
    if len(identities) > 1:
        raise IntegrityError(
            f"The hosts hold different checkpoints under the name {where}: their manifests differ. Remove the stale "
            "copies (or load another checkpoint)."
        )
    files = next(iter(held.values())).files
    raw = next(manifest for _, manifest in reports if manifest is not None)
    leaders = sorted({hosts.index(host) for host in hosts})  # the first rank of each host
    holders = {file: [rank for rank in leaders if rank in held and file in held[rank].good] for file in files}
    lost = sorted(file for file, ranks in holders.items() if not ranks)
    if lost:
        raise IntegrityError(f"The checkpoint {where} cannot be loaded: its files {lost} survive on no host")
    transfers = []
    for leader in leaders:
        have = held[leader].good if leader in held else frozenset()
        for number, file in enumerate(sorted(set(files) - have)):
            source = holders[file][number % len(holders[file])]  # spread over the hosts that hold it
            transfers.append(Transfer(source, leader, file, *files[file]))
    return (transfers, raw) if transfers else None
