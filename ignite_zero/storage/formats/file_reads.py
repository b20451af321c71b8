"""Checked reads of parts of a checkpoint file: what to read so that every byte taken is covered by a CRC-32
(a whole record, or the blocks of the trailer's table that hold a part, :class:`ReadChecks`), read straight into
place and checked as it arrives.
"""

from __future__ import annotations

import bisect
import os
import zipfile
from dataclasses import dataclass
from typing import IO, Any, NamedTuple, cast

import torch
from zlib_ng import zlib_ng

from ignite_zero import _compat
from ignite_zero.storage.formats.base import CLOSED_EARLY, IntegrityError, crc32, read_exactly
from ignite_zero.storage.formats.file_trailer import Blocks, Stored, parse_trailer

__all__ = ["FileParts", "LastSpan", "ReadChecks", "Span", "read_bytes", "read_into"]

# Reads into place go in pieces of this size, each summed while still in the CPU's cache.
_READ_PIECE = 1 << 20


class ReadChecks:
    """How the bytes of a file read in parts are checked: what to read so that every byte taken is covered by a
    CRC-32, and the comparison.

    A whole record is read and checked by itself, against its CRC-32 in the central directory (no byte more). A part
    of a record is read in the blocks that hold it (:class:`Blocks`), checked against the trailer's table: at most
    a block more on each side; in a file without trailer (written by other tools), the whole record.

    Args:
        source: the file, for messages.
        f: the file, open; read for its central directory and trailer.
    """

    def __init__(self, source: str | os.PathLike | Stored, f: IO[bytes]) -> None:
        self._source = source
        with zipfile.ZipFile(f) as archive:
            infos = sorted(archive.infolist(), key=lambda info: info.header_offset)
            trailer = parse_trailer(archive.comment)
        self._starts = [info.header_offset for info in infos]
        self._records = [(info.filename, info.CRC, info.file_size) for info in infos]
        self.blocks = None if trailer is None else Blocks.from_json(trailer.get("blocks"), source)

    def spans(self, record: int, size: int, start: int, stop: int) -> list[Span]:
        """Each span of the file to read whole to check the bytes ``[start, stop)`` of the record whose data lies at
        ``[record, record + size)``: contiguous, in order."""
        index = bisect.bisect_right(self._starts, record) - 1
        if index < 0 or self._records[index][2] != size:
            raise IntegrityError(f"{self._source}: no record of {size} bytes holds the data at offset {record}")
        name, crc, _ = self._records[index]
        whole = (start, stop) == (record, record + size)
        if whole or self.blocks is None or size <= self.blocks.size:
            return [Span(record, record + size, crc, name, False)]
        return [Span(a, b, block_crc, name, True) for a, b, block_crc in self.blocks.covering(start, stop)]

    def check(self, crc: int, span: Span) -> None:
        """Raise :class:`IntegrityError` unless a span's bytes have the CRC-32 expected."""
        if crc != span.crc32:
            raise IntegrityError(
                f"{self._source}: {span.what} is corrupt (CRC-32 {crc:#010x}, {span.crc32:#010x} expected)"
            )


class Span(NamedTuple):
    """The bytes ``[start, stop)`` of a file, read whole to be checked against their CRC-32: a whole record, or one
    of its blocks (:class:`Blocks`)."""

    start: int
    stop: int
    crc32: int
    record: str
    block: bool

    @property
    def what(self) -> str:
        """The span, for messages: made only for them (a load reads thousands of spans)."""
        if self.block:
            return f"the block [{self.start}, {self.stop}) of record {self.record!r}"
        return f"record {self.record!r}"


class FileParts:
    """Reads the views of a file's tensors that FSDP objects take (a :class:`~ignite_zero.adapters.deferred.Source`):
    the bytes from the view's first element to its last, in the checked spans that hold them.

    Args:
        f: the file, open; closed by :meth:`close`.
        checks: how its reads are checked.
        path: the file, for messages.
    """

    def __init__(self, f: IO[bytes], checks: ReadChecks, path: object) -> None:
        self._f = f
        self._checks = checks
        self._last = LastSpan()
        self._path = path

    def read(self, view: torch.Tensor) -> torch.Tensor:
        record, size, (start, stop) = self._where(view)
        data = read_bytes(self._f, self._checks, record, size, start, stop, self._last)
        first = start - record
        return torch.empty(0, dtype=view.dtype).set_(
            data, view.storage_offset() - first // view.element_size(), view.size(), view.stride()
        )

    def read_into(self, view: torch.Tensor, target: torch.Tensor) -> bool:
        """Read ``view`` straight into ``target`` where both are laid out alike in one run of memory (a rank's rows
        of a tensor, say), checked as it arrives; ``False`` where they are not, read nothing."""
        if not (_is_run(view) and _is_run(target) and target.device.type == "cpu" and target.dtype == view.dtype):
            return False
        record, size, (start, stop) = self._where(view)
        read_into(self._f, self._checks, record, size, start, stop, _bytes_of(target), self._last)
        return True

    def _where(self, view: torch.Tensor) -> tuple[int, int, tuple[int, int]]:
        """Where the record of ``view`` lies in the file, its size, and the bytes of it that ``view`` spans."""
        if self._f.closed:
            raise RuntimeError(f"{self._path} {CLOSED_EARLY}")
        storage = view.untyped_storage()
        record = _compat.storage_offset_in_file(storage)
        first, last = _extent(view)
        size = view.element_size()
        return record, storage.nbytes(), (record + first * size, record + last * size)

    def close(self) -> None:
        self._f.close()


def _is_run(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements fill one run of its storage in row-major order."""
    return tensor.is_contiguous() and not (tensor.is_conj() or tensor.is_neg())


def _extent(view: torch.Tensor) -> tuple[int, int]:
    """The elements ``[first, last)`` of its storage that ``view`` spans (its strides are not negative)."""
    first = int(view.storage_offset())
    if view.numel() == 0:
        return first, first
    return first, first + sum((length - 1) * stride for length, stride in zip(view.shape, view.stride())) + 1


def read_bytes(
    f: IO[bytes], checks: ReadChecks, record: int, size: int, start: int, stop: int, last: LastSpan | None = None
) -> torch.UntypedStorage:
    """The bytes ``[start, stop)`` of ``f``, within the record whose data lies at ``[record, record + size)``, read
    straight into a new storage (see :func:`read_into`)."""
    storage = torch.UntypedStorage(stop - start)
    read_into(f, checks, record, size, start, stop, _bytes_of(torch.empty(0, dtype=torch.uint8).set_(storage)), last)
    return storage


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The memory of a contiguous CPU tensor, as bytes to read into; no copy."""
    return memoryview(cast(Any, tensor.reshape(-1).view(torch.uint8).numpy())).cast("B")


def read_into(
    f: IO[bytes],
    checks: ReadChecks,
    record: int,
    size: int,
    start: int,
    stop: int,
    out: memoryview,
    last: LastSpan | None = None,
) -> None:
    """Read the bytes ``[start, stop)`` of ``f``, within the record whose data lies at ``[record, record + size)``,
    straight into ``out``, each checked span (a whole record, or the blocks that hold a part) checked as its last
    byte arrives.

    Spans are read in pieces of at most :data:`_READ_PIECE`, each summed right after it is read, while it is still
    in the CPU's cache: no second pass over memory; pieces within ``[start, stop)`` go straight into ``out``, a block
    inside in one read, with no more Python than the read and its sum (a load reads thousands of them). A small
    span that reaches beyond (a block at either end) is read whole into a buffer of its own, checked, and its part
    copied; ``last`` keeps the latest such span, for the next read of neighbouring bytes (views of one record read one
    after the other: a ZeRO partition) to take it without reading it again.
    """
    if stop == start:
        return
    readinto = cast(Any, f).readinto
    position = -1
    for span in checks.spans(record, size, start, stop):  # contiguous
        inside = start <= span.start and span.stop <= stop
        if inside and span.stop - span.start <= _READ_PIECE:  # most blocks of a part: one read, summed in cache
            if position != span.start:
                f.seek(span.start)
            position = span.stop
            piece = out[span.start - start : span.stop - start]
            got = readinto(piece) or 0
            if got < len(piece):  # a short read: more follows, or the file ends early
                _read_exactly(f, piece[got:], span.what)
            checks.check(zlib_ng.crc32(piece), span)
            continue
        if not inside and last is not None and (last.start, len(last.data)) == (span.start, span.stop - span.start):
            data = last.data  # checked when it was read
        else:
            if position != span.start:
                f.seek(span.start)
            position = span.stop
            if inside or span.stop - span.start > _READ_PIECE:  # pieces inside go straight to `out`
                _read_span(f, out, start, stop, span, checks)
                continue
            data = memoryview(bytearray(span.stop - span.start))
            _read_exactly(f, data, span.what)
            checks.check(crc32(data), span)
        low, high = max(start, span.start), min(stop, span.stop)  # an edge: its part of [start, stop) copied
        out[low - start : high - start] = data[low - span.start : high - span.start]
        if last is not None:
            last.start, last.data = span.start, data


def _read_span(f: IO[bytes], out: memoryview, start: int, stop: int, span: Span, checks: ReadChecks) -> None:
    """Read a checked span in pieces, those within ``[start, stop)`` straight into ``out``, the others into a buffer
    of their size, for their CRC-32 alone."""
    crc, position = 0, span.start
    while position < span.stop:
        end = min(span.stop, position + _READ_PIECE)
        end = min(end, start) if position < start else min(end, stop) if position < stop else end
        inside = start <= position < stop
        target = out[position - start : end - start] if inside else memoryview(bytearray(end - position))
        _read_exactly(f, target, span.what)
        crc = crc32(target, crc)
        position = end
    checks.check(crc, span)


@dataclass
class LastSpan:
    """The latest span read whole for a part of it, checked: its offset in the file and its bytes."""

    start: int = -1
    data: memoryview = memoryview(b"")


def _read_exactly(f: IO[bytes], target: memoryview, what: str) -> None:
    if not read_exactly(f, target):
        raise IntegrityError(f"{f}: the file ends inside {what} (truncated)")
