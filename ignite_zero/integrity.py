"""Integrity of checkpoint files: a trailer written with the file, checked by loading and ``verify``.

``torch.save`` writes a zip archive and computes the CRC-32 of every record while it writes (torch itself
never checks them when loading). :class:`SealingStream` passes what ``torch.save`` writes on to the file, computes
the CRC-32 of the central directory (which holds every record's CRC-32, size and offset) as it passes, and, once
``torch.save`` returns, ends the archive with a small JSON trailer as its comment: the archive's size, that CRC-32,
and facts for ``ignite-zero inspect`` (world size, versions). Sealing never reads back nor seeks, so it works on
streams that cannot (an upload to an object store) and costs no extra pass over the data; the comment is part of
the zip format, so plain ``torch.load`` (``weights_only``, ``mmap``) and stock ignite load the file unchanged.

:func:`verify_file` checks size, directory and every record's CRC-32, streaming, in bounded memory.
CRC-32 detects accidental corruption and truncation; it is not a defence against deliberate tampering.
"""

from __future__ import annotations

import bisect
import json
import os
import struct
import warnings
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, Protocol

from zlib_ng import zlib_ng

__all__ = [
    "IntegrityError",
    "SealingStream",
    "Stored",
    "is_legacy_format",
    "read_trailer",
    "record_checker",
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
_READ_CHUNK = 1 << 20


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


class IntegrityError(RuntimeError):
    """A checkpoint file is truncated, corrupt, or not a checkpoint at all."""


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


class SealingStream:
    """The stream ``torch.save`` writes a checkpoint to: passes the bytes on to ``f`` and seals the archive.

    It holds back the last bytes written (the end records, which :meth:`seal` completes with the trailer) and
    computes the CRC-32 of the central directory as it passes: the zip writer writes the directory in one piece,
    from a write that starts with its first entry's signature. It also keeps the first error a write raised:
    torch's zip writer turns it into "unexpected pos ...", and the real cause (no space left, an I/O error, the
    store's answer) is what the user must see.

    Args:
        f: the file or upload stream; written to sequentially, never read nor seeked.
    """

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self._held = b""
        self._position = 0
        self._directory: tuple[int, int, dict[int, int]] | None = None  # start, CRC-32 so far, CRC-32 at each write
        self.error: BaseException | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size = view.nbytes
        if view[: len(_DIRECTORY_SIGNATURE)] == _DIRECTORY_SIGNATURE:
            self._directory = (self._position, 0, {})
        if self._directory is not None:
            start, crc, ends = self._directory
            crc = zlib_ng.crc32(view, crc)  # SIMD: should tensor data after a chance signature run through here
            ends[self._position + size] = crc
            self._directory = (start, crc, ends)
        self._position += size
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
        trailer = {"format": _FORMAT, "version": _VERSION, "size": end, "directory_crc32": crc}
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
                for record in archive.infolist():
                    if records is True or (callable(records) and records(record.filename)):
                        _check_record(stored, archive, record)
        except zipfile.BadZipFile as error:
            raise IntegrityError(
                f"{stored} is not a complete checkpoint file ({error}): truncated or corrupt"
            ) from error
    return trailer


def record_checker(source: str | os.PathLike | Stored, f: IO[bytes]) -> Callable[[int, int], None]:
    """A check of the bytes of one record read by themselves: ``check(data_offset, crc32)`` raises
    :class:`IntegrityError` unless the record whose data starts at ``data_offset`` has that CRC-32.

    Args:
        source: the file, for messages.
        f: the file, open.
    """
    with zipfile.ZipFile(f) as archive:
        headers = sorted((info.header_offset, info.CRC, info.filename) for info in archive.infolist())
    starts = [offset for offset, _, _ in headers]

    def check(data_offset: int, crc: int) -> None:
        index = bisect.bisect_right(starts, data_offset) - 1
        if index < 0:
            raise IntegrityError(f"{source}: no record holds the data at offset {data_offset}")
        _, expected, name = headers[index]
        if crc != expected:
            raise IntegrityError(
                f"{source}: record {name!r} is corrupt (CRC-32 {crc:#010x}, {expected:#010x} expected)"
            )

    return check


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


def _check_record(stored: Stored, archive: zipfile.ZipFile, record: zipfile.ZipInfo) -> None:
    try:
        with archive.open(record) as stream:
            while stream.read(_READ_CHUNK):
                pass
    except zipfile.BadZipFile as error:
        raise IntegrityError(f"{stored}: record {record.filename!r} is corrupt ({error})") from error
