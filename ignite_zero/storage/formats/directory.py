"""The sharded format: a ``torch.distributed.checkpoint`` (DCP) directory that every rank writes its part of.

DCP writes one file per rank and, last, ``.metadata``; a directory without it is incomplete. On top of DCP, this
module adds what every checkpoint of ours carries, a record to verify it by: every file's CRC-32 is computed while
it is written (a stream that passes the bytes through, :class:`ChecksummingWriter`), and the coordinator seals the
directory with a manifest, ``ignite_zero.json``, listing each file with its size and checksum. :func:`verify`
checks a directory against its manifest.

Reading goes through DCP too: a template names the entries a rank needs (tensors allocated from the directory's
metadata, or ``DTensor``\\ s of the rank's own shards for FSDP) and DCP fills them, resharding across world sizes.
"""

from __future__ import annotations

import io
import json
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from zlib_ng import zlib_ng

from ignite_zero import _compat
from ignite_zero.integrity import IntegrityError
from ignite_zero.storage.places import Place, RemotePlace, place_of

__all__ = [
    "MANIFEST",
    "ChecksummingWriter",
    "UNCOMMITTED",
    "check_committed",
    "crc32",
    "is_committed",
    "is_sharded_checkpoint",
    "writer_for",
    "load",
    "name_of",
    "nest",
    "path_of",
    "read_manifest",
    "in_one_process",
    "read_metadata",
    "seal",
    "template",
    "verify",
]

#: The manifest that seals a sharded checkpoint directory: each file's size and CRC-32.
MANIFEST = "ignite_zero.json"
#: On an object store, where ranks write into the checkpoint's own prefix: the mark of a save not yet sealed, which
#: tells the next save that the prefix is an interrupted save of ours (and not another tool's checkpoint).
UNCOMMITTED = ".ignite_zero-uncommitted"
_METADATA = ".metadata"
_FORMAT = "ignite_zero-sharded"
_READ_CHUNK = 1 << 20
# Each slice of a write is checksummed right after the copy into the file, while it is still in the CPU's cache:
# the CRC-32 of 320 MB of tensors written to tmpfs added 1-11 ms to 105-150 ms of writing in 256 KiB slices,
# 22-40 ms over DCP's whole writes (8 MB each) on the 2-core CI machine, where reading memory bounds it (~10 GB/s).
_WRITE_SLICE = 256 << 10


def crc32(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """zlib's CRC-32 of ``data``, continuing from ``value`` (the CRC-32 of what came before): the very same values.

    zlib-ng's SIMD CRC-32 rather than the standard library's: 9-33 GB/s against 2-7 GB/s for zlib over 600 MB, and
    59 against 3 GB/s over 256 KiB in cache (2-core CI machine). At zlib's speed, checksumming each rank's 300 MB
    took 0.05-0.2 s per save (FSDP2, 0.6 GB, 2 ranks), most of the 0.08 s a sharded save took beyond ``dcp.save``'s
    0.28 s. ISA-L (``isal``) is as fast within a save; zlib-ng also builds from source wherever a C compiler does.
    Like zlib, it releases the GIL for buffers over 5 KiB (DCP writes from threads) and takes buffers over 4 GiB.
    """
    return zlib_ng.crc32(data, value)


class _ChecksummingStream(io.RawIOBase):
    """Passes writes to a file, computing their CRC-32 on the way."""

    def __init__(self, stream: Any) -> None:
        super().__init__()
        self._stream = stream
        self.crc = 0
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, view.nbytes, _WRITE_SLICE):
            piece = view[start : start + _WRITE_SLICE]
            self._stream.write(piece)  # a buffered file: writes all of it, or raises
            self.crc = crc32(piece, self.crc)
        self.size += view.nbytes
        return view.nbytes

    def tell(self) -> int:
        return self._stream.tell()

    def flush(self) -> None:
        self._stream.flush()

    def fileno(self) -> int:
        return self._stream.fileno()


class _ChecksummingFileSystem:
    """The file system of a DCP writer, recording the size and CRC-32 of every file written through it.

    Args:
        inner: the writer's own file system (local, or fsspec's), which does the rest.
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.written: dict[str, tuple[int, int]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        with self._inner.create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            checksumming = _ChecksummingStream(stream)
            yield checksumming
        self.written[_base_name(path)] = (checksumming.size, checksumming.crc)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        self._inner.rename(path, new_path)
        record = self.written.pop(_base_name(path), None)
        if record is not None:  # `.metadata` is written as `.metadata.tmp`, then renamed
            self.written[_base_name(new_path)] = record

    def init_path(self, path: str | os.PathLike, **kwargs: Any) -> str | os.PathLike:
        if getattr(self._inner, "fs", None) is not None:
            # fsspec's would make a new client from the URL alone (on `reset`), without the storage options: one
            # that may talk to another endpoint than the one configured. The client stays.
            return path
        return self._inner.init_path(path, **kwargs)


def _base_name(path: str | os.PathLike) -> str:
    return os.fspath(path).rstrip("/").rsplit("/", 1)[-1]


class _Staging:
    """Host copies of an asynchronous save, kept and reused from one save to the next when caching."""

    cache_staged_state_dict: bool
    _copies: Any = None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A host copy of ``state_dict`` for an asynchronous save; kept and reused when caching, pinned only where
        an accelerator can pin it."""
        if not self.cache_staged_state_dict:
            return super().stage(state_dict)  # type: ignore[misc]
        create, copy = _compat.dcp_host_copies()
        if self._copies is not None:
            try:
                return copy(state_dict, self._copies)
            except (KeyError, RuntimeError):  # another layout than last time: new copies
                self._copies = None
        self._copies = create(state_dict, pin_memory=torch.cuda.is_available())
        return copy(state_dict, self._copies)

    @property
    def written(self) -> dict[str, tuple[int, int]]:
        """Each file written: its name, size and CRC-32."""
        return self._files.written  # type: ignore[attr-defined]


class ChecksummingWriter(_Staging, FileSystemWriter):
    """DCP's ``FileSystemWriter``, also recording each file it writes: :attr:`written` maps its name to its size
    and CRC-32.

    Args:
        path: the checkpoint directory.
        thread_count: threads writing this rank's files.
        cache_staged_state_dict: keep the host copies of an asynchronous save for the next one.
    """

    def __init__(self, path: str | os.PathLike, thread_count: int = 1, cache_staged_state_dict: bool = False) -> None:
        super().__init__(path, thread_count=thread_count, cache_staged_state_dict=cache_staged_state_dict)
        self._files = _ChecksummingFileSystem(_compat.dcp_file_system(self))
        _compat.set_dcp_file_system(self, self._files)


class ChecksummingFsspecWriter(_Staging, _compat.DcpFsspecWriter):
    """DCP's ``FsspecWriter`` (any fsspec URL), checksumming as :class:`ChecksummingWriter` does.

    Args:
        place: the checkpoint's prefix.
        thread_count: threads writing this rank's files.
        cache_staged_state_dict: keep the host copies of an asynchronous save for the next one.
    """

    def __init__(self, place: RemotePlace, thread_count: int = 1, cache_staged_state_dict: bool = False) -> None:
        # Nothing to fsync: an object exists once its upload is complete. (DCP falls back to `os.sync()` of the
        # whole host for streams without a file descriptor.)
        super().__init__(place.url, thread_count=thread_count, sync_files=False, **place.storage_options)
        self.cache_staged_state_dict = cache_staged_state_dict  # FsspecWriter takes no argument for it
        self._files = _ChecksummingFileSystem(_compat.dcp_file_system(self))
        _compat.set_dcp_file_system(self, self._files)


def writer_for(place: Place, thread_count: int, cache_staged_state_dict: bool = False) -> Any:
    """The checksumming DCP writer of the checkpoint directory ``place``."""
    if isinstance(place, RemotePlace):
        return ChecksummingFsspecWriter(place, thread_count, cache_staged_state_dict)
    return ChecksummingWriter(place.location(), thread_count, cache_staged_state_dict)


def _reader_of(place: Place) -> FileSystemReader:
    if isinstance(place, RemotePlace):
        return _compat.DcpFsspecReader(place.url, **place.storage_options)
    return FileSystemReader(place.location())


def is_sharded_checkpoint(where: str | os.PathLike | Place) -> bool:
    """Whether ``where`` is a complete DCP checkpoint directory (its ``.metadata`` written)."""
    return place_of(where).is_file(_METADATA)


def is_committed(where: str | os.PathLike | Place) -> bool:
    """Whether the sharded checkpoint at ``where`` is complete: sealed, on an object store (where its ranks write in
    place); with its ``.metadata``, locally (where it is renamed into place once sealed, or written by another
    tool)."""
    place = place_of(where)
    return place.is_file(MANIFEST) if place.remote else place.is_file(_METADATA)


def check_committed(place: Place) -> None:
    """Raise :class:`IntegrityError` unless ``place`` is a complete checkpoint directory (see :func:`is_committed`)."""
    if not is_committed(place):
        missing = MANIFEST if place.remote else _METADATA
        raise IntegrityError(f"{place} is not a complete checkpoint: it has no {missing} (interrupted save?)")


def seal(where: Place, files: Mapping[str, tuple[int, int]], **facts: Any) -> None:
    """Write the manifest of a checkpoint directory, durably: every file's size and CRC-32, and ``facts``."""
    manifest = {
        "format": _FORMAT,
        "version": 1,
        "files": {name: {"size": size, "crc32": crc} for name, (size, crc) in sorted(files.items())},
        **facts,
    }
    content = json.dumps(manifest, indent=1, sort_keys=True).encode()
    where.write(MANIFEST, lambda f: f.write(content))


def read_manifest(where: str | os.PathLike | Place) -> dict[str, Any] | None:
    """The manifest of a checkpoint directory, ``None`` if it has none (written by DCP directly)."""
    place = place_of(where)
    if not place.is_file(MANIFEST):
        return None
    try:
        manifest = json.loads(place.read(MANIFEST))
    except ValueError as error:
        raise IntegrityError(f"{place.location(MANIFEST)} is corrupt: {error}") from error
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
        raise IntegrityError(f"{place.location(MANIFEST)} is not an ignite_zero manifest")
    return manifest


def verify(where: str | os.PathLike | Place) -> dict[str, Any] | None:
    """Check a checkpoint directory against its manifest; return the manifest.

    A directory without manifest (written by ``dcp.save`` directly) passes with a warning if its ``.metadata`` is
    there; on an object store, a prefix without manifest is an uncommitted save.

    Raises:
        IntegrityError: naming the directory and what differs: an incomplete directory, a missing, truncated or
            corrupt file.
    """
    place = place_of(where)
    check_committed(place)
    manifest = read_manifest(place)
    if manifest is None:
        warnings.warn(
            f"{place} carries no ignite_zero manifest (written by another tool); loading it without verification.",
            stacklevel=3,
        )
        return None
    present = place.entries()
    for name, expected in manifest["files"].items():
        if name not in present or present[name]:
            raise IntegrityError(f"{place}: file {name} is missing")
        size = place.size(name)
        if size != expected["size"]:
            raise IntegrityError(f"{place}: file {name} has {size} bytes, {expected['size']} expected (truncated?)")
        crc = _file_crc(place, name)
        if crc != expected["crc32"]:
            raise IntegrityError(
                f"{place}: file {name} is corrupt (CRC-32 {crc:#010x}, {expected['crc32']:#010x} expected)"
            )
    unlisted = sorted(name for name in present if name.endswith(".distcp") and name not in manifest["files"])
    if unlisted:
        raise IntegrityError(f"{place}: files {unlisted} are not in its manifest")
    return manifest


def _file_crc(place: Place, name: str) -> int:
    crc = 0
    with place.open(name) as f:
        while chunk := f.read(_READ_CHUNK):
            crc = crc32(chunk, crc)
    return crc


def read_metadata(where: str | os.PathLike | Place) -> Metadata:
    """DCP's metadata of a checkpoint directory: every entry's name, shape and dtype, and where it lies."""
    return _reader_of(place_of(where)).read_metadata()


def path_of(metadata: Metadata, name: str) -> tuple[Any, ...]:
    """The path of a flattened entry in the nested state it was saved from (``("optimizer", "state", "3", ...)``)."""
    return _compat.dcp_entry_path(metadata, name)


def name_of(path: tuple[Any, ...]) -> str:
    """The name under which DCP saves the entry at ``path`` of a nested state."""
    return ".".join(map(str, path))


def template(metadata: Metadata, keep: Callable[[tuple[Any, ...]], bool]) -> dict[str, Any]:
    """A flat template to read the entries whose path ``keep`` accepts: tensors allocated from the metadata (read
    whole, whatever the sharding they were saved with), ``None`` for other values."""
    flat: dict[str, Any] = {}
    for name, storage in metadata.state_dict_metadata.items():
        if not keep(path_of(metadata, name)):
            continue
        if isinstance(storage, TensorStorageMetadata):
            flat[name] = torch.empty(storage.size, dtype=storage.properties.dtype)
        elif isinstance(storage, BytesStorageMetadata):
            flat[name] = None
    return flat


def nest(metadata: Metadata, flat: Mapping[str, Any]) -> dict[str, Any]:
    """The nested state that flat entries read with a :func:`template` came from (dict keys as strings, list
    indices as positions)."""
    nested: dict[str, Any] = {}
    for name, value in flat.items():
        path = path_of(metadata, name)
        node: Any = nested
        for step, following in zip(path[:-1], path[1:]):
            if isinstance(node, list):
                while len(node) <= step:
                    node.append(None)
                if node[step] is None:
                    node[step] = [] if isinstance(following, int) else {}
                node = node[step]
            else:
                node = node.setdefault(step, [] if isinstance(following, int) else {})
        if isinstance(node, list):
            while len(node) <= path[-1]:
                node.append(None)
            node[path[-1]] = value
        else:
            node[path[-1]] = value
    return nested


def load(state: dict[str, Any], where: str | os.PathLike | Place) -> None:
    """Fill ``state`` (flat template entries and nested ``DTensor`` states alike) from a checkpoint directory.

    Local: every rank reads what its own template names (on an object store, with ranged reads), so ranks need no
    collective to load.
    """
    with in_one_process():  # each rank reads its own
        dcp.load(state, storage_reader=_reader_of(place_of(where)), no_dist=True)


@contextmanager
def in_one_process() -> Iterator[None]:
    """Without DCP's warning that it assumes one process: where that is intended (``no_dist=True``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (load|save) in a single process")
        yield
