"""The sharded format: a ``torch.distributed.checkpoint`` (DCP) directory that every rank writes its part of.

DCP's layout: one file per rank and, last, ``.metadata``; a directory without it is incomplete. On top of it, this
module adds what every checkpoint of ours carries, a record to verify it by: :class:`DirectoryWriter` writes DCP's
files itself, straight from tensor memory, computing the CRC-32 of every file and of every entry in it as it writes
(:mod:`~ignite_zero.storage.formats.dcp_files`), and the coordinator seals the directory with a manifest,
``ignite_zero.json``, listing each file with its size and checksum, and where each of its entries lies with theirs.
:func:`verify` checks a directory against its manifest, whole.

Reading goes through DCP's planning: a template names the entries a rank needs (tensors allocated from the
directory's metadata, or ``DTensor``\\ s of the rank's own shards for FSDP) and DCP fills them, resharding across world
sizes. Each entry is read straight into its tensor and checked by the manifest's record as it arrives; a directory
without manifest (another tool's) is read by DCP's own reader, unverified.
"""

from __future__ import annotations

import io
import json
import math
import os
import warnings
import zlib
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from ignite_zero import _compat
from ignite_zero.storage.formats.base import (
    ExportedTensor,
    IntegrityError,
    Reader,
    Verification,
    crc32,
    listed_object,
    tensor_entry,
    written_by,
)
from ignite_zero.storage.formats.dcp_entries import METADATA, EntryRecord, metadata_of, pack_records, unpack_records
from ignite_zero.storage.formats.dcp_files import PlaceStorageReader, PlaceStorageWriter, tensor_nbytes
from ignite_zero.storage.formats.dcp_saved import SavedTensors
from ignite_zero.storage.formats.trust import load_value
from ignite_zero.storage.places import Place, place_of

__all__ = [
    "MANIFEST",
    "DirectoryWriter",
    "DirectoryReader",
    "check_committed",
    "check_file",
    "check_unlisted",
    "file_crc",
    "is_committed",
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
_FORMAT = "ignite_zero-sharded"
# 2: each file's records a base64 table; 1 (still read): lists of five integers.
_VERSION = 2
_READ_CHUNK = 1 << 20


class DirectoryWriter(PlaceStorageWriter):
    """The writer of a sharded checkpoint directory: DCP's files, written straight from tensor memory with every
    record's CRC-32 (:class:`~ignite_zero.storage.formats.dcp_files.PlaceStorageWriter`), into a local directory or
    an object store alike.

    Args:
        place: the checkpoint directory.
        thread_count: files each rank writes, each from a thread of its own.
    """


def writer_for(place: Place, thread_count: int) -> DirectoryWriter:
    """The writer of the checkpoint directory ``place``."""
    return DirectoryWriter(place, thread_count)


class _ForeignReader(_compat.DcpFsspecReader):
    """DCP's own reader, for a directory without manifest (another tool's): through fsspec, which reads a local
    directory and a URL alike; its ``.metadata`` read through :func:`~.trust.load_metadata` (DCP's own reader
    unpickles whatever it holds)."""

    def __init__(self, place: Place, trusted: bool) -> None:
        super().__init__(str(place.location()), **(place.storage_options or {}))
        self._place = place
        self._trusted = trusted

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        where = str(self._place.location(METADATA))
        return metadata_of(self._place.read(METADATA), where, self._trusted, getattr(self, "load_id", None))


class _SafeValuesPlanner(DefaultLoadPlanner):
    """DCP's planner of a load, which unpickles the values that are no tensors with ``torch.load``: here only after
    ``torch.load(..., weights_only=True)`` took them, unless ``weights_only`` is False."""

    def __init__(self, where: str, weights_only: bool) -> None:
        super().__init__()
        self._where = where
        self._weights_only = weights_only

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        if self._weights_only:  # data alone: the load that follows builds nothing else
            load_value(value.getbuffer(), f"{self._where}, entry {read_item.dest_index.fqn}", weights_only=True)
            value.seek(0)
        super().load_bytes(read_item, value)


def is_committed(where: str | os.PathLike | Place) -> bool:
    """Whether the sharded checkpoint at ``where`` is complete: whole as its storage commits a directory (sealed by
    its manifest, where the ranks write in place), and with DCP's ``.metadata`` (which another tool's has too)."""
    place = place_of(where)
    return place.is_whole(MANIFEST) and place.is_file(METADATA)


def check_committed(place: Place) -> None:
    """Raise :class:`IntegrityError` unless ``place`` is a complete checkpoint directory (see :func:`is_committed`)."""
    if not is_committed(place):
        missing = METADATA if place.is_whole(MANIFEST) else MANIFEST
        raise IntegrityError(f"{place} is not a complete checkpoint: it has no {missing} (interrupted save?)")


def seal(
    where: Place,
    files: Mapping[str, tuple[int, int]],
    records: Mapping[str, Sequence[EntryRecord] | np.ndarray] | None = None,
    **facts: Any,
) -> None:
    """Write the manifest of a checkpoint directory, durably: every file's size and CRC-32, where each of its entries
    lies and their CRC-32 (``records``, by file, for the files that :class:`DirectoryWriter` wrote), and ``facts``."""
    listed: dict[str, Any] = {name: {"size": size, "crc32": crc} for name, (size, crc) in sorted(files.items())}
    for name, entries in (records or {}).items():
        listed[name]["records"] = pack_records(entries)
    manifest = {"format": _FORMAT, "version": _VERSION, "files": listed, **facts}
    content = json.dumps(manifest, indent=1, sort_keys=True).encode()
    where.write(MANIFEST, lambda f: f.write(content))


def read_manifest(where: str | os.PathLike | Place) -> dict[str, Any] | None:
    """The manifest of a checkpoint directory, ``None`` if it has none (written by DCP directly).

    Raises:
        IntegrityError: it is corrupt, not ignite_zero's, or lists a file without the records of its entries.
    """
    place = place_of(where)
    if not place.is_file(MANIFEST):
        return None
    try:
        manifest = json.loads(place.read(MANIFEST))
    except ValueError as error:
        raise IntegrityError(f"{place.location(MANIFEST)} is corrupt: {error}") from error
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
        raise IntegrityError(f"{place.location(MANIFEST)} is not an ignite_zero manifest")
    files = manifest.get("files")
    files = files if isinstance(files, dict) else {}
    unrecorded = sorted(
        name for name, listed in files.items() if not isinstance(listed, dict) or "records" not in listed
    )
    if not files or unrecorded:
        what = f"the records of the entries of {', '.join(unrecorded)}" if files else "the list of its files"
        raise IntegrityError(
            f"{place.location(MANIFEST)} lacks {what}, which every manifest that ignite_zero writes holds: it is "
            "corrupt or not ignite_zero's. Restore the checkpoint from a good copy, or save it again."
        )
    return manifest


def verify(where: str | os.PathLike | Place, whole: bool = True) -> dict[str, Any] | None:
    """Check a checkpoint directory against its manifest; return the manifest.

    A directory without manifest (written by ``dcp.save`` directly) passes with a warning if its ``.metadata`` is
    there; on an object store, a prefix without manifest is an uncommitted save.

    Args:
        where: the directory.
        whole: read every file for its CRC-32; else check their sizes only, for a load that checks each entry as it
            reads it.

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
    entry_records(manifest)  # where each entry lies, as a load reads it
    present = place.file_sizes()
    for name, expected in manifest["files"].items():
        check_file(place, name, expected["size"], expected["crc32"] if whole else None, present)
    check_unlisted(place, present, manifest["files"])
    return manifest


def check_file(place: Place, name: str, size: int, crc: int | None, present: Mapping[str, int]) -> None:
    """Raise :class:`IntegrityError` unless the file ``name`` of ``place`` is there with ``size`` bytes (``present``:
    the sizes of its files, from one listing) and, unless ``crc`` is ``None``, with that CRC-32, read whole."""
    if name not in present:
        raise IntegrityError(f"{place}: file {name} is missing")
    if present[name] != size:
        raise IntegrityError(f"{place}: file {name} has {present[name]} bytes, {size} expected (truncated?)")
    if crc is not None:
        found = file_crc(place, name)
        if found != crc:
            raise IntegrityError(f"{place}: file {name} is corrupt (CRC-32 {found:#010x}, {crc:#010x} expected)")


def check_unlisted(place: Place, present: Iterable[str], listed: Container[str]) -> None:
    """Raise :class:`IntegrityError` if a ``.distcp`` file of ``present`` (the files of ``place``) is not among those
    that its manifest lists."""
    unlisted = sorted(name for name in present if name.endswith(".distcp") and name not in listed)
    if unlisted:
        raise IntegrityError(f"{place}: files {unlisted} are not in its manifest")


def entry_records(manifest: Mapping[str, Any] | None) -> dict[str, list[EntryRecord]] | None:
    """Where each entry of each file lies and its CRC-32, from the manifest (see :func:`read_manifest`); ``None``
    without one (another tool's directory)."""
    if manifest is None:
        return None
    files = manifest["files"]
    try:
        tables = {name: unpack_records(listed["records"]) for name, listed in files.items()}
        sizes = {name: int(listed["size"]) for name, listed in files.items()}
    except (TypeError, ValueError, KeyError) as error:
        raise IntegrityError(f"The manifest's records are corrupt: {error}") from error
    for name, table in tables.items():
        _check_records(name, table[np.argsort(table[:, 0], kind="stable")], sizes[name])
    return {name: list(map(EntryRecord._make, table.tolist())) for name, table in tables.items()}


def _check_records(name: str, table: np.ndarray, size: int) -> None:
    """Raise :class:`IntegrityError` unless the records ``table`` (rows of :class:`EntryRecord`'s fields, by offset)
    lie within the file's ``size`` bytes, over no other, each with its data inside it."""
    offset, length, _, data_offset, _ = table.T
    end = offset + length
    previous_end = np.concatenate(([0], end[:-1]))
    outside = (offset < previous_end) | (end > size) | (length < 0)
    if outside.any():
        first = int(np.argmax(outside))
        raise IntegrityError(
            f"The manifest records an entry of {name} at [{offset[first]}, {end[first]}), outside its {size} bytes or "
            "over another entry: corrupt or forged"
        )
    no_data = (data_offset < offset) | (data_offset > end)
    if no_data.any():
        first = int(np.argmax(no_data))
        raise IntegrityError(
            f"The manifest lacks where the data of the entry of {name} at [{offset[first]}, {end[first]}) lies (it "
            f"says {data_offset[first]}, outside the entry), which every manifest that ignite_zero writes records: it "
            "is corrupt or not ignite_zero's. Restore the checkpoint from a good copy, or save it again."
        )


def file_crc(place: Place, name: str) -> int:
    """The CRC-32 of the file ``name`` of ``place``, read in chunks."""
    crc = 0
    with place.open(name) as f:
        while chunk := f.read(_READ_CHUNK):
            crc = crc32(chunk, crc)
    return crc


def read_metadata(
    where: str | os.PathLike | Place,
    records: Mapping[str, Sequence[EntryRecord]] | None = None,
    trusted: bool = False,
) -> Metadata:
    """DCP's metadata of a checkpoint directory: every entry's name, shape and dtype, and where it lies; checked by
    its CRC-32 with the manifest's ``records`` (see :func:`entry_records`), and against the sizes of the files.

    Args:
        where: the directory.
        records: the manifest's records of its entries.
        trusted: unpickle whatever ``.metadata`` holds (see :mod:`~ignite_zero.storage.formats.trust`).

    Raises:
        UnsafeCheckpointError: ``.metadata`` holds anything but DCP's metadata, unless ``trusted``.
        IntegrityError: it is corrupt, or places an entry outside its file or over another, or gives a tensor more
            bytes than its entries hold.
    """
    place = place_of(where)
    reader = _ForeignReader(place, trusted) if records is None else PlaceStorageReader(place, records, trusted)
    metadata = reader.read_metadata()
    _check_bounds(place, metadata)
    return metadata


def _check_bounds(place: Place, metadata: Metadata) -> None:
    """Sizes and offsets that ``.metadata`` gives must fit the files before anything is allocated from them: every
    entry inside its file and over no other, every tensor's chunks within the tensor and their entries."""
    sizes = place.file_sizes()
    where = place.location(METADATA)
    spans: dict[str, list[tuple[int, int, str]]] = {}
    # each entry's length by its name and offsets, what DCP's MetadataIndex compares: a tuple hashes and compares at a
    # fraction of that dataclass's cost, paid for each of thousands of entries
    lengths: dict[tuple[str, Sequence[int] | None], int] = {}
    for index, info in metadata.storage_data.items():
        offset, length, path = info.offset, info.length, info.relative_path
        # a file this host lacks (one host's directory of a replicated checkpoint) bounds nothing here: it is read
        # from where it lies, or a load that needs it fails
        size = sizes.get(path, offset + length)
        if offset < 0 or length < 0 or offset + length > size:
            raise IntegrityError(
                f"{where} places entry {index.fqn} at [{offset}, {offset + length}) of {path}, which has {size} "
                "bytes: corrupt or forged"
            )
        spans.setdefault(path, []).append((offset, offset + length, index.fqn))
        lengths[(index.fqn, index.offset)] = length  # a torch.Size, as a tuple; None for an object
    for name, found in spans.items():
        found.sort()
        for (_, end, first), (start, _, second) in zip(found, found[1:]):
            if start < end:
                raise IntegrityError(f"{where} places entries {first} and {second} of {name} over each other")
    for fqn, storage in metadata.state_dict_metadata.items():
        if not isinstance(storage, TensorStorageMetadata):
            continue
        itemsize = storage.properties.dtype.itemsize
        held = 0
        for chunk in storage.chunks:
            entry_length = lengths.get((fqn, tuple(chunk.offsets)))
            inside = all(
                0 <= offset and 0 <= length and offset + length <= extent
                for offset, length, extent in zip(chunk.offsets, chunk.sizes, storage.size)
            )
            nbytes = math.prod(chunk.sizes) * itemsize
            if entry_length is None or not inside or len(chunk.sizes) != len(storage.size) or nbytes > entry_length:
                raise IntegrityError(f"{where}: a chunk of tensor {fqn} lies outside it or its entry (corrupt, forged)")
            held += nbytes
        if any(extent < 0 for extent in storage.size) or math.prod(storage.size) * itemsize > held:
            raise IntegrityError(f"{where}: tensor {fqn} claims more bytes than its chunks hold: corrupt or forged")


def path_of(metadata: Metadata, name: str) -> tuple[Any, ...]:
    """The path of a flattened entry in the nested state it was saved from (``("optimizer", "state", "3", ...)``)."""
    return _compat.dcp_entry_path(metadata, name)


def name_of(path: tuple[Any, ...]) -> str:
    """The name under which DCP saves the entry at ``path`` of a nested state."""
    return ".".join(map(str, path))


def template(metadata: Metadata, keep: Callable[[tuple[Any, ...]], bool], unread: bool = False) -> dict[str, Any]:
    """A flat template to read the entries whose path ``keep`` accepts: tensors allocated from the metadata (read
    whole, whatever the sharding they were saved with), ``None`` for other values. ``unread``: the tensors on the meta
    device instead, for a reader to read when they are taken (:class:`~.dcp_saved.SavedTensor`)."""
    flat: dict[str, Any] = {}
    device = "meta" if unread else "cpu"
    for name, storage in metadata.state_dict_metadata.items():
        if not keep(path_of(metadata, name)):
            continue
        if isinstance(storage, TensorStorageMetadata):
            flat[name] = torch.empty(storage.size, dtype=storage.properties.dtype, device=device)
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


def load(
    state: dict[str, Any],
    where: str | os.PathLike | Place,
    records: Mapping[str, Sequence[EntryRecord]] | None = None,
    trusted: bool = False,
) -> None:
    """Fill ``state`` (flat template entries and nested ``DTensor`` states alike) from a checkpoint directory.

    Local: every rank reads what its own template names (on an object store, with ranged reads), so ranks need no
    collective to load. With the manifest's ``records`` (see :func:`entry_records`), each entry is read straight into
    place and checked as it arrives; without (another tool's directory), DCP's own reader reads the files. Values
    that are no tensors are read as ``torch.load(..., weights_only=True)`` reads them, unless ``trusted``.

    Raises:
        IntegrityError: an entry read is corrupt or truncated.
        UnsafeCheckpointError: ``.metadata`` or a value holds anything but data, unless ``trusted``.
    """
    place = place_of(where)
    reader = _ForeignReader(place, trusted) if records is None else PlaceStorageReader(place, records, trusted)
    planner = _SafeValuesPlanner(str(place.location()), weights_only=not trusted)
    try:
        with in_one_process():  # each rank reads its own
            dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
    except CheckpointException as error:  # DCP wraps every failure of a rank: what went wrong, as it was raised
        raise next(iter(error.failures.values()))[0] from None


@contextmanager
def in_one_process() -> Iterator[None]:
    """Without DCP's warning that it assumes one process: where that is intended (``no_dist=True``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (load|save) in a single process")
        yield


class DirectoryReader(Reader):
    """A sharded checkpoint directory: its identity is the checksum of its manifest.

    Every rank reads only what it needs: FSDP ranks their own shards into templates of them, ZeRO ranks the state of
    the parameters they own, and every rank the objects it holds whole.

    Args:
        place: the directory.
    """

    ext = "dcp"
    is_directory = True
    sharded = True

    def __init__(self, place: Place) -> None:
        self.place = place
        self.path = place.location()
        self._saved: SavedTensors | None = None

    def close(self) -> None:
        if self._saved is not None:
            self._saved.close()
            self._saved = None

    def modified(self) -> float:
        # the manifest is written last (and a prefix of an object store has no time of its own); another tool's
        # directory has none
        return self.place.modified(MANIFEST if self.place.is_file(MANIFEST) else "")

    def identity(self) -> tuple[Any, ...] | None:
        if not self.place.exists():
            return None
        check_committed(self.place)
        manifest = self.place.read(MANIFEST) if self.place.is_file(MANIFEST) else None
        return ("sharded", None if manifest is None else zlib.crc32(manifest))

    @classmethod
    def at(cls, place: Place, name: str) -> DirectoryReader:
        return cls(place.child(name))

    def exists(self) -> bool:
        return self.place.exists()

    def verify(self, whole: bool = True) -> Verification:
        manifest = verify(self.place, whole)  # not whole: a load checks each entry it reads as it reads it
        if manifest is None:
            return Verification(False, "manifest", "written by another tool")
        checked = (
            "sizes and CRC-32 match the manifest" if whole else "sizes match the manifest; entries checked as read"
        )
        return Verification(True, "manifest", f"{len(manifest['files'])} files, {checked}", manifest)

    def load(self, weights_only: bool, progress: Callable[[int, int], None] | None = None) -> Any:
        """Every entry of the directory, read whole, nested as saved, with dict keys as DCP saves them: strings
        (:mod:`ignite_zero.loading.whole` keys optimizer state by index again). DCP reads the values that are no
        tensors as it saved them, ``weights_only`` or not."""
        records = self.records()
        if records is None:
            verify(self.place)
        trusted = self.trusted or not weights_only
        metadata = read_metadata(self.place, records, trusted)
        names = list(metadata.state_dict_metadata)
        sizes = {name: tensor_nbytes(metadata.state_dict_metadata[name]) for name in names}
        total, done = sum(sizes.values()), 0
        flat: dict[str, Any] = {}
        for batch in _batches(names, sizes):  # the whole state is held at the end; batches only show progress
            wanted = set(batch)

            def keep(path: tuple[Any, ...], wanted: set[str] = wanted) -> bool:
                return name_of(path) in wanted

            part = template(metadata, keep)
            load(part, self.place, records, trusted)
            flat.update(part)
            done += sum(sizes[name] for name in batch)
            if progress is not None:
                progress(done, total)
        return nest(metadata, flat)

    def saved_tensors(self, records: Mapping[str, Sequence[EntryRecord]], metadata: Metadata) -> SavedTensors:
        """The directory's entries, read without DCP's planning, with the manifest's ``records``: open until
        :meth:`close`."""
        if self._saved is None:
            self._saved = SavedTensors(self.place, records, metadata)
        return self._saved

    def records(self) -> dict[str, list[EntryRecord]] | None:
        """Where every entry lies and its CRC-32, from the manifest, for reads checked as they arrive; ``None``
        without manifest (another tool's directory, read unverified)."""
        return entry_records(read_manifest(self.place))

    def listing(self) -> dict[str, Any]:
        manifest = read_manifest(self.place)
        metadata = read_metadata(self.place, trusted=self.trusted)
        files = [name for name, is_directory in self.place.entries().items() if not is_directory]
        by_object: dict[str, list[dict[str, Any]]] = {}
        for name, storage in metadata.state_dict_metadata.items():
            entry_path = path_of(metadata, name)
            key = ".".join(map(str, entry_path[1:]))
            if isinstance(storage, TensorStorageMetadata):
                shards = len(storage.chunks)
                entry = {**tensor_entry(key, storage.properties.dtype, tuple(storage.size)), "shards": shards}
            else:
                entry = {"key": key, "kind": "value"}  # not read: a listing reads the metadata only
            by_object.setdefault(str(entry_path[0]), []).append(entry)
        return {
            "schema": 1,
            "path": str(self.path),
            "format": "sharded",
            "files": len(files),
            "bytes": sum(self.place.size(name) for name in files),
            "written_by": written_by(manifest),
            "objects": [listed_object(name, None, entries) for name, entries in by_object.items()],
        }

    def tensors(self, only: str) -> tuple[list[ExportedTensor], dict[str, str]]:
        records = self.records()
        metadata = read_metadata(self.place, records, self.trusted)
        found = []
        for flat_name, storage in metadata.state_dict_metadata.items():
            path = path_of(metadata, flat_name)
            if path[:1] != (only,) or not isinstance(storage, TensorStorageMetadata):
                continue
            dtype = storage.properties.dtype

            def read(flat_name: str = flat_name, storage: Any = storage, dtype: torch.dtype = dtype) -> Any:
                wanted = {flat_name: torch.empty(storage.size, dtype=dtype)}
                load(wanted, self.place, records, self.trusted)  # this tensor alone, from every file holding a part
                return wanted[flat_name]

            found.append(ExportedTensor(".".join(map(str, path[1:])), dtype, tuple(storage.size), read))
        if not found:
            raise KeyError(f"The checkpoint {self.path} has no tensors under {only!r}; pass --only with another entry")
        return found, {}


# What a consolidation reads at a time: the whole state is held at the end, but progress shows batch by batch.
_BATCH_BYTES = 256 * 2**20


def _batches(names: list[str], sizes: Mapping[str, int]) -> Iterator[list[str]]:
    batch: list[str] = []
    held = 0
    for name in names:
        batch.append(name)
        held += sizes[name]
        if held >= _BATCH_BYTES:
            yield batch
            batch, held = [], 0
    if batch:
        yield batch
