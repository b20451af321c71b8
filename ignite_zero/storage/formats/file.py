"""Integrity of checkpoint files: a trailer written with the file, checked by loading and ``verify``.

``torch.save`` writes a zip archive and computes the CRC-32 of every record while it writes (torch itself
never checks them when loading). :class:`SealingStream` passes what ``torch.save`` writes on to the file, computes
the CRC-32 of the central directory (which holds every record's CRC-32, size and offset) as it passes, and, once
``torch.save`` returns, ends the archive with a small JSON trailer as its comment: the archive's size, that CRC-32,
the CRC-32 of every block of the records (:class:`Blocks`, which check reads of parts of records) and facts for
``ignite-zero inspect`` (world size, versions). Sealing never reads back nor seeks, so it works on
streams that cannot (an upload to an object store) and costs no extra pass over the data; the comment is part of
the zip format, so plain ``torch.load`` (``weights_only``, ``mmap``) and stock ignite load the file unchanged.

:func:`verify_file` checks size, directory and every record's CRC-32, streaming, in bounded memory.
CRC-32 detects accidental corruption and truncation; it is not a defence against deliberate tampering.
"""

from __future__ import annotations

import base64
import bisect
import concurrent.futures
import ctypes
import functools
import json
import mmap
import os
import struct
import warnings
import zipfile
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NamedTuple, Protocol, cast

import torch
from zlib_ng import zlib_ng

from ignite_zero import _compat, tree
from ignite_zero.adapters import ShardedState
from ignite_zero.agreement import rank_and_world
from ignite_zero.loading import deferred
from ignite_zero.storage.formats.base import (
    CLOSED_EARLY,
    ExportedTensor,
    IntegrityError,
    Reader,
    Verification,
    crc32,
    entries_of,
    human_size,
    listed_leaves,
    listed_object,
    tensor_entry,
    value_entry,
    written_by,
)
from ignite_zero.storage.formats.trust import refusing_code
from ignite_zero.storage.places import READ_BLOCK, SMALL_READ_BLOCK, Place, StoredFile

__all__ = [
    "Blocks",
    "FileReader",
    "IntegrityError",
    "ReadChecks",
    "SealingStream",
    "Span",
    "Stored",
    "is_legacy_format",
    "read_trailer",
    "verify_file",
]

_FORMAT = "ignite_zero"
_VERSION = 1
_EOCD = struct.Struct("<4s4H2LH")  # end of central directory record, 22 bytes
_EOCD_SIGNATURE = b"PK\x05\x06"
_DIRECTORY_SIGNATURE = b"PK\x01\x02"  # a central directory entry
_ZIP64_LOCATOR = struct.Struct("<4sLQL")  # 20 bytes, right before the end record
_ZIP64_EOCD = struct.Struct("<4sQ2H2L4Q")
# What an archive ends with and sealing must read: the zip64 end record, its locator and the end record.
_ENDING = _ZIP64_EOCD.size + _ZIP64_LOCATOR.size + _EOCD.size
_READ_CHUNK = 8 << 20  # one ranged GET on an object store
# Blocks start at 64 KiB and double while there are more than 8192 of them: the table (base64, 44 KiB at most) must
# fit the 64 KiB zip comment, and a rank reading part of a tensor reads at most one block beyond each end of it.
_FIRST_BLOCK = 64 << 10
_MAX_BLOCKS = 8192
_IN_THREAD = 1 << 20  # writes from this size on have their blocks summed in another thread
# Reads into place go in pieces of this size, each summed while in the CPU's cache: reading 0.3 GB from tmpfs into a
# tensor with its CRC-32 took 0.16 s in pieces of 1 MiB, 0.19 s in pieces of 8 MiB, 0.17 s in one read without the
# CRC-32 (medians of 5, 2 busy cores).
_READ_PIECE = 1 << 20


class Stored(Protocol):
    """A stored file that can be opened for reading: a local path, or a file of an object store."""

    def open(self) -> IO[bytes]: ...

    @property
    def size(self) -> int: ...


class _LocalFile:
    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def __str__(self) -> str:
        return str(self.path)

    def open(self) -> IO[bytes]:
        return open(self.path, "rb")

    @property
    def size(self) -> int:
        return os.path.getsize(self.path)


def _stored(source: str | os.PathLike | Stored) -> Stored:
    return _LocalFile(source) if isinstance(source, (str, os.PathLike)) else source


def _directory_location(ending: bytes, end: int) -> tuple[int, int]:
    """Offset and size of the central directory, from the bytes that end the archive at ``end`` (the end record
    last, with an empty comment; the zip64 records before it, if any)."""
    signature, *_, size, offset, comment_length = _EOCD.unpack(ending[-_EOCD.size :])
    if signature != _EOCD_SIGNATURE or comment_length != 0:
        raise IntegrityError("no zip end record where expected")
    if offset == 0xFFFFFFFF or size == 0xFFFFFFFF:  # zip64: the real values are in the zip64 end record
        locator = ending[-_EOCD.size - _ZIP64_LOCATOR.size : -_EOCD.size]
        _, _, zip64_offset, _ = _ZIP64_LOCATOR.unpack(locator)
        start = len(ending) - (end - zip64_offset)
        if start < 0:
            raise IntegrityError("the zip64 end record is not where expected")
        fields = _ZIP64_EOCD.unpack(ending[start : start + _ZIP64_EOCD.size])
        size, offset = fields[-2], fields[-1]
    return offset, size


@dataclass(frozen=True)
class Blocks:
    """The CRC-32 of every block of a checkpoint file's records: the bytes ``[i * size, (i + 1) * size)`` of the
    file for each ``i``, the last one cut at ``end``, where the central directory starts.

    A part of a record is checked by reading the blocks that hold it, so that a rank can read and check its elements
    of a tensor without the rest of it.
    """

    size: int
    end: int
    crc32: tuple[int, ...]

    def covering(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """``(start, stop, crc32)`` of each block that holds bytes of ``[start, stop)``."""
        if stop > self.end:
            raise IntegrityError(f"bytes up to {stop} lie past the checked blocks, which end at {self.end}")
        first, last = start // self.size, (stop - 1) // self.size
        return [(i * self.size, min((i + 1) * self.size, self.end), self.crc32[i]) for i in range(first, last + 1)]

    def to_json(self) -> dict[str, Any]:
        packed = struct.pack(f">{len(self.crc32)}L", *self.crc32)
        return {"size": self.size, "end": self.end, "crc32": base64.b64encode(packed).decode()}

    @classmethod
    def from_json(cls, value: Any) -> Blocks | None:
        """The blocks a trailer lists; ``None`` for a file written before blocks were recorded."""
        if not isinstance(value, dict):
            return None
        packed = base64.b64decode(value["crc32"])
        blocks = cls(int(value["size"]), int(value["end"]), struct.unpack(f">{len(packed) // 4}L", packed))
        if len(blocks.crc32) != -(-blocks.end // blocks.size):
            raise IntegrityError(f"the trailer lists {len(blocks.crc32)} blocks for {blocks.end} bytes: it is corrupt")
        return blocks


class _BlockSums:
    """The CRC-32 of each block of the bytes written, doubling the block size as :data:`_MAX_BLOCKS` requires
    (adjacent CRC-32s combine without the data)."""

    def __init__(self) -> None:
        self.size = _FIRST_BLOCK
        self.done: list[int] = []
        self._crc = 0
        self._filled = 0

    def add(self, view: memoryview) -> None:
        while len(view):
            take = min(len(view), self.size - self._filled)
            self._crc = zlib_ng.crc32(view[:take], self._crc)
            self._filled += take
            view = view[take:]
            if self._filled == self.size:
                self.done.append(self._crc)
                self._crc, self._filled = 0, 0
                if len(self.done) == _MAX_BLOCKS:  # even: the block being filled starts on a doubled boundary
                    pairs = zip(self.done[::2], self.done[1::2])
                    self.done = [zlib_ng.crc32_combine(a, b, self.size) for a, b in pairs]
                    self.size *= 2

    def until(self, position: int) -> Blocks:
        """The blocks of everything added so far, which ends at ``position``."""
        return Blocks(self.size, position, (*self.done, self._crc) if self._filled else tuple(self.done))


@functools.cache
def _summer() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ignite_zero-block-sums")


os.register_at_fork(after_in_child=_summer.cache_clear)  # a forked child has the executor, but not its thread


class SealingStream:
    """The stream ``torch.save`` writes a checkpoint to: passes the bytes on to ``f`` and seals the archive.

    It holds back the last bytes written (the end records, which :meth:`seal` completes with the trailer) and
    computes the CRC-32 of the records' blocks and of the central directory as they pass: the zip writer writes the
    directory in one piece, from a write that starts with its first entry's signature. It also keeps the first error
    a write raised: torch's zip writer turns it into "unexpected pos ...", and the real cause (no space left, an I/O
    error, the store's answer) is what the user must see.

    Args:
        f: the file or upload stream; written to sequentially, never read nor seeked.
    """

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self._held = b""
        self._position = 0
        self._directory: tuple[int, int, dict[int, int]] | None = None  # start, CRC-32 so far, CRC-32 at each write
        self._block_sums = _BlockSums()
        self._blocks: Blocks | None = None
        self.error: BaseException | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size = view.nbytes
        if view[: len(_DIRECTORY_SIGNATURE)] == _DIRECTORY_SIGNATURE:
            self._directory = (self._position, 0, {})
            self._blocks = self._block_sums.until(self._position)
        # On past a chance signature in tensor data (the directory may start later). Large writes (torch.save's
        # records) are summed in another thread while the bytes are passed on, since both release the GIL: a
        # torch.save of 1.2 GB to tmpfs takes 0.85 s without the sums, 1.04 s with them in line, 0.90 s this way
        # (medians of 15 rounds, 2 cores). Smaller ones (slices of our own writer's records) right after they are
        # passed on, from the CPU's cache, where the write's copy left them (see torch_zip's _SLICE).
        summing = _summer().submit(self._block_sums.add, view) if size >= _IN_THREAD else None
        try:
            if size >= _ENDING:
                self._pass(self._held)
                self._pass(view[: size - _ENDING])
                self._held = bytes(view[size - _ENDING :])
            else:
                held = self._held + bytes(view)
                self._pass(held[: max(0, len(held) - _ENDING)])
                self._held = held[-_ENDING:]
        except BaseException as error:
            self.error = self.error or error
            raise
        finally:
            if summing is not None:
                summing.result()
        if summing is None:
            self._block_sums.add(view)
        if self._directory is not None:
            start, crc, ends = self._directory
            crc = zlib_ng.crc32(view, crc)  # SIMD: should tensor data after a chance signature run through here
            ends[self._position + size] = crc
            self._directory = (start, crc, ends)
        self._position += size
        return size

    def _pass(self, data: bytes | memoryview) -> None:
        if len(data):
            self._f.write(data)

    def flush(self) -> None:
        pass  # everything held back is written by seal() or finish()

    def seal(self, **facts: Any) -> None:
        """End the archive with the integrity trailer.

        Args:
            facts: JSON-serialisable values recorded for ``inspect`` (world size, versions, ...).

        Raises:
            IntegrityError: what was written does not end like a zip archive of torch's.
        """
        end = self._position
        offset, size = _directory_location(self._held, end)
        if self._directory is None or self._directory[0] != offset or offset + size not in self._directory[2]:
            raise IntegrityError(
                "cannot seal the checkpoint: torch.save did not write the zip central directory in one piece "
                "(a torch version this package does not know)"
            )
        crc = self._directory[2][offset + size]
        assert self._blocks is not None  # taken where the directory starts
        trailer = {
            "format": _FORMAT,
            "version": _VERSION,
            "size": end,
            "directory_crc32": crc,
            "blocks": self._blocks.to_json(),
        }
        comment = json.dumps({**trailer, **facts}, sort_keys=True).encode()
        if len(comment) > 0xFFFF:
            raise ValueError("integrity facts are too long for a zip comment")
        # the comment length is the last field of the end record
        self._pass(self._held[:-2] + len(comment).to_bytes(2, "little") + comment)
        self._held = b""

    def finish(self) -> None:
        """End a file that is no zip archive (torch's legacy format): what was held back, as it was."""
        self._pass(self._held)
        self._held = b""


def is_legacy_format(source: str | os.PathLike | Stored) -> bool:
    """Whether ``source`` holds torch's legacy format (``torch.save(..., _use_new_zipfile_serialization=False)``): a
    pickle stream rather than a zip archive, with no room for a trailer, and not loadable with ``mmap``."""
    with _stored(source).open() as f:
        return f.read(1) == b"\x80"  # pickle's PROTO opcode; a zip archive starts with "PK"


def read_trailer(source: str | os.PathLike | Stored) -> dict[str, Any] | None:
    """The trailer of a sealed checkpoint file, ``None`` for a file written by something else.

    Reads the end of the file only (on an object store: a ranged read).

    Raises:
        IntegrityError: the file is not a readable zip archive (truncated, or not a torch file).
    """
    stored = _stored(source)
    try:
        with stored.open() as f:
            if f.read(1) == b"\x80":  # the legacy format
                return None
            f.seek(0)
            with zipfile.ZipFile(f) as archive:
                return _parse(archive.comment)
    except (zipfile.BadZipFile, OSError) as error:
        raise IntegrityError(
            f"{stored} is not a complete checkpoint file ({error}): truncated or not written by torch.save"
        ) from error


def _parse(comment: bytes) -> dict[str, Any] | None:
    try:
        trailer = json.loads(comment)
    except ValueError:
        return None
    if not isinstance(trailer, dict) or trailer.get("format") != _FORMAT:
        return None
    return trailer


def verify_file(
    source: str | os.PathLike | Stored, records: bool | Callable[[str], bool] = True
) -> dict[str, Any] | None:
    """Check a checkpoint file against its trailer; return the trailer.

    A file without a trailer (written by plain ``torch.save`` or stock ignite) passes with a warning, since
    there is nothing to check it against.

    Args:
        source: the file's path, or a file of an object store.
        records: the records to read and check against their CRC-32, by name: all of them (True), or those a
            function accepts. The size and the central directory are checked in any case.

    Raises:
        IntegrityError: naming the file and what differs.
    """
    stored = _stored(source)
    with stored.open() as f:
        if f.read(1) == b"\x80":
            warnings.warn(
                f"{stored} carries no ignite_zero integrity trailer: it is in torch's legacy format "
                "(`_use_new_zipfile_serialization=False`), which has no room for one; loading it without "
                "verification.",
                stacklevel=3,
            )
            return None
        size = stored.size
        _check_end(stored, f, size)
        try:
            f.seek(0)
            with zipfile.ZipFile(f) as archive:
                trailer = _parse(archive.comment)
                if trailer is None:
                    warnings.warn(
                        f"{stored} carries no ignite_zero integrity trailer (written by another tool or by hand); "
                        "loading it without verification.",
                        stacklevel=3,
                    )
                    return None
                _check_layout(stored, f, size, archive, trailer)
                blocks = Blocks.from_json(trailer.get("blocks"))
                if records is True and blocks is not None:
                    _check_blocks(stored, f, blocks, archive)  # every byte before the directory: records and headers
                    return trailer
                for record in archive.infolist():
                    if records is True or (callable(records) and records(record.filename)):
                        _check_record(stored, archive, record)
        except zipfile.BadZipFile as error:
            raise IntegrityError(
                f"{stored} is not a complete checkpoint file ({error}): truncated or corrupt"
            ) from error
    return trailer


class ReadChecks:
    """How the bytes of a file read in parts are checked: what to read so that every byte taken is covered by a
    CRC-32, and the comparison.

    A whole record is read and checked by itself, against its CRC-32 in the central directory (no byte more). A part
    of a record is read in the blocks that hold it (:class:`Blocks`), checked against the trailer's table: at most
    a block more on each side; in a file without that table (written by other tools or older versions), a small
    record or the whole record.

    Args:
        source: the file, for messages.
        f: the file, open; read for its central directory and trailer.
    """

    def __init__(self, source: str | os.PathLike | Stored, f: IO[bytes]) -> None:
        self._source = source
        with zipfile.ZipFile(f) as archive:
            infos = sorted(archive.infolist(), key=lambda info: info.header_offset)
            trailer = _parse(archive.comment)
        self._starts = [info.header_offset for info in infos]
        self._records = [(info.filename, info.CRC, info.file_size) for info in infos]
        self.blocks = None if trailer is None else Blocks.from_json(trailer.get("blocks"))

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
        """The span, for messages: made only for them (a load of 0.3 GB reads 2,400 blocks)."""
        if self.block:
            return f"the block [{self.start}, {self.stop}) of record {self.record!r}"
        return f"record {self.record!r}"


def _central_directory(f: IO[bytes], end: int, comment_length: int) -> tuple[int, int]:
    """Offset and size of the central directory of the zip archive whose end record stops at ``end``."""
    start = max(0, end - _ENDING)
    f.seek(start)
    ending = f.read(end - start)
    signature, *_, size, offset, found_length = _EOCD.unpack(ending[-_EOCD.size :])
    if signature != _EOCD_SIGNATURE or found_length != comment_length:
        raise IntegrityError("no zip end record where expected")
    return _directory_location(ending[:-2] + b"\0\0", end)


def _check_end(stored: Stored, f: IO[bytes], size: int) -> None:
    """The zip end record must end the file exactly, with the comment it announces: else bytes were cut off."""
    f.seek(max(0, size - _EOCD.size - 0xFFFF))
    tail = f.read()
    start = tail.rfind(_EOCD_SIGNATURE)
    if start < 0 or len(tail) - start < _EOCD.size:
        raise IntegrityError(
            f"{stored} is not a complete checkpoint file: no zip end record (truncated or not a torch file)"
        )
    announced = _EOCD.unpack(tail[start : start + _EOCD.size])[-1]
    present = len(tail) - start - _EOCD.size
    if announced != present:
        raise IntegrityError(
            f"{stored} is truncated or padded: its zip end record announces a {announced}-byte trailer, {present} "
            "bytes follow it"
        )


def _check_layout(stored: Stored, f: IO[bytes], size: int, archive: zipfile.ZipFile, trailer: dict[str, Any]) -> None:
    expected_size = trailer["size"] + len(archive.comment)
    if size != expected_size:
        raise IntegrityError(f"{stored} has {size} bytes, its trailer says {expected_size}: truncated or padded")
    offset, length = _central_directory(f, trailer["size"], len(archive.comment))
    f.seek(offset)
    crc = 0
    while length > 0:
        chunk = f.read(min(length, _READ_CHUNK))
        if not chunk:
            raise IntegrityError(f"{stored}: the central directory ends past the end of the file")
        crc = zlib.crc32(chunk, crc)
        length -= len(chunk)
    if crc != trailer["directory_crc32"]:
        raise IntegrityError(
            f"{stored}: the zip central directory is corrupt (CRC-32 {crc:#010x}, expected "
            f"{trailer['directory_crc32']:#010x})"
        )


def _check_blocks(stored: Stored, f: IO[bytes], blocks: Blocks, archive: zipfile.ZipFile) -> None:
    """Every block of the records against the trailer's table, read in chunks of whole blocks."""
    f.seek(0)
    chunk_size = max(blocks.size, _READ_CHUNK)  # both powers of two: a chunk holds whole blocks
    for chunk_start in range(0, blocks.end, chunk_size):
        length = min(chunk_size, blocks.end - chunk_start)
        chunk = memoryview(f.read(length))
        if len(chunk) != length:
            raise IntegrityError(f"{stored} ends at {chunk_start + len(chunk)}, before its records do (truncated)")
        for start in range(0, length, blocks.size):
            crc = zlib_ng.crc32(chunk[start : start + blocks.size])
            first = chunk_start + start
            expected = blocks.crc32[first // blocks.size]
            if crc != expected:
                stop = min(first + blocks.size, blocks.end)
                raise IntegrityError(
                    f"{stored}: bytes [{first}, {stop}) ({_records_in(archive, first, stop)}) are corrupt (CRC-32 "
                    f"{crc:#010x}, {expected:#010x} expected)"
                )


def _records_in(archive: zipfile.ZipFile, start: int, stop: int) -> str:
    """The records whose headers or data lie in ``[start, stop)`` of the archive, as messages name them."""
    infos = sorted(archive.infolist(), key=lambda info: info.header_offset)
    ends = [info.header_offset for info in infos[1:]] + [archive.start_dir]
    names = [info.filename for info, end in zip(infos, ends) if info.header_offset < stop and end > start]
    return ("record " if len(names) == 1 else "records ") + ", ".join(map(repr, names))


def _check_record(stored: Stored, archive: zipfile.ZipFile, record: zipfile.ZipInfo) -> None:
    try:
        with archive.open(record) as stream:
            while stream.read(_READ_CHUNK):
                pass
    except zipfile.BadZipFile as error:
        raise IntegrityError(f"{stored}: record {record.filename!r} is corrupt ({error})") from error


class FileReader(Reader):
    """A checkpoint file (a consolidated save, or plain ``torch.save``, zip or legacy format): its identity is its
    size and the checksum its trailer holds.

    Mapped with ``mmap`` where it can be, so that the ranks of one host share its pages. On an object store, each
    rank reads the file's structure, then only what its objects need, with ranged reads checked as they arrive
    (:class:`ReadChecks`): the tensors of whole entries, the partition of a ZeRO optimizer, and, for FSDP objects,
    the elements of each tensor their shards hold, read as they load (:mod:`ignite_zero.loading.deferred`).

    Args:
        place: its directory.
        name: its name there.
    """

    ext = "pt"
    is_directory = False
    sharded = False

    def __init__(self, place: Place, name: str) -> None:
        self.place = place
        self.name = name
        self.path = place.location(name)
        self.stored = StoredFile(place, name)
        self._source: _Parts | None = None
        self._checks: ReadChecks | None = None

    def identity(self) -> tuple[Any, ...] | None:
        if not self.place.is_file(self.name):
            return None
        trailer = read_trailer(self.stored)  # cheap: the end of the file only; fails on a truncated file
        return self.place.size(self.name), None if trailer is None else trailer["directory_crc32"]

    @classmethod
    def at(cls, place: Place, name: str) -> FileReader:
        return cls(place, name)

    def exists(self) -> bool:
        return self.place.is_file(self.name)

    def modified(self) -> float:
        return self.place.modified(self.name)

    def verify(self, whole: bool = True) -> Verification:
        self._existing()
        # A load checks the pickled structure here, and each record as a rank reads it (:meth:`entries`): checking
        # them all here would read the whole file once more (on an object store: download it on every host).
        trailer = verify_file(self.stored, records=True if whole else _is_structure)
        if trailer is None:
            why = "written by another tool"
            if is_legacy_format(self.stored):
                why = "torch's legacy format, `_use_new_zipfile_serialization=False`, has no room for one"
            return Verification(False, "integrity trailer", why)
        summary = f"{human_size(self.stored.size)}, CRC-32 of every record and of the directory match"
        return Verification(True, "integrity trailer", summary, trailer)

    def load(self, weights_only: bool, progress: Callable[[int, int], None] | None = None) -> Any:
        """Everything the file holds, its tensors mapped from the file (copied for the legacy format; read whole
        where files cannot be mapped, as on an object store)."""
        self._existing()
        if self.place.maps_files:
            mmap = not is_legacy_format(self.stored)
            with refusing_code(str(self.path)):
                loaded = torch.load(self.path, map_location="cpu", weights_only=weights_only, mmap=mmap)
        else:
            loaded = self.read_tensors(self.structure(weights_only))
        if progress is not None:
            progress(self.stored.size, self.stored.size)
        return loaded

    def listing(self) -> dict[str, Any]:
        trailer = read_trailer(self.stored)
        state = self.structure(weights_only=not self.trusted)
        objects = []
        for name, value in state.items() if isinstance(state, Mapping) else [("(state)", state)]:
            entries = [
                tensor_entry(key, leaf.dtype, tuple(leaf.shape))
                if isinstance(leaf, torch.Tensor)
                else value_entry(key, leaf)
                for key, leaf in listed_leaves(value)
            ]
            objects.append(listed_object(str(name), type(value).__name__, entries))
        return {
            "schema": 1,
            "path": str(self.path),
            "format": "file",
            "files": 1,
            "bytes": self.stored.size,
            "written_by": written_by(trailer),
            "objects": objects,
        }

    def tensors(self, only: str) -> tuple[list[ExportedTensor], dict[str, str]]:
        ranged = not self.place.maps_files
        # mapped: tensors are read when their bytes are; by ranged reads (an object store), one at a time when written
        loaded = self.structure(not self.trusted) if ranged else self.load(not self.trusted)
        mapped = not ranged and not is_legacy_format(self.stored)
        if not isinstance(loaded, Mapping):
            raise ValueError(f"{self.path} holds a {type(loaded).__name__}, not a state dict to export")
        if only in loaded:
            state = loaded[only]
        elif loaded and all(isinstance(value, torch.Tensor) for value in loaded.values()):
            state = loaded  # a single-object save: the model's state dict itself
        else:
            raise KeyError(
                f"The checkpoint has no entry {only!r} (it holds {sorted(loaded)}); pass --only with one of them"
            )
        found: list[ExportedTensor] = []
        aliases: dict[str, str] = {}
        written: dict[tuple[Any, ...], str] = {}  # a tensor's memory, as (storage, offset, shape, stride): its name
        for path, value in tree.leaves(state):
            if not isinstance(value, torch.Tensor):
                continue
            name = ".".join(map(str, path))
            storage = value.untyped_storage()
            where = _compat.storage_offset_in_file(storage) if ranged else storage.data_ptr()
            view = (where, value.storage_offset(), tuple(value.shape), value.stride())
            if value.numel() and view in written:
                aliases[name] = written[view]
                continue
            written[view] = name
            release: Callable[[], None] = functools.partial(_drop_pages, value) if mapped else (lambda: None)
            read = functools.partial(self.read_tensors, value) if ranged else functools.partial(_itself, value)
            found.append(ExportedTensor(name, value.dtype, tuple(value.shape), read, release))
        return found, aliases

    def entries(self, objects: Mapping, weights_only: bool, into_objects: bool = False) -> Any:
        """What ``objects`` load, its tensors deferred (:mod:`ignite_zero.loading.deferred`): each is read when it is
        loaded,
        straight into the tensor it is loaded into where the layouts allow, or into a new one, each block checked as it
        arrives (:class:`ReadChecks`). A rank reads its part of each sharded entry only (FSDP's parts of each tensor,
        its partition of a ZeRO optimizer's state), once: verifying the file first, then mapping and copying it,
        read every byte twice. Every tensor is deferred, ``into_objects`` or not: nothing is read here."""
        if is_legacy_format(self.stored):  # no records to read in parts: loaded whole (locally only)
            return entries_of(objects, self.structure(weights_only))
        self._existing()
        entries = entries_of(objects, self.structure(weights_only))
        for path, obj in tree.leaves(objects):
            if isinstance(obj, ShardedState) and not obj.loads_deferred and (part := obj.part_needed()) is not None:
                _replace(entries, path, part.select(tree.get(entries, path)))
        return deferred.defer(entries, self._parts())

    def close(self) -> None:
        if self._source is not None:
            self._source.close()
            self._source = None

    def _parts(self) -> _Parts:
        if self._source is None:
            self._source = _Parts(self)
        return self._source

    def structure(self, weights_only: bool) -> Any:
        """What the file holds, with tensors on the meta device: the pickle and the record headers only (a local
        file in torch's legacy format: loaded)."""
        if is_legacy_format(self.stored):
            if self.place.maps_files:
                return self.load(weights_only)
            raise ValueError(
                f"{self.path} is in torch's legacy format (`_use_new_zipfile_serialization=False`), which cannot be "
                "read in parts: copy it to a local file, or save it again in the default format"
            )
        # small blocks: the pickle is read in pieces, and every record's header by itself
        with self.place.open(self.name, block_size=SMALL_READ_BLOCK) as f, refusing_code(str(self.path)):
            structure = torch.load(f, map_location="meta", weights_only=weights_only)
        _map_tensors(functools.partial(_inside, self.path, self.stored.size), structure)
        return structure

    def read_tensors(self, entries: Any) -> Any:
        """``entries`` with each meta tensor replaced by the tensor read from the file (storages shared as saved),
        each storage checked against its record's CRC-32."""
        storages: dict[int, torch.UntypedStorage] = {}
        with self.place.open(self.name, block_size=READ_BLOCK) as f:
            checks = self.read_checks(f)

            def real(tensor: torch.Tensor) -> torch.Tensor:
                meta = tensor.untyped_storage()
                offset = _compat.storage_offset_in_file(meta)
                if offset not in storages:
                    storages[offset] = _read_bytes(f, checks, offset, meta.nbytes(), offset, offset + meta.nbytes())
                copy = torch.empty(0, dtype=tensor.dtype)
                return copy.set_(storages[offset], tensor.storage_offset(), tensor.size(), tensor.stride())

            return _map_tensors(real, entries)

    def read_checks(self, f: IO[bytes]) -> ReadChecks:
        """How reads of this file are checked, from its central directory and trailer read once (``f``: the file,
        open, the first time)."""
        if self._checks is None:
            self._checks = ReadChecks(self.stored, f)
        return self._checks

    def _existing(self) -> None:
        if not self.place.is_file(self.name):
            raise FileNotFoundError(f"Checkpoint file {self.path} does not exist on rank {rank_and_world()[0]}")


def _is_structure(record: str) -> bool:
    """Whether a record of a checkpoint file is part of its structure (the pickle, versions) and not a storage."""
    return "/data/" not in record


class _Parts:
    """Reads the views of a file's tensors that FSDP objects take (a :class:`~ignite_zero.loading.deferred.Source`): the
    bytes from the view's first element to its last, in the checked spans that hold them."""

    def __init__(self, reader: FileReader) -> None:
        self._f = reader.place.open(reader.name, block_size=SMALL_READ_BLOCK)
        self._checks = reader.read_checks(self._f)
        self._last = _LastSpan()
        self._path = reader.path

    def read(self, view: torch.Tensor) -> torch.Tensor:
        record, size, (start, stop) = self._where(view)
        data = _read_bytes(self._f, self._checks, record, size, start, stop, self._last)
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
        _read_into(self._f, self._checks, record, size, start, stop, _bytes_of(target), self._last)
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


def _read_bytes(
    f: IO[bytes], checks: ReadChecks, record: int, size: int, start: int, stop: int, last: _LastSpan | None = None
) -> torch.UntypedStorage:
    """The bytes ``[start, stop)`` of ``f``, within the record whose data lies at ``[record, record + size)``, read
    straight into a new storage (see :func:`_read_into`)."""
    storage = torch.UntypedStorage(stop - start)
    _read_into(f, checks, record, size, start, stop, _bytes_of(torch.empty(0, dtype=torch.uint8).set_(storage)), last)
    return storage


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The memory of a contiguous CPU tensor, as bytes to read into; no copy."""
    return memoryview(cast(Any, tensor.reshape(-1).view(torch.uint8).numpy())).cast("B")


def _read_into(
    f: IO[bytes],
    checks: ReadChecks,
    record: int,
    size: int,
    start: int,
    stop: int,
    out: memoryview,
    last: _LastSpan | None = None,
) -> None:
    """Read the bytes ``[start, stop)`` of ``f``, within the record whose data lies at ``[record, record + size)``,
    straight into ``out``, each checked span (a whole record, or the blocks that hold a part) checked as its last
    byte arrives.

    Spans are read in pieces of at most :data:`_READ_PIECE`, each summed right after it is read, while it is still
    in the CPU's cache: no second pass over memory; pieces within ``[start, stop)`` go straight into ``out``, a block
    inside in one read, with no more Python than the read and its sum (2,400 blocks a load of 0.3 GB). A small
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
                _fill(f, piece[got:], span.what)
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
            _fill(f, data, span.what)
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
        _fill(f, target, span.what)
        crc = crc32(target, crc)
        position = end
    checks.check(crc, span)


@dataclass
class _LastSpan:
    """The latest span read whole for a part of it, checked: its offset in the file and its bytes."""

    start: int = -1
    data: memoryview = memoryview(b"")


def _fill(f: IO[bytes], target: memoryview, what: str) -> None:
    filled = 0
    while filled < len(target):
        count = f.readinto(target[filled:])  # type: ignore[attr-defined]
        if not count:
            raise IntegrityError(f"{f}: the file ends inside {what} (truncated)")
        filled += count


def _map_tensors(func: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    """``value`` with every tensor ``t`` in it replaced by ``func(t)``, in place where containers allow: a model's
    state dict keeps its ``_metadata``."""
    if isinstance(value, torch.Tensor):
        return func(value)
    if isinstance(value, dict):
        for key, item in value.items():
            value[key] = _map_tensors(func, item)
    elif isinstance(value, list):
        value[:] = [_map_tensors(func, item) for item in value]
    elif isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_map_tensors(func, item) for item in value)
    return value


def _replace(entries: Any, path: tree.Path, value: Any) -> None:
    parent = tree.get(entries, path[:-1])
    parent[path[-1]] = value


def _inside(path: str | Path, size: int, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (on the meta device), if the bytes its pickle gives its storage lie inside the file of ``size``
    bytes: checked before anything is allocated for them."""
    storage = tensor.untyped_storage()
    offset = _compat.storage_offset_in_file(storage)
    if offset < 0 or offset + storage.nbytes() > size:
        raise IntegrityError(
            f"{path}: a storage of {storage.nbytes()} bytes at offset {offset} lies past the end of the file "
            f"({size} bytes): corrupt or forged"
        )
    return tensor


def _itself(value: torch.Tensor) -> torch.Tensor:
    return value


def _drop_pages(tensor: torch.Tensor) -> None:
    """Let the kernel drop the pages of a tensor mapped from the checkpoint file once it is written; only for such
    tensors (on anonymous memory, dropping pages would zero them).

    They are clean file pages that it would reclaim under pressure anyway, but until then they count as resident:
    exporting a 954 MiB checkpoint grew file-backed resident memory by 955 MiB without this, and not at all with
    it. A no-op where ``madvise`` is missing.
    """
    page = mmap.PAGESIZE
    start = tensor.untyped_storage().data_ptr()
    length = tensor.untyped_storage().nbytes()
    first = start - start % page
    try:
        _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(length + start - first), _MADV_DONTNEED)
    except (OSError, AttributeError):
        pass


_MADV_DONTNEED = 4


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)
