"""The entries of DCP's files as the manifest records them (:class:`EntryRecord`), and their checked reads: each
entry's bytes read straight into place, their CRC-32 computed as they arrive and compared with the record's; small
neighbouring entries read together, in spans.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from typing import IO, Any, NamedTuple

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from zlib_ng import zlib_ng

from ignite_zero.storage.formats import torch_zip
from ignite_zero.storage.formats.base import IntegrityError
from ignite_zero.storage.formats.dcp_index import EntryIndex
from ignite_zero.storage.formats.scratch import thread_buffer
from ignite_zero.storage.formats.trust import load_metadata
from ignite_zero.storage.places import Place

__all__ = [
    "INDEX",
    "METADATA",
    "EntryRecord",
    "RecordedEntries",
    "check_crc",
    "laid_out",
    "metadata_of",
    "pack_records",
    "record_table",
    "read_checked",
    "read_entries",
    "read_entry",
    "read_recorded_file",
    "read_saved",
    "read_saved_into",
    "read_whole",
    "unpack_records",
]

#: The file DCP's metadata is written to, last: a directory without it is incomplete.
METADATA = ".metadata"
#: The file of the index of the entries (:class:`~.dcp_index.EntryIndex`), written with ``.metadata``.
INDEX = "ignite_zero_index.json"
# Reads, like writes, go in slices checksummed while still in the CPU's cache.
_SLICE = 256 << 10
# Neighbouring entries up to the first size are read together, in spans up to the second.
_SPANNED_ENTRY, _SPAN = 256 << 10, 4 << 20


class EntryRecord(NamedTuple):
    """Where one entry of a ``.distcp`` file lies, and its checksums.

    Attributes:
        offset: where the entry starts in the file.
        length: its size in bytes.
        crc: the CRC-32 of the whole entry.
        data_offset: where the bytes of its tensor start in the file (the entry's own offset for a value's bytes).
        data_crc: the CRC-32 of those bytes.
    """

    offset: int
    length: int
    crc: int
    data_offset: int
    data_crc: int


# A file's records in the manifest: one row of little-endian 64-bit integers per entry, the fields of EntryRecord in
# order, base64'd; thousands of entries as one string rather than as as many JSON lists, which are slow to write.
_RECORD_TABLE = np.dtype("<i8")


def record_table(records: Sequence[EntryRecord] | np.ndarray) -> np.ndarray:
    """``records`` as a table: a row of 64-bit integers per entry, the fields of :class:`EntryRecord` in order (what
    travels between processes and ranks, where a list of thousands of tuples is slow to pickle)."""
    return np.asarray(records, dtype=_RECORD_TABLE).reshape(-1, len(EntryRecord._fields))


def pack_records(records: Sequence[EntryRecord] | np.ndarray) -> str:
    """``records`` (or their :func:`record_table`) as the manifest holds them: a base64 table (see
    :func:`unpack_records`)."""
    return base64.b64encode(record_table(records).tobytes()).decode("ascii")


def unpack_records(value: object) -> np.ndarray:
    """The records of a file's entries as the manifest holds them, one row each (the fields of :class:`EntryRecord`):
    a base64 table (:func:`pack_records`), or a list of lists of five integers (manifests of ignite_zero before the
    table).

    Raises:
        ValueError: ``value`` is neither.
    """
    width = len(EntryRecord._fields)
    if isinstance(value, str):
        try:
            data = base64.b64decode(value, validate=True)
        except binascii.Error as error:
            raise ValueError(f"records not in base64: {error}") from error
        if len(data) % (width * _RECORD_TABLE.itemsize):
            raise ValueError(f"a table of records of {len(data)} bytes, not rows of {width} 64-bit integers")
        return np.frombuffer(data, dtype=_RECORD_TABLE).reshape(-1, width).astype(np.int64)
    if not isinstance(value, list) or not all(isinstance(row, list) and len(row) == width for row in value):
        raise ValueError(f"records neither a table in base64 nor lists of {width} integers")
    return np.array(value, dtype=np.int64).reshape(-1, width)


def metadata_of(content: bytes, place: Place, trusted: bool, load_id: str | None = None) -> tuple[Metadata, EntryIndex]:
    """DCP's metadata of the directory ``place`` from the bytes of its ``.metadata``, read as
    :func:`~.trust.load_metadata` reads them, with the storage facts DCP's readers add (``load_id``: the reader's,
    where it has one); and its index, whose sizes and offsets are checked against the files before DCP allocates
    anything from them.

    Raises:
        UnsafeCheckpointError: it holds anything but DCP's metadata, unless ``trusted``.
        IntegrityError: it places an entry outside its file or over another, or gives a tensor more bytes than its
            entries hold.
    """
    where = str(place.location(METADATA))
    metadata = load_metadata(content, where, trusted)
    index = EntryIndex.of_metadata(metadata, where)
    index.check_bounds(place.file_sizes(), where)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    if load_id is not None:
        metadata.storage_meta.load_id = load_id
    return metadata, index


class RecordedEntries:
    """The manifest's records of a directory's entries, found by where DCP's metadata says each lies."""

    def __init__(self, place: Place, records: Mapping[str, Sequence[EntryRecord]]) -> None:
        self.place = place
        self._records = {(name, record.offset): record for name, part in records.items() for record in part}
        # where each file lies, for messages: spelled out once, not for each entry of a load
        self._locations = {name: str(place.location(name)) for name in records}

    def recorded(self, name: str, offset: int, length: int | None = None) -> EntryRecord | None:
        """The record of the entry at ``offset`` of the file ``name`` (of ``length`` bytes), if the manifest has it."""
        record = self._records.get((name, offset))
        return record if record is not None and length in (None, record.length) else None

    def of(self, info: Any, fqn: str) -> tuple[EntryRecord, str]:
        """The record of the entry that DCP's storage information ``info`` locates, and where it lies, for messages.

        Raises:
            IntegrityError: the manifest has no such record.
        """
        location = self._locations.get(info.relative_path) or self.place.location(info.relative_path)
        where = f"{location}, entry {fqn} at {info.offset}"
        record = self.recorded(info.relative_path, info.offset, info.length)
        if record is None:
            raise IntegrityError(f"{where}: the manifest has no record of it (corrupt manifest or .metadata?)")
        return record, where


def read_recorded_file(place: Place, name: str, record: EntryRecord | None) -> bytes:
    """The bytes of the file ``name`` of ``place``, an entry of its own (``.metadata``, the index), checked by the
    manifest's ``record`` of it.

    Raises:
        IntegrityError: the manifest has no record of it, or it is truncated or corrupt.
    """
    content = place.read(name)
    where = str(place.location(name))
    if record is None or len(content) != record.length:
        raise IntegrityError(f"{where} has {len(content)} bytes, not what its manifest says (truncated?)")
    check_crc(zlib_ng.crc32(content), record.crc, where)
    return content


def laid_out(target: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the bytes of a saved tensor of ``dtype`` can be read straight into ``target``: one run of CPU memory."""
    return target.device.type == "cpu" and target.is_contiguous() and target.dtype == dtype


def read_saved_into(f: IO[bytes], record: EntryRecord, target: torch.Tensor, dtype: torch.dtype, where: str) -> bool:
    """Read a saved tensor straight into ``target`` if it is laid out alike in CPU memory; else read nothing and
    return ``False``."""
    if not laid_out(target, dtype):
        return False
    read_entry(f, record, torch_zip.tensor_bytes(target), where)
    return True


def read_saved(f: IO[bytes], record: EntryRecord, sizes: Sequence[int], dtype: torch.dtype, where: str) -> torch.Tensor:
    """A saved tensor, read into a new one."""
    saved = torch.empty(tuple(sizes), dtype=dtype)
    read_entry(f, record, torch_zip.tensor_bytes(saved), where)
    return saved


def read_checked(f: IO[bytes], view: memoryview, where: str, crc: int = 0) -> int:
    """Fill ``view`` from the file's position on, computing the CRC-32 of what arrives (continuing ``crc``)."""
    for begin in range(0, view.nbytes, _SLICE):
        piece = view[begin : begin + _SLICE]
        got = 0
        while got < piece.nbytes:  # a short read: more follows, or the file ends early
            more = f.readinto(piece[got:])  # type: ignore[attr-defined]
            if not more:
                raise IntegrityError(f"{where}: the file ends early (truncated?)")
            got += more
        crc = zlib_ng.crc32(piece, crc)
    return crc


def read_entry(f: IO[bytes], record: EntryRecord, data: memoryview, where: str) -> None:
    """Read an archive's entry: its tensor's bytes into ``data``, the rest (headers, pickle, directory) around it
    into a small buffer, each byte checked by the CRC-32 of the tensor's bytes and of the whole entry."""
    _check_fits(record, data, where)
    f.seek(record.offset)
    head = bytearray(record.data_offset - record.offset)
    tail = bytearray(record.offset + record.length - record.data_offset - data.nbytes)
    crc = read_checked(f, memoryview(head), where)
    data_crc = read_checked(f, data, where)
    crc = read_checked(f, memoryview(tail), where, zlib_ng.crc32_combine(crc, data_crc, data.nbytes))
    check_crc(data_crc, record.data_crc, where)
    check_crc(crc, record.crc, where)


def read_entries(f: IO[bytes], reads: Sequence[tuple[EntryRecord, memoryview, str]]) -> None:
    """Read many entries as :func:`read_entry` reads each (``reads``: each one's record, where its tensor's bytes go,
    and where it lies, for messages): small neighbours in the file with one read and one CRC-32 pass over them all,
    checked against their records' CRC-32 combined; the entry that does not match named when they differ."""
    span: list[tuple[EntryRecord, memoryview, str]] = []
    for read in sorted(reads, key=lambda read: read[0].offset):
        record, data, where = read
        _check_fits(record, data, where)
        if record.length > _SPANNED_ENTRY:
            read_entry(f, record, data, where)
            continue
        if span and (
            record.offset != span[-1][0].offset + span[-1][0].length
            or record.offset + record.length - span[0][0].offset > _SPAN
        ):
            _read_span(f, span)
            span = []
        span.append(read)
    if span:
        _read_span(f, span)


def _check_fits(record: EntryRecord, data: memoryview, where: str) -> None:
    if record.data_offset + data.nbytes > record.offset + record.length:
        raise IntegrityError(f"{where}: its {data.nbytes} bytes of data do not fit its entry (corrupt manifest?)")


def _read_span(f: IO[bytes], span: Sequence[tuple[EntryRecord, memoryview, str]]) -> None:
    """Read entries that follow each other in the file with one read, check them, and copy their tensors' bytes."""
    start = span[0][0].offset
    buffer = thread_buffer("entries read", span[-1][0].offset + span[-1][0].length - start)
    f.seek(start)
    crc = read_checked(f, buffer, span[0][2])
    expected = 0
    for record, _, _ in span:
        expected = zlib_ng.crc32_combine(expected, record.crc, record.length)
    if crc != expected:  # which one: each checked alone, as a read of it alone would
        for record, data, where in span:
            check_crc(
                zlib_ng.crc32(buffer[record.offset - start : record.offset - start + record.length]), record.crc, where
            )
            at = record.data_offset - start
            check_crc(zlib_ng.crc32(buffer[at : at + data.nbytes]), record.data_crc, where)
    for record, data, _ in span:
        at = record.data_offset - start
        data[:] = buffer[at : at + data.nbytes]


def read_whole(f: IO[bytes], record: EntryRecord, where: str) -> bytearray:
    f.seek(record.offset)
    data = bytearray(record.length)
    check_crc(read_checked(f, memoryview(data), where), record.crc, where)
    return data


def check_crc(crc: int, expected: int, where: str) -> None:
    if crc != expected:
        raise IntegrityError(f"{where} is corrupt (CRC-32 {crc:#010x}, {expected:#010x} expected)")
