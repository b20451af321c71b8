"""The integrity trailer of a checkpoint file: written with the file, read back.

``torch.save`` writes a zip archive and computes the CRC-32 of every record while it writes (torch itself
never checks them when loading). :class:`SealingStream` passes what ``torch.save`` writes on to the file, computes
the CRC-32 of the central directory (which holds every record's CRC-32, size and offset) as it passes, and, once
``torch.save`` returns, ends the archive with a small JSON trailer as its comment: the archive's size, that CRC-32,
the CRC-32 of every block of the records (:class:`Blocks`, which check reads of parts of records) and facts for
``ignite-zero inspect`` (world size, versions). Sealing never reads back nor seeks, so it works on
streams that cannot (an upload to an object store) and costs no extra pass over the data; the comment is part of
the zip format, so plain ``torch.load`` (``weights_only``, ``mmap``) and stock ignite load the file unchanged.
:func:`read_trailer` reads it back from the end of the file.
"""

from __future__ import annotations

import base64
import concurrent.futures
import functools
import json
import os
import struct
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from zlib_ng import zlib_ng

from ignite_zero import _compat
from ignite_zero.storage.formats.base import IntegrityError

__all__ = [
    "Blocks",
    "SealingStream",
    "Stored",
    "as_stored",
    "check_end",
    "central_directory",
    "is_legacy_format",
    "parse_trailer",
    "read_trailer",
    "write_sealed",
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
# Blocks start at 64 KiB and double while there are more than 8192 of them: the table (base64, 44 KiB at most) must
# fit the 64 KiB zip comment, and a rank reading part of a tensor reads at most one block beyond each end of it.
_FIRST_BLOCK = 64 << 10
_MAX_BLOCKS = 8192
_IN_THREAD = 1 << 20  # writes from this size on have their blocks summed in another thread


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


def as_stored(source: str | os.PathLike | Stored) -> Stored:
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
    def from_json(cls, value: Any, source: object) -> Blocks:
        """The blocks that the trailer of the file ``source`` lists (``value``, its ``blocks``).

        Raises:
            IntegrityError: the trailer lists none, or not as many as the records' bytes take.
        """
        if not isinstance(value, dict):
            raise IntegrityError(
                f"{source}: its trailer lacks the CRC-32 of the blocks of its records, which every trailer that "
                "ignite_zero writes holds: it is corrupt or not ignite_zero's. Restore the file from a good copy, or "
                "save it again."
            )
        packed = base64.b64decode(value["crc32"])
        blocks = cls(int(value["size"]), int(value["end"]), struct.unpack(f">{len(packed) // 4}L", packed))
        if len(blocks.crc32) != -(-blocks.end // blocks.size):
            raise IntegrityError(
                f"{source}: its trailer lists {len(blocks.crc32)} blocks for {blocks.end} bytes: it is corrupt"
            )
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
        # records) are summed in another thread while the bytes are passed on, since both release the GIL; smaller
        # ones (slices of our own writer's records) right after they are passed on, from the CPU's cache, where the
        # write's copy left them (see torch_zip's _SLICE).
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


def write_sealed(f: IO[bytes], write: Callable[[IO[bytes]], object], facts: Mapping[str, Any] | None) -> None:
    """Write a checkpoint to ``f`` with ``write`` (``torch.save`` given a stream, or a writer of its archive) through
    a :class:`SealingStream`, then seal it with ``facts``; ``None``: a file in torch's legacy format, no zip,
    passed on as it was.

    Raises:
        Exception: the first error a write to ``f`` raised (no space left, an I/O error), where ``write`` raised
            its own instead.
    """
    stream = SealingStream(f)
    with _compat.serialization_crc32():
        try:
            write(stream)  # type: ignore[arg-type]
        except Exception as error:
            if stream.error is not None:  # the real cause, e.g. ENOSPC or EIO, instead of torch's summary
                raise stream.error from error
            raise
    if facts is None:
        stream.finish()
    else:
        stream.seal(**facts)


def is_legacy_format(source: str | os.PathLike | Stored) -> bool:
    """Whether ``source`` holds torch's legacy format (``torch.save(..., _use_new_zipfile_serialization=False)``): a
    pickle stream rather than a zip archive, with no room for a trailer, and not loadable with ``mmap``."""
    with as_stored(source).open() as f:
        return f.read(1) == b"\x80"  # pickle's PROTO opcode; a zip archive starts with "PK"


def read_trailer(source: str | os.PathLike | Stored) -> dict[str, Any] | None:
    """The trailer of a sealed checkpoint file, ``None`` for a file written by something else.

    Reads the end of the file only (on an object store: a ranged read).

    Raises:
        IntegrityError: the file is not a readable zip archive (truncated, or not a torch file).
    """
    stored = as_stored(source)
    try:
        with stored.open() as f:
            if f.read(1) == b"\x80":  # the legacy format
                return None
            f.seek(0)
            with zipfile.ZipFile(f) as archive:
                return parse_trailer(archive.comment)
    except (zipfile.BadZipFile, OSError) as error:
        raise IntegrityError(
            f"{stored} is not a complete checkpoint file ({error}): truncated or not written by torch.save"
        ) from error


def parse_trailer(comment: bytes) -> dict[str, Any] | None:
    try:
        trailer = json.loads(comment)
    except ValueError:
        return None
    if not isinstance(trailer, dict) or trailer.get("format") != _FORMAT:
        return None
    return trailer


def central_directory(f: IO[bytes], end: int, comment_length: int) -> tuple[int, int]:
    """Offset and size of the central directory of the zip archive whose end record stops at ``end``."""
    start = max(0, end - _ENDING)
    f.seek(start)
    ending = f.read(end - start)
    signature, *_, size, offset, found_length = _EOCD.unpack(ending[-_EOCD.size :])
    if signature != _EOCD_SIGNATURE or found_length != comment_length:
        raise IntegrityError("no zip end record where expected")
    return _directory_location(ending[:-2] + b"\0\0", end)


def check_end(stored: Stored, f: IO[bytes], size: int) -> None:
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
