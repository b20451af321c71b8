"""The sharded format: a ``torch.distributed.checkpoint`` (DCP) directory that every rank writes its part of.

DCP's layout: one file per rank and, last, ``.metadata``; a directory without it is incomplete. On top of it, this
module adds what every checkpoint of ours carries, a record to verify it by: :class:`DirectoryWriter` writes DCP's
files itself, straight from tensor memory, computing the CRC-32 of every file and of every entry in it as it writes
(:mod:`~ignite_zero.storage.formats.dcp_files`), and the coordinator seals the directory with a manifest,
``ignite_zero.json``, listing each file with its size and checksum, and where each of its entries lies with theirs.
:func:`verify` checks a directory against its manifest, whole.

Beside ``.metadata``, the coordinator writes the index of the entries (:class:`~.dcp_index.EntryIndex`, a file the
manifest seals as the others): what a load needs of ``.metadata``, as plain data. A template names the entries a
rank needs (tensors allocated from the index, or ``DTensor``\\ s of the rank's own shards for FSDP): where each is
one saved chunk it is read straight into place (:class:`~.dcp_saved.SavedTensors`); else DCP's planning fills them,
resharding across world sizes. Each entry is checked by the manifest's record as it arrives; a directory without
manifest (another tool's) is read by DCP's own reader, unverified.
"""

from __future__ import annotations

import io
import json
import os
import warnings
import zlib
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata

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
from ignite_zero.storage.formats.dcp_entries import (
    INDEX,
    METADATA,
    EntryRecord,
    metadata_of,
    pack_records,
    read_recorded_file,
    unpack_records,
)
from ignite_zero.storage.formats.dcp_files import PlaceStorageReader, PlaceStorageWriter
from ignite_zero.storage.formats.dcp_index import EntryIndex, TensorLayout
from ignite_zero.storage.formats.dcp_saved import SavedTensors
from ignite_zero.storage.formats.trust import load_value
from ignite_zero.storage.places import Place, place_of

__all__ = [
    "MANIFEST",
    "Contents",
    "DirectoryWriter",
    "DirectoryReader",
    "check_committed",
    "check_file",
    "check_unlisted",
    "file_crc",
    "is_committed",
    "writer_for",
    "load",
    "load_whole",
    "name_of",
    "nest",
    "read_contents",
    "read_manifest",
    "in_one_process",
    "seal",
    "template",
    "verify",
]

#: The manifest that seals a sharded checkpoint directory: each file's size and CRC-32.
MANIFEST = "ignite_zero.json"
_FORMAT = "ignite_zero-sharded"
# 3: lists the index of the entries (ignite_zero_index.json); 2 (still read, indexed from .metadata): each file's
# records a base64 table; 1 (still read): lists of five integers.
_VERSION = 3
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
    unpickles whatever it holds), once (see :meth:`PlaceStorageReader.read_metadata
    <.dcp_files.PlaceStorageReader.read_metadata>`)."""

    def __init__(self, place: Place, trusted: bool) -> None:
        super().__init__(str(place.location()), **(place.storage_options or {}))
        self._place = place
        self._trusted = trusted
        self._metadata: Metadata | None = None
        self.entry_index: EntryIndex | None = None  # once read_metadata() read them

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            content = self._place.read(METADATA)
            read = metadata_of(content, self._place, self._trusted, getattr(self, "load_id", None))
            self._metadata, self.entry_index = read
        return self._metadata


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
    return _verified(place_of(where), whole)[0]


def _verified(place: Place, whole: bool) -> tuple[dict[str, Any] | None, Contents | None]:
    """:func:`verify`: the manifest, and what it says the directory holds where it has the index of the entries."""
    check_committed(place)
    manifest = read_manifest(place)
    if manifest is None:
        warnings.warn(  # the caller of verify, or of DirectoryReader.verify
            f"{place} carries no ignite_zero manifest (written by another tool); loading it without verification.",
            stacklevel=3,
        )
        return None, None
    records = entry_records(manifest)  # where each entry lies, as a load reads it
    assert records is not None
    present = place.file_sizes()
    for name, expected in manifest["files"].items():
        check_file(place, name, expected["size"], expected["crc32"] if whole else None, present)
    check_unlisted(place, present, manifest["files"])
    contents = Contents(records, _checked_index(place, records, present)) if INDEX in records else None
    return manifest, contents


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


class Contents(NamedTuple):
    """What a checkpoint directory holds, as its manifest says (without one, its ``.metadata``)."""

    #: where each entry of each file lies and its CRC-32 (see :func:`entry_records`); ``None`` without manifest
    records: dict[str, list[EntryRecord]] | None
    #: every entry's path, each tensor's dtype, shape and chunks, and where each lies
    entry_index: EntryIndex


def read_contents(where: str | os.PathLike | Place, trusted: bool = False) -> Contents:
    """What the checkpoint directory ``where`` holds: the manifest's records and the index of the entries, their
    sizes and offsets checked against the files. A directory whose manifest lists no index (written before it) or
    without manifest (another tool's) is indexed from its ``.metadata``.

    Args:
        where: the directory.
        trusted: unpickle whatever ``.metadata`` holds, where it is read (see
            :mod:`~ignite_zero.storage.formats.trust`).

    Raises:
        UnsafeCheckpointError: ``.metadata``, where it is read, holds anything but DCP's metadata, unless ``trusted``.
        IntegrityError: the manifest or ``.metadata`` is corrupt, places an entry outside its file or over another,
            or gives a tensor more bytes than its entries hold.
    """
    place = place_of(where)
    manifest = read_manifest(place)
    records = entry_records(manifest)
    if records is None or INDEX not in records:
        reader = _ForeignReader(place, trusted) if records is None else PlaceStorageReader(place, records, trusted)
        reader.read_metadata()
        assert reader.entry_index is not None
        return Contents(records, reader.entry_index)
    return Contents(records, _checked_index(place, records, place.file_sizes()))


def _checked_index(
    place: Place, records: Mapping[str, Sequence[EntryRecord]], file_sizes: Mapping[str, int]
) -> EntryIndex:
    """The index of the entries of ``place``, read from its file and checked by the manifest's ``records``, its sizes
    and offsets against the files' sizes (``file_sizes``).

    Raises:
        IntegrityError: it is truncated or corrupt, or its sizes and offsets do not fit the files.
    """
    content = read_recorded_file(place, INDEX, next(iter(records[INDEX]), None))
    where = str(place.location(INDEX))
    try:
        index = EntryIndex.parse(content, sum(map(len, records.values())))
        unlisted = sorted(set(index.files) - set(records))
        if unlisted:
            raise ValueError(f"it places entries in {unlisted}, which the manifest does not list")
    except (ValueError, RecursionError) as error:  # RecursionError: JSON nested too deep for the parser
        raise IntegrityError(
            f"{where}: the index of the entries is corrupt ({error}). Restore the checkpoint from a good copy, or save "
            "it again."
        ) from None
    index.check_bounds(file_sizes, where)
    return index


def name_of(path: tuple[Any, ...]) -> str:
    """The name under which DCP saves the entry at ``path`` of a nested state."""
    return ".".join(map(str, path))


def template(index: EntryIndex, keep: Callable[[tuple[Any, ...]], bool], unread: bool = False) -> dict[str, Any]:
    """A flat template to read the entries whose path ``keep`` accepts: tensors allocated from the index (read whole,
    whatever the sharding they were saved with), ``None`` for other values. ``unread``: the tensors on the meta
    device instead, for a reader to read when they are taken (:class:`~.dcp_saved.SavedTensor`)."""
    flat: dict[str, Any] = {}
    device = "meta" if unread else "cpu"
    for name, path in index.paths.items():
        if not keep(path):
            continue
        layout = index.layout(name)
        flat[name] = None if layout is None else torch.empty(layout.size, dtype=layout.dtype, device=device)
    return flat


def nest(index: EntryIndex, flat: Mapping[str, Any]) -> dict[str, Any]:
    """The nested state that flat entries read with a :func:`template` came from (dict keys as strings, list
    indices as positions).

    Raises:
        IntegrityError: the paths do not make one nested state: two at one place, one that runs through another's
            value, a position and a key at one place, or lists with more room than entries to fill it.
    """
    nested: dict[str, Any] = {}
    made = {id(nested)}  # the containers made here: no path runs through a saved value
    taken: set[tuple[int, Any]] = set()  # every place filled, by its container and its key or position
    room = [len(flat) + _MOST_GAPS]  # the list items nesting may add
    for name, value in flat.items():
        path = index.paths[name]
        node: Any = nested
        for step, following in zip(path[:-1], path[1:]):
            if (id(node), step) in taken:
                child = node[step]
                if id(child) not in made or isinstance(child, list) != isinstance(following, int):
                    raise _no_state(path)
            else:
                child = [] if isinstance(following, int) else {}
                made.add(id(child))
                _put(node, step, child, room, path)
                taken.add((id(node), step))
            node = child
        if (id(node), path[-1]) in taken:
            raise _no_state(path)
        _put(node, path[-1], value, room, path)
        taken.add((id(node), path[-1]))
    return nested


# List items that no entry fills (a list of empty dicts saves no entry for them), at most, beyond one an entry.
_MOST_GAPS = 1 << 16


def _put(node: dict[str, Any] | list[Any], step: Any, value: Any, room: list[int], path: tuple[Any, ...]) -> None:
    """Put ``value`` at ``step`` of ``node``: a key of a dict, a position of a list, which grows to it out of
    ``room``."""
    if isinstance(node, dict):
        if type(step) is not str:
            raise _no_state(path)
        node[step] = value
        return
    if type(step) is not int:
        raise _no_state(path)
    grow = step + 1 - len(node)
    if grow > room[0]:
        raise _no_state(path)
    if grow > 0:
        node.extend([None] * grow)
        room[0] -= grow
    node[step] = value


def _no_state(path: tuple[Any, ...]) -> IntegrityError:
    return IntegrityError(
        f"The saved entries' paths do not make one state at {list(path)} (two at one place, a path through a "
        "value, a list and a dict at one place, or a list too long for its entries): corrupt or forged"
    )


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
    reader.read_metadata()  # its failures as they are: DCP would raise them wrapped in its own words
    try:
        with in_one_process():  # each rank reads its own
            dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
    except CheckpointException as error:  # DCP wraps every failure of a rank: what went wrong, as it was raised
        raise next(iter(error.failures.values()))[0] from None


def load_whole(flat: dict[str, Any], place: Place, contents: Contents, trusted: bool = False) -> None:
    """Fill ``flat``, a flat :func:`template`, with the entries it names, whole. With the manifest's records, each is
    read straight into place and checked, chunk by chunk (:meth:`SavedTensors.fill <.dcp_saved.SavedTensors.fill>`),
    without DCP's planning or ``.metadata``; without (another tool's directory), by DCP's reader (:func:`load`).
    Values are read as ``torch.load(..., weights_only=True)`` reads them, unless ``trusted``.

    Raises:
        IntegrityError: an entry read is corrupt or truncated.
        UnsafeCheckpointError: a value, or ``.metadata`` where it is read, holds anything but data, unless ``trusted``.
    """
    records, index = contents
    if records is None:
        load(flat, place, None, trusted)
        return
    saved = SavedTensors(place, records, index)
    try:
        saved.fill(flat, weights_only=not trusted)
    finally:
        saved.close()


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
        self._contents: Contents | None = None  # what verify() read, for the load that follows

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
        # not whole: a load checks each entry it reads as it reads it
        manifest, self._contents = _verified(self.place, whole)
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
        trusted = self.trusted or not weights_only
        if read_manifest(self.place) is None:
            verify(self.place)
        records, index = self.contents(trusted)
        names = index.names
        sizes = {name: 0 if (layout := index.layout(name)) is None else layout.nbytes for name in names}
        total, done = sum(sizes.values()), 0
        flat: dict[str, Any] = {}
        for batch in _batches(names, sizes):  # the whole state is held at the end; batches only show progress
            wanted = set(batch)

            def keep(path: tuple[Any, ...], wanted: set[str] = wanted) -> bool:
                return name_of(path) in wanted

            part = template(index, keep)
            load_whole(part, self.place, Contents(records, index), trusted)
            flat.update(part)
            done += sum(sizes[name] for name in batch)
            if progress is not None:
                progress(done, total)
        return nest(index, flat)

    def saved_tensors(self, records: Mapping[str, Sequence[EntryRecord]], index: EntryIndex) -> SavedTensors:
        """The directory's entries, read without DCP's planning, with the manifest's ``records``: open until
        :meth:`close`."""
        if self._saved is None:
            self._saved = SavedTensors(self.place, records, index)
        return self._saved

    def contents(self, trusted: bool = False) -> Contents:
        """What the directory holds (see :func:`read_contents`), as :meth:`verify` read it if it did; ``trusted`` or
        :attr:`trusted`: ``.metadata``, where it is read, unpickled whatever it holds."""
        return self._contents or read_contents(self.place, self.trusted or trusted)

    def listing(self) -> dict[str, Any]:
        manifest = read_manifest(self.place)
        index = self.contents().entry_index
        files = [name for name, is_directory in self.place.entries().items() if not is_directory]
        by_object: dict[str, list[dict[str, Any]]] = {}
        for name, entry_path in index.paths.items():
            key = ".".join(map(str, entry_path[1:]))
            layout = index.layout(name)
            if layout is not None:
                entry = {**tensor_entry(key, layout.dtype, tuple(layout.size)), "shards": len(layout.chunks)}
            else:
                entry = {"key": key, "kind": "value"}  # not read: a listing reads the index only
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
        contents = self.contents()
        index = contents.entry_index
        found = []
        for flat_name, path in index.paths.items():
            layout = index.layout(flat_name)
            if path[:1] != (only,) or layout is None:
                continue

            def read(flat_name: str = flat_name, layout: TensorLayout = layout) -> Any:
                wanted = {flat_name: torch.empty(layout.size, dtype=layout.dtype)}
                load_whole(wanted, self.place, contents, self.trusted)  # this tensor alone, every part of it
                return wanted[flat_name]

            found.append(ExportedTensor(".".join(map(str, path[1:])), layout.dtype, tuple(layout.size), read))
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
