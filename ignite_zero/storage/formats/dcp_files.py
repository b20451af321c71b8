"""``torch.distributed.checkpoint``'s files, written and read by us, through a
:class:`~ignite_zero.storage.places.Place`.

:class:`PlaceStorageWriter` writes what DCP's ``FileSystemWriter`` writes: one ``__<rank>_<n>.distcp`` file per rank
(and thread), each entry in it a ``torch.save`` archive of one tensor (or the pickled bytes of a value), and
``.metadata``, the pickled ``Metadata`` that says where each entry lies, written last by the coordinator. Plain
``dcp.load``, ``dcp_to_torch_save`` and torchtitan read the result. But the archives are written by
:mod:`~ignite_zero.storage.formats.torch_zip`, straight from the memory of CPU tensors (accelerator tensors are
copied into pinned host memory one tensor ahead, :func:`ignite_zero.staging.on_host`), with the CRC-32 of every
record in the same pass: :attr:`PlaceStorageWriter.written` gives each file's size and CRC-32, and
:attr:`~PlaceStorageWriter.records` where each entry's data lies and its CRC-32, for the manifest.

:class:`PlaceStorageReader` reads those entries with the manifest's records: each tensor's data straight into the
tensor DCP loads it into (a part of a saved tensor: the saved tensor into a buffer, then the part copied), checked
by its CRC-32 as it arrives (small neighbouring entries read together and checked by one CRC-32 pass, then their
bytes copied into place), with no ``torch.load`` and no separate pass over the files
(:mod:`~ignite_zero.storage.formats.dcp_entries`); :mod:`~ignite_zero.storage.formats.dcp_saved` reads them without
DCP's planning.

DCP's own writer spends most of a save's time in ``torch.save`` of each tensor and a copy into its stream, its reader
in a ``torch.load`` of each entry and a copy into place: what writing and reading here avoids.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import os
import pickle
import struct
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import IO, Any, NamedTuple

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future
from zlib_ng import zlib_ng

from ignite_zero import _compat, staging
from ignite_zero.storage.formats import torch_zip
from ignite_zero.storage.formats.base import IntegrityError
from ignite_zero.storage.formats.dcp_entries import (
    INDEX,
    METADATA,
    EntryRecord,
    RecordedEntries,
    laid_out,
    metadata_of,
    read_entries,
    read_recorded_file,
    read_saved,
    read_whole,
    record_table,
)
from ignite_zero.storage.formats.dcp_index import EntryIndex
from ignite_zero.storage.formats.scratch import thread_buffer
from ignite_zero.storage.places import Place, place_of

__all__ = ["FileWritten", "PlaceStorageReader", "PlaceStorageWriter", "PlacedFile", "tensor_nbytes", "write_entries"]

_SUFFIX = ".distcp"
# Writes up to the first size are gathered until they reach the second: one write for the archives of many small
# tensors rather than three each; larger ones are written straight from their memory.
_GATHERED_PIECE, _GATHERED = 64 << 10, 1 << 20
# Small tensors are held until their bytes reach _GATHERED or they are this many, then their archives made together.
_SMALL_TENSORS = 1024


@dataclasses.dataclass(frozen=True)
class _Prefix:
    """The names of a rank's files: ``__<rank>_``."""

    prefix: str


class _Output:
    """A file being written: its position, size and CRC-32, and its entries' records in the order written; small
    pieces (headers, small tensors' archives) gathered and written together, and small tensors' archives made
    together (:func:`~ignite_zero.storage.formats.torch_zip.write_small_tensors`), each in its turn.

    Up to 1 MiB (or 1,024) of small tensors are held until then: for an accelerator's state, pinned host copies
    (:func:`~ignite_zero.staging.on_host`), which torch's host allocator keeps for reuse by the next save.
    """

    def __init__(self, stream: IO[bytes]) -> None:
        self._stream = stream
        # one buffer, written from and filled again, the thread's last file's (a stream copies what it keeps, as io's
        # write() lets the caller reuse it)
        self._gathered = thread_buffer("gathered pieces", _GATHERED + _GATHERED_PIECE)
        self._filled = 0
        self._small: list[torch.Tensor] = []
        self._small_layouts: list[tuple[Any, ...]] = []
        self._small_bytes = 0
        self.size = 0
        self.crc = 0
        self.records: list[EntryRecord] = []
        self._alignment = _compat.storage_alignment()  # read once: torch's setting costs more than a small entry

    def write(self, data: Any) -> None:
        view = memoryview(data)
        if view.nbytes <= _GATHERED_PIECE:
            self._gather(view)
            return
        self._write_gathered()
        self._stream.write(view)
        self.size += view.nbytes

    def _gather(self, data: Any) -> None:
        """Copy ``data`` among the pieces written together."""
        view = memoryview(data).cast("B")
        size = view.nbytes
        if self._filled + size > len(self._gathered):  # then room enough: a piece is at most 64 KiB and a header
            self._write_gathered()
        self._gathered[self._filled : self._filled + size] = view
        self._filled += size
        self.size += size
        if self._filled >= _GATHERED:
            self._write_gathered()

    def finish(self) -> None:
        """Write all that is still held."""
        self._write_small()
        self._write_gathered()

    def value(self, data: bytes | memoryview) -> None:
        self._write_small()
        offset = self.size
        self.write(data)
        crc = zlib_ng.crc32(data)
        self._entry(EntryRecord(offset, len(data), crc, offset, crc))

    def tensor(self, tensor: torch.Tensor) -> None:
        layout = torch_zip.small_tensor_layout(tensor)
        if layout is not None:  # held, and written with the small tensors next to it, in order
            self._small.append(tensor)
            self._small_layouts.append(layout)
            self._small_bytes += tensor.nbytes
            if self._small_bytes >= _GATHERED or len(self._small) >= _SMALL_TENSORS:
                self._write_small()
            return
        self._write_small()
        offset = self.size
        archive = torch_zip.write_archive(self.write, tensor, alignment=self._alignment)
        data = archive.record("data/0")
        self._entry(EntryRecord(offset, archive.size, archive.crc, offset + data.offset, data.crc))

    def _write_small(self) -> None:
        if not self._small:
            return
        offset = self.size
        # copied, whatever their size: they are made in memory that the next small tensors' archives are made in
        written = torch_zip.write_small_tensors(self._gather, self._small, self._small_layouts, self._alignment)
        for archive in written:
            self._entry(EntryRecord(offset, archive.size, archive.crc, offset + archive.data_offset, archive.data_crc))
            offset += archive.size
        self._small, self._small_layouts, self._small_bytes = [], [], 0

    def _write_gathered(self) -> None:
        if self._filled:
            self._stream.write(self._gathered[: self._filled])
            self._filled = 0

    def _entry(self, record: EntryRecord) -> None:
        self.crc = zlib_ng.crc32_combine(self.crc, record.crc, record.length)
        self.records.append(record)


class FileWritten(NamedTuple):
    """A ``.distcp`` file as written: its size, CRC-32, and its entries' records in the order written (a
    :func:`~ignite_zero.storage.formats.dcp_entries.record_table`)."""

    size: int
    crc: int
    records: np.ndarray


class PlacedFile(NamedTuple):
    """A file of a rank's part of a plan, as written: its name, the positions in the plan of the items it holds, in
    the order written, and what was written."""

    name: str
    positions: list[int]
    written: FileWritten


def write_entries(place: Place, name: str, entries: Iterable[Any]) -> FileWritten:
    """Write the file ``name`` of ``place`` (in place: the saver commits the directory whole), an entry for each of
    ``entries`` in turn: a value's bytes (``bytes``, a buffer or ``io.BytesIO``), or a CPU tensor's archive."""
    written: list[FileWritten] = []

    def dump(stream: IO[bytes]) -> None:
        output = _Output(stream)
        for data in entries:
            if isinstance(data, torch.Tensor):
                output.tensor(data)
            else:
                output.value(data.getbuffer() if isinstance(data, io.BytesIO) else data)
            del data  # unless held with other small tensors, a host copy goes before the next one is made
        output.finish()
        written.append(FileWritten(output.size, output.crc, record_table(output.records)))

    place.write(name, dump, atomic=False)
    return written[-1]


class PlaceStorageWriter(StorageWriter):
    """A DCP ``StorageWriter`` of the files ``FileSystemWriter`` writes, into a :class:`Place` (a local directory or
    an object store's prefix), each file written once, sequentially, with :meth:`Place.write`.

    Args:
        place: the checkpoint directory.
        thread_count: files each rank writes, each from a thread of its own.

    Attributes:
        written: each file this rank wrote, by name: its size and CRC-32.
        record_tables: each file's entries, by name, as a
            :func:`~ignite_zero.storage.formats.dcp_entries.record_table` (what travels to the rank that seals).
    """

    def __init__(self, place: Place, thread_count: int = 1) -> None:
        super().__init__()
        self.place = place
        self.thread_count = thread_count
        self.written: dict[str, tuple[int, int]] = {}
        self.record_tables: dict[str, np.ndarray] = {}
        self.rank: int | None = None
        self.use_collectives = True
        self.metadata_file: MetadataFile | None = None
        self.save_id = uuid.uuid4().hex

    @property
    def records(self) -> dict[str, list[EntryRecord]]:
        """Each file's entries, by name (see :class:`EntryRecord`), as a reader takes them."""
        return {name: list(map(EntryRecord._make, table.tolist())) for name, table in self.record_tables.items()}

    def reset(self, checkpoint_id: str | os.PathLike | Place | None = None) -> None:
        if isinstance(checkpoint_id, Place):
            self.place = checkpoint_id
        elif checkpoint_id is not None and str(checkpoint_id) != str(self.place.location()):
            self.place = place_of(checkpoint_id, self.place.storage_options)
        self.written.clear()
        self.record_tables.clear()
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if self.rank is not None and not self.use_collectives:
            return dataclasses.replace(plan, storage_data=_Prefix(f"__{self.rank}_"))
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [
            plan if plan.storage_data is not None else dataclasses.replace(plan, storage_data=_Prefix(f"__{rank}_"))
            for rank, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        future: Future[list[WriteResult]] = Future()
        future.set_result(
            [
                WriteResult(plan.items[n].index, length, _compat.dcp_storage_info(file.name, offset, length))
                for file in self.write_plan(plan, lambda items: [planner.resolve_data(item) for item in items])
                for n, (offset, length) in zip(file.positions, file.written.records[:, :2].tolist(), strict=True)
            ]
        )
        return future

    def write_plan(self, plan: SavePlan, resolve: Callable[[list[WriteItem]], list[Any]]) -> list[PlacedFile]:
        """Write ``plan``, the data of its items resolved by ``resolve`` (a planner's ``resolve_data`` of each, in
        order): what :meth:`write_data` writes, as files that say which items they hold rather than as DCP's result
        of each item."""
        producers = staging.current_streams()  # this thread's: the writing threads copy after their work

        def write(name: str, positions: list[int]) -> FileWritten:
            # a host copy goes before the next one is made, unless held with other small tensors
            values = staging.on_host(resolve([plan.items[n] for n in positions]), producers)
            return write_entries(self.place, name, values)

        return self._write_files(plan, write)

    def write_staged(
        self, plan: SavePlan, staged: Sequence[Any], write_file: Callable[[Place, str, list[Any]], FileWritten]
    ) -> list[PlacedFile]:
        """Write ``plan`` from ``staged``, a host copy of what each of its items resolves to (values' bytes, tensors),
        each file by ``write_file(place, name, entries)``: :func:`write_entries`, or its call in another process."""
        return self._write_files(
            plan, lambda name, positions: write_file(self.place, name, [staged[n] for n in positions])
        )

    def _write_files(self, plan: SavePlan, write: Callable[[str, list[int]], FileWritten]) -> list[PlacedFile]:
        """Write this rank's files of ``plan``, each with ``write(name, positions)`` (of items in the plan): one file,
        or one per thread."""
        # here, not while planning: a saver plans before its writing rank clears what an interrupted save left
        self.place.make()
        prefix = plan.storage_data.prefix
        parts = _split(plan.items, self.thread_count)
        files = [(f"{prefix}{n}{_SUFFIX}", positions) for n, positions in enumerate(parts)]
        if len(files) == 1:
            return [self._write_file(plan, *files[0], write)]
        with concurrent.futures.ThreadPoolExecutor(len(files), thread_name_prefix="ignite_zero-write") as pool:
            return list(pool.map(lambda f: self._write_file(plan, f[0], f[1], write), files))

    def _write_file(
        self, plan: SavePlan, name: str, positions: list[int], write: Callable[[str, list[int]], FileWritten]
    ) -> PlacedFile:
        # values first, then tensors, as DCP's own writer orders them
        ordered = sorted(positions, key=lambda n: plan.items[n].type != WriteItemType.BYTE_IO)
        written = write(name, ordered)
        if len(written.records) != len(ordered):
            raise RuntimeError(f"{name}: {len(written.records)} entries written for {len(ordered)} items")
        self.written[name] = (written.size, written.crc)
        self.record_tables[name] = written.records
        return PlacedFile(name, ordered, written)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """On the coordinator: write ``.metadata`` and the index of the entries, last (their bytes kept in
        :attr:`metadata_file`)."""
        metadata.version = _compat.DCP_VERSION
        metadata.storage_data = {result.index: result.storage_data for part in results for result in part}
        self.metadata_file = MetadataFile(metadata)
        self.write_metadata(self.metadata_file)

    def write_metadata(self, metadata_file: MetadataFile) -> None:
        """On the coordinator: write ``.metadata`` from ``metadata_file``, with this save's storage facts, and the
        index of the entries, last; each a file of one entry, recorded as the others."""
        content = metadata_file.content(self.checkpoint_id, self.save_id)  # this save's, as storage_meta() says
        self._write_whole(INDEX, metadata_file.index)
        self._write_whole(METADATA, content)

    def _write_whole(self, name: str, data: bytes) -> None:
        """Write the file ``name`` of ``data``, one entry, recorded as the files of entries are."""
        self.place.write(name, lambda f: f.write(data))
        crc = zlib_ng.crc32(data)
        self.written[name] = (len(data), crc)
        self.record_tables[name] = record_table([EntryRecord(0, len(data), crc, 0, crc)])

    def storage_meta(self) -> StorageMeta:
        return StorageMeta(checkpoint_id=str(self.place.location()), save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        return str(self.place.location())

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False  # given explicitly, never picked by DCP from a path


class MetadataFile:
    """The bytes of ``.metadata`` for one plan and the places its entries were written in, pickled once: a later save
    of the same plan whose files hold every entry where this one's did puts its own storage facts (the checkpoint's
    location and the save's id) into the same bytes, rather than pickle thousands of entries again. The bytes of the
    index of the entries (:attr:`index`: :meth:`EntryIndex.to_json <.dcp_index.EntryIndex.to_json>`) are made once
    too.

    Each value that many entries hold alike (tensor properties, sizes, offsets, file names) is pickled once and
    referred to again: fewer objects for every reader to build, DCP's own included.

    Args:
        metadata: the save's metadata, its ``storage_data`` filled in; its ``storage_meta`` is this class's to set.
    """

    def __init__(self, metadata: Metadata) -> None:
        stand_ins = [f"ignite_zero-{what}-{uuid.uuid4().hex}" for what in ("location", "save")]
        self.index = EntryIndex.of_metadata(metadata, METADATA).to_json()
        shared = _with_shared_values(metadata)
        shared.storage_meta = StorageMeta(checkpoint_id=stand_ins[0], save_id=stand_ins[1])
        content = _without_frames(pickle.dumps(shared, protocol=4))
        before, rest = _split_at(content, _short_string(stand_ins[0]))
        between, after = _split_at(rest, _short_string(stand_ins[1]))
        self._pieces = (before, between, after)

    def content(self, checkpoint_id: str, save_id: str) -> bytes:
        """``.metadata``'s bytes for a save into ``checkpoint_id`` whose id is ``save_id``."""
        before, between, after = self._pieces
        return b"".join((before, _string(checkpoint_id), between, _string(save_id), after))


def _with_shared_values(metadata: Metadata) -> Metadata:
    """A copy of ``metadata`` in which equal properties, sizes, offsets, file names and entry names are one object."""
    pool: dict[Any, Any] = {}

    def one(value: Any, key: Any = None) -> Any:
        return pool.setdefault((type(value), value if key is None else key), value)

    names = {name: name for name in metadata.state_dict_metadata}
    described: dict[str, Any] = {}
    for name, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            properties = entry.properties
            key = tuple(getattr(properties, field.name) for field in dataclasses.fields(properties))
            chunks = [ChunkStorageMetadata(one(chunk.offsets), one(chunk.sizes)) for chunk in entry.chunks]
            entry = TensorStorageMetadata(one(properties, key), one(entry.size), chunks)
        described[name] = entry
    places = {
        dataclasses.replace(index, fqn=names.get(index.fqn, index.fqn)): dataclasses.replace(
            info, relative_path=one(info.relative_path)
        )
        for index, info in metadata.storage_data.items()
    }
    planner_data = metadata.planner_data
    if isinstance(planner_data, dict):
        planner_data = {names.get(name, name): path for name, path in planner_data.items()}
    return dataclasses.replace(metadata, state_dict_metadata=described, storage_data=places, planner_data=planner_data)


# Protocol 4's opcodes that a string and its position need here: FRAME (the length of what follows, a hint that a
# reader may go without), SHORT_BINUNICODE (a string of under 256 bytes) and BINUNICODE.
_FRAME, _SHORT_STRING, _STRING = 0x95, b"\x8c", b"X"


def _without_frames(content: bytes) -> bytes:
    """``content``, a pickle of protocol 4, without its frames: a frame records its length, which a string of another
    length put in its place would change. Every opcode of DCP's metadata lies in a frame (only a very large bytes or
    string object is written outside one)."""
    pieces, at = [content[:2]], 2
    while at < len(content):
        if content[at] != _FRAME:
            raise ValueError("DCP's metadata holds a value too large for a pickle's frame (a name of over 64 KiB?)")
        (length,) = struct.unpack_from("<Q", content, at + 1)
        pieces.append(content[at + 9 : at + 9 + length])
        at += 9 + length
    return b"".join(pieces)


def _short_string(text: str) -> bytes:
    """``text`` as protocol 4 pickles a string of under 256 bytes it has not met before."""
    encoded = text.encode("utf-8", "surrogatepass")
    return _SHORT_STRING + bytes([len(encoded)]) + encoded  # our stand-ins: under 60 bytes


def _string(text: str) -> bytes:
    """``text`` pickled as ``BINUNICODE``, which any length fits."""
    encoded = text.encode("utf-8", "surrogatepass")
    return _STRING + struct.pack("<I", len(encoded)) + encoded


def _split_at(content: bytes, piece: bytes) -> tuple[bytes, bytes]:
    """What comes before and after the one occurrence of ``piece`` in ``content``."""
    before, found, after = content.partition(piece)
    if not found or piece in after:  # a new uuid, pickled as a string once: never, unless pickle changes
        raise ValueError("DCP's metadata was not pickled with its stand-in storage facts once each")
    return before, after


def _split(items: list[WriteItem], count: int) -> list[list[int]]:
    """The positions of ``items`` in ``count`` files of about equal size: values spread in turn, tensors largest
    first into the smallest file."""
    if count == 1:
        return [list(range(len(items)))]
    files: list[list[int]] = [[] for _ in range(count)]
    sizes = [0] * count
    values = [n for n, item in enumerate(items) if item.type == WriteItemType.BYTE_IO]
    for turn, n in enumerate(values):
        files[turn % count].append(n)
    tensors = [n for n, item in enumerate(items) if item.type != WriteItemType.BYTE_IO]
    for n in sorted(tensors, key=lambda n: tensor_nbytes(items[n].tensor_data), reverse=True):
        smallest = sizes.index(min(sizes))
        files[smallest].append(n)
        sizes[smallest] += tensor_nbytes(items[n].tensor_data)
    return [part for part in files if part]


def tensor_nbytes(described: object) -> int:
    """The bytes of the tensor that DCP describes by ``described`` (its metadata, or a write item's data); 0 for
    anything else (a value's)."""
    if isinstance(described, (TensorStorageMetadata, TensorWriteData)):
        return described.size.numel() * described.properties.dtype.itemsize
    return 0


class PlaceStorageReader(StorageReader):
    """A DCP ``StorageReader`` of a checkpoint directory that :class:`PlaceStorageWriter` wrote: each entry read
    straight into place and checked as it arrives, by the records of the manifest.

    Args:
        place: the checkpoint directory.
        records: every file's entries, by name, from the manifest.
        trusted: unpickle whatever ``.metadata`` holds (see :mod:`~ignite_zero.storage.formats.trust`).
    """

    def __init__(self, place: Place, records: Mapping[str, Sequence[EntryRecord]], trusted: bool = False) -> None:
        super().__init__()
        self.place = place
        self._entries = RecordedEntries(place, records)
        self._storage_data: dict[MetadataIndex, Any] = {}
        self._metadata: Metadata | None = None
        #: the index of the entries, once :meth:`read_metadata` read them
        self.entry_index: EntryIndex | None = None
        self._trusted = trusted

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self._storage_data = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """``.metadata``, read once: a caller that reads it first (to raise its failures as they are, where DCP would
        wrap them) hands DCP the same."""
        if self._metadata is not None:
            return self._metadata
        content = read_recorded_file(self.place, METADATA, self._entries.recorded(METADATA, 0))
        self._metadata, self.entry_index = metadata_of(content, self.place, self._trusted)
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._metadata = metadata
        self._storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self._storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():
            items.sort(key=lambda item: self._storage_data[item.storage_index].offset)
            with self.place.open(name) as f:
                in_place: list[tuple[ReadItem, torch.Tensor]] = []
                for item in items:
                    if item.type == LoadItemType.BYTE_IO:
                        record, where = self._record(item)
                        planner.load_bytes(item, io.BytesIO(read_whole(f, record, where)))
                        continue
                    target = planner.resolve_tensor(item).detach()
                    sizes, dtype = self._saved_chunk(item)
                    if _whole(item, sizes) and laid_out(target, dtype):
                        in_place.append((item, target))
                    else:
                        self._read_part(f, item, target, sizes, dtype, planner)
                reads = []
                for item, target in in_place:  # whole saved tensors, into place, neighbours together
                    record, where = self._record(item)
                    reads.append((record, torch_zip.tensor_bytes(target), where))
                read_entries(f, reads)
                for item, target in in_place:
                    planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _record(self, item: ReadItem) -> tuple[EntryRecord, str]:
        return self._entries.of(self._storage_data[item.storage_index], item.storage_index.fqn)

    def _read_part(
        self,
        f: IO[bytes],
        item: ReadItem,
        target: torch.Tensor,
        sizes: torch.Size,
        dtype: torch.dtype,
        planner: LoadPlanner,
    ) -> None:
        """Read the part of a saved tensor that ``item`` names into ``target`` (or a tensor laid out otherwise)."""
        record, where = self._record(item)
        part = read_saved(f, record, sizes, dtype, where)  # a part of it: as DCP's reader, the saved tensor whole
        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
            part = part.narrow(dim, start, length)
        if target.size() != part.size():
            raise IntegrityError(f"{where}: holds {tuple(part.size())}, {tuple(target.size())} expected")
        target.copy_(part)
        planner.commit_tensor(item, target)

    def _saved_chunk(self, item: ReadItem) -> tuple[torch.Size, torch.dtype]:
        """The sizes and dtype of the saved tensor (or chunk of one) that ``item`` reads from."""
        assert self._metadata is not None
        storage = self._metadata.state_dict_metadata[item.storage_index.fqn]
        assert isinstance(storage, TensorStorageMetadata)
        offsets = tuple(item.storage_index.offset or ())
        for chunk in storage.chunks:
            if tuple(chunk.offsets) == offsets:
                return chunk.sizes, storage.properties.dtype
        raise IntegrityError(f"{self.place}: .metadata has no chunk of {item.storage_index.fqn} at {offsets}")

    @property
    def checkpoint_id(self) -> str:
        return str(self.place.location())

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False


def _whole(item: ReadItem, sizes: Sequence[int]) -> bool:
    return all(start == 0 for start in item.storage_offsets) and tuple(item.lengths) == tuple(sizes)
