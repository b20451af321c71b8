"""Integrity of checkpoint files: a trailer written with the file, checked by loading and ``verify``.

``torch.save`` writes a zip archive and computes the CRC-32 of every record while it writes (torch itself
never checks them when loading). Once ``torch.save`` returns, :func:`seal` appends a small JSON trailer as
the archive's comment: the file's size, the CRC-32 of the central directory (which holds every record's
CRC-32, size and offset), and facts for ``ignite-zero inspect`` (world size, versions). Sealing reads back
only the central directory, so integrity costs no extra pass over the data; the comment is part of the
zip format, so plain ``torch.load`` (``weights_only``, ``mmap``) and stock ignite load the file unchanged.

:func:`verify_file` checks size, directory and every record's CRC-32, streaming, in bounded memory.
CRC-32 detects accidental corruption and truncation; it is not a defence against deliberate tampering.
"""

from __future__ import annotations

import json
import os
import struct
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import IO, Any

__all__ = ["IntegrityError", "is_legacy_format", "read_trailer", "seal", "verify_file"]

_FORMAT = "ignite_zero"
_VERSION = 1
_EOCD = struct.Struct("<4s4H2LH")  # end of central directory record, 22 bytes
_EOCD_SIGNATURE = b"PK\x05\x06"
_ZIP64_LOCATOR = struct.Struct("<4sLQL")  # 20 bytes, right before the end record
_ZIP64_EOCD = struct.Struct("<4sQ2H2L4Q")
_READ_CHUNK = 1 << 20


class IntegrityError(RuntimeError):
    """A checkpoint file is truncated, corrupt, or not a checkpoint at all."""


def _central_directory(f: IO[bytes], end: int, comment_length: int = 0) -> tuple[int, int]:
    """Offset and size of the central directory of the zip archive whose end record stops at ``end``."""
    f.seek(end - _EOCD.size)
    signature, *_, size, offset, found_length = _EOCD.unpack(f.read(_EOCD.size))
    if signature != _EOCD_SIGNATURE or found_length != comment_length:
        raise IntegrityError("no zip end record where expected")
    if offset == 0xFFFFFFFF or size == 0xFFFFFFFF:  # zip64: the real values are in the zip64 end record
        f.seek(end - _EOCD.size - _ZIP64_LOCATOR.size)
        _, _, zip64_offset, _ = _ZIP64_LOCATOR.unpack(f.read(_ZIP64_LOCATOR.size))
        f.seek(zip64_offset)
        fields = _ZIP64_EOCD.unpack(f.read(_ZIP64_EOCD.size))
        size, offset = fields[-2], fields[-1]
    return offset, size


def _directory_crc(f: IO[bytes], offset: int, size: int) -> int:
    f.seek(offset)
    crc = 0
    while size > 0:
        chunk = f.read(min(size, _READ_CHUNK))
        if not chunk:
            raise IntegrityError("the central directory ends past the end of the file")
        crc = zlib.crc32(chunk, crc)
        size -= len(chunk)
    return crc


def seal(f: IO[bytes], **facts: Any) -> None:
    """Append the integrity trailer to the zip archive that ``torch.save`` just wrote to ``f``.

    Args:
        f: file open for reading and writing, positioned at the end of the archive.
        facts: JSON-serialisable values recorded for ``inspect`` (world size, versions, ...).
    """
    end = f.tell()
    offset, size = _central_directory(f, end)
    trailer = {"format": _FORMAT, "version": _VERSION, "size": end, "directory_crc32": _directory_crc(f, offset, size)}
    comment = json.dumps({**trailer, **facts}, sort_keys=True).encode()
    if len(comment) > 0xFFFF:
        raise ValueError("integrity facts are too long for a zip comment")
    f.seek(end - 2)  # the comment length, last field of the end record
    f.write(len(comment).to_bytes(2, "little") + comment)


def is_legacy_format(path: str | Path) -> bool:
    """Whether ``path`` holds torch's legacy format (``torch.save(..., _use_new_zipfile_serialization=False)``): a
    pickle stream rather than a zip archive, with no room for a trailer, and not loadable with ``mmap``."""
    with open(path, "rb") as f:
        return f.read(1) == b"\x80"  # pickle's PROTO opcode; a zip archive starts with "PK"


def read_trailer(path: str | Path) -> dict[str, Any] | None:
    """The trailer of a sealed checkpoint file, ``None`` for a file written by something else.

    Raises:
        IntegrityError: the file is not a readable zip archive (truncated, or not a torch file).
    """
    if Path(path).is_file() and is_legacy_format(path):
        return None
    try:
        with zipfile.ZipFile(path) as archive:
            return _parse(archive.comment)
    except (zipfile.BadZipFile, OSError) as error:
        raise IntegrityError(
            f"{path} is not a complete checkpoint file ({error}): truncated or not written by torch.save"
        ) from error


def _parse(comment: bytes) -> dict[str, Any] | None:
    try:
        trailer = json.loads(comment)
    except ValueError:
        return None
    if not isinstance(trailer, dict) or trailer.get("format") != _FORMAT:
        return None
    return trailer


def verify_file(path: str | Path) -> dict[str, Any] | None:
    """Check a checkpoint file against its trailer; return the trailer.

    A file without a trailer (written by plain ``torch.save`` or stock ignite) passes with a warning, since
    there is nothing to check it against.

    Raises:
        IntegrityError: naming the file and what differs.
    """
    path = Path(path)
    if path.is_file() and is_legacy_format(path):
        warnings.warn(
            f"{path} carries no ignite_zero integrity trailer: it is in torch's legacy format "
            "(`_use_new_zipfile_serialization=False`), which has no room for one; loading it without verification.",
            stacklevel=3,
        )
        return None
    _check_end(path)
    try:
        with zipfile.ZipFile(path) as archive:
            trailer = _parse(archive.comment)
            if trailer is None:
                warnings.warn(
                    f"{path} carries no ignite_zero integrity trailer (written by another tool or by hand); "
                    "loading it without verification.",
                    stacklevel=3,
                )
                return None
            _check_layout(path, archive, trailer)
            for record in archive.infolist():
                _check_record(path, archive, record)
    except zipfile.BadZipFile as error:
        raise IntegrityError(f"{path} is not a complete checkpoint file ({error}): truncated or corrupt") from error
    return trailer


def _check_end(path: Path) -> None:
    """The zip end record must end the file exactly, with the comment it announces: else bytes were cut off."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        f.seek(max(0, size - _EOCD.size - 0xFFFF))
        tail = f.read()
    start = tail.rfind(_EOCD_SIGNATURE)
    if start < 0 or len(tail) - start < _EOCD.size:
        raise IntegrityError(
            f"{path} is not a complete checkpoint file: no zip end record (truncated or not a torch file)"
        )
    announced = _EOCD.unpack(tail[start : start + _EOCD.size])[-1]
    present = len(tail) - start - _EOCD.size
    if announced != present:
        raise IntegrityError(
            f"{path} is truncated or padded: its zip end record announces a {announced}-byte trailer, {present} bytes "
            "follow it"
        )


def _check_layout(path: Path, archive: zipfile.ZipFile, trailer: dict[str, Any]) -> None:
    actual_size = os.path.getsize(path)
    expected_size = trailer["size"] + len(archive.comment)
    if actual_size != expected_size:
        raise IntegrityError(f"{path} has {actual_size} bytes, its trailer says {expected_size}: truncated or padded")
    with open(path, "rb") as f:
        offset, size = _central_directory(f, trailer["size"], len(archive.comment))
        crc = _directory_crc(f, offset, size)
    if crc != trailer["directory_crc32"]:
        raise IntegrityError(
            f"{path}: the zip central directory is corrupt (CRC-32 {crc:#010x}, expected "
            f"{trailer['directory_crc32']:#010x})"
        )


def _check_record(path: Path, archive: zipfile.ZipFile, record: zipfile.ZipInfo) -> None:
    try:
        with archive.open(record) as stream:
            while stream.read(_READ_CHUNK):
                pass
    except zipfile.BadZipFile as error:
        raise IntegrityError(f"{path}: record {record.filename!r} is corrupt ({error})") from error
