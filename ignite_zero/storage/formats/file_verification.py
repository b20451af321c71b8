"""Verification of a checkpoint file against its integrity trailer (:mod:`~.file_trailer`): size, central
directory and every record's CRC-32, streamed, in bounded memory.

CRC-32 detects accidental corruption and truncation; it is not a defence against deliberate tampering.
"""

from __future__ import annotations

import os
import warnings
import zipfile
import zlib
from collections.abc import Callable
from typing import IO, Any

from zlib_ng import zlib_ng

from ignite_zero.storage.formats.base import IntegrityError
from ignite_zero.storage.formats.file_trailer import (
    Blocks,
    Stored,
    as_stored,
    central_directory,
    check_end,
    parse_trailer,
)

__all__ = ["verify_file"]

_READ_CHUNK = 8 << 20  # one ranged GET on an object store


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
    stored = as_stored(source)
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
        check_end(stored, f, size)
        try:
            f.seek(0)
            with zipfile.ZipFile(f) as archive:
                trailer = parse_trailer(archive.comment)
                if trailer is None:
                    warnings.warn(
                        f"{stored} carries no ignite_zero integrity trailer (written by another tool or by hand); "
                        "loading it without verification.",
                        stacklevel=3,
                    )
                    return None
                _check_layout(stored, f, size, archive, trailer)
                blocks = Blocks.from_json(trailer.get("blocks"), stored)
                if records is True:
                    _check_blocks(stored, f, blocks, archive)  # every byte before the directory: records and headers
                    return trailer
                for record in archive.infolist():
                    if callable(records) and records(record.filename):
                        _check_record(stored, archive, record)
        except zipfile.BadZipFile as error:
            raise IntegrityError(
                f"{stored} is not a complete checkpoint file ({error}): truncated or corrupt"
            ) from error
    return trailer


def _check_layout(stored: Stored, f: IO[bytes], size: int, archive: zipfile.ZipFile, trailer: dict[str, Any]) -> None:
    expected_size = trailer["size"] + len(archive.comment)
    if size != expected_size:
        raise IntegrityError(f"{stored} has {size} bytes, its trailer says {expected_size}: truncated or padded")
    offset, length = central_directory(f, trailer["size"], len(archive.comment))
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
