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
by its CRC-32 as it arrives, with no ``torch.load`` and no separate pass over the files. :class:`SavedTensors` reads
them without DCP's planning: whole tensors by name, and a rank's shards where each is one saved chunk.

On 2 ranks of FSDP2 (0.6 GB of state, tmpfs, 2-core machine), DCP's writer spent most of a save's time in
``torch.save`` of each tensor into the file and a copy into its stream; its reader a ``torch.load`` of each entry
and a copy into place (see benchmarks/limit.py for the figures).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import os
import pickle
import uuid
from collections.abc import Mapping, Sequence
from typing import IO, Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
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
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future
from zlib_ng import zlib_ng

from ignite_zero import _compat, staging
from ignite_zero.storage.formats import torch_zip
from ignite_zero.storage.formats.base import CLOSED_EARLY, IntegrityError
from ignite_zero.storage.formats.trust import load_metadata, load_value
from ignite_zero.storage.places import Place, place_of

__all__ = [
    "METADATA",
    "ChunkReading",
    "EntryRecord",
    "Fill",
    "PlaceStorageReader",
    "PlaceStorageWriter",
    "SavedTensor",
    "SavedTensors",
    "metadata_of",
]

#: The file DCP's metadata is written to, last: a directory without it is incomplete.
METADATA = ".metadata"
_SUFFIX = ".distcp"
# Reads, like writes, go in slices checksummed while still in the CPU's cache.
_SLICE = 256 << 10


@dataclasses.dataclass(frozen=True)
class EntryRecord:
    """Where one entry of a ``.distcp`` file lies, and its checksums.

    Attributes:
        offset: where the entry starts in the file.
        length: its size in bytes.
        crc: the CRC-32 of the whole entry.
        data_offset: where the bytes of its tensor start in the file (the entry's own offset for a value's bytes);
            ``-1`` for an archive that earlier releases had ``torch.save`` write (4 GiB or more), read whole.
        data_crc: the CRC-32 of those bytes.
    """

    offset: int
    length: int
    crc: int
    data_offset: int
    data_crc: int

    def to_json(self) -> list[int]:
        return list(dataclasses.astuple(self))

    @classmethod
    def from_json(cls, value: Sequence[int]) -> EntryRecord:
        return cls(*map(int, value))


@dataclasses.dataclass(frozen=True)
class _Prefix:
    """The names of a rank's files: ``__<rank>_``."""

    prefix: str


class _Output:
    """A file being written: its position, size and CRC-32, and its entries' records."""

    def __init__(self, stream: IO[bytes]) -> None:
        self._stream = stream
        self.size = 0
        self.crc = 0
        self.records: list[EntryRecord] = []

    def write(self, data: Any) -> None:
        self._stream.write(data)
        self.size += memoryview(data).nbytes

    def value(self, data: bytes | memoryview) -> EntryRecord:
        offset = self.size
        self.write(data)
        crc = zlib_ng.crc32(data)
        return self._entry(EntryRecord(offset, len(data), crc, offset, crc))

    def tensor(self, tensor: torch.Tensor) -> EntryRecord:
        offset = self.size
        archive = torch_zip.write_archive(self.write, tensor)
        data = archive.record("data/0")
        return self._entry(EntryRecord(offset, archive.size, archive.crc, offset + data.offset, data.crc))

    def _entry(self, record: EntryRecord) -> EntryRecord:
        self.crc = zlib_ng.crc32_combine(self.crc, record.crc, record.length)
        self.records.append(record)
        return record


class PlaceStorageWriter(StorageWriter):
    """A DCP ``StorageWriter`` of the files ``FileSystemWriter`` writes, into a :class:`Place` (a local directory or
    an object store's prefix), each file written once, sequentially, with :meth:`Place.write`.

    Args:
        place: the checkpoint directory.
        thread_count: files each rank writes, each from a thread of its own.

    Attributes:
        written: each file this rank wrote, by name: its size and CRC-32.
        records: each file's entries, by name (see :class:`EntryRecord`).
    """

    def __init__(self, place: Place, thread_count: int = 1) -> None:
        super().__init__()
        self.place = place
        self.thread_count = thread_count
        self.written: dict[str, tuple[int, int]] = {}
        self.records: dict[str, list[EntryRecord]] = {}
        self.rank: int | None = None
        self.use_collectives = True
        self.save_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: str | os.PathLike | Place | None = None) -> None:
        if isinstance(checkpoint_id, Place):
            self.place = checkpoint_id
        elif checkpoint_id is not None and str(checkpoint_id) != str(self.place.location()):
            self.place = place_of(checkpoint_id, self.place.storage_options)
        self.written.clear()
        self.records.clear()
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
        # here, not while planning: a saver plans before its writing rank clears what an interrupted save left
        self.place.make()
        prefix = plan.storage_data.prefix
        files = [(f"{prefix}{n}{_SUFFIX}", items) for n, items in enumerate(_split(plan.items, self.thread_count))]
        producers = staging.current_streams()  # this thread's: the writing threads copy after their work
        if len(files) == 1:
            results = self._write_file(files[0][0], files[0][1], planner, producers)
        else:
            with concurrent.futures.ThreadPoolExecutor(len(files), thread_name_prefix="ignite_zero-write") as pool:
                parts = pool.map(lambda f: self._write_file(f[0], f[1], planner, producers), files)
                results = [result for part in parts for result in part]
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _write_file(
        self, name: str, items: list[WriteItem], planner: SavePlanner, producers: staging.Streams
    ) -> list[WriteResult]:
        results: list[WriteResult] = []

        def dump(stream: IO[bytes]) -> None:
            output = _Output(stream)
            # values first, then tensors, as DCP's own writer orders them
            ordered = sorted(items, key=lambda item: item.type != WriteItemType.BYTE_IO)
            on_host = staging.on_host((planner.resolve_data(item) for item in ordered), producers)
            for item in ordered:
                data = next(on_host)
                record = output.value(data.getbuffer()) if isinstance(data, io.BytesIO) else output.tensor(data)
                del data  # its host copy goes before the next one is made
                info = _compat.dcp_storage_info(name, record.offset, record.length)
                results.append(WriteResult(index=item.index, size_in_bytes=record.length, storage_data=info))
            self.written[name] = (output.size, output.crc)
            self.records[name] = output.records

        self.place.write(name, dump, atomic=False)  # the directory is committed as a whole, by the saver
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """On the coordinator: write ``.metadata``, last."""
        metadata.version = _compat.DCP_VERSION
        metadata.storage_data = {result.index: result.storage_data for part in results for result in part}
        metadata.storage_meta = self.storage_meta()
        content = pickle.dumps(metadata)
        self.place.write(METADATA, lambda f: f.write(content))
        crc = zlib_ng.crc32(content)
        self.written[METADATA] = (len(content), crc)
        self.records[METADATA] = [EntryRecord(0, len(content), crc, 0, crc)]

    def storage_meta(self) -> StorageMeta:
        return StorageMeta(checkpoint_id=str(self.place.location()), save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        return str(self.place.location())

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False  # given explicitly, never picked by DCP from a path


def _split(items: list[WriteItem], count: int) -> list[list[WriteItem]]:
    """``items`` in ``count`` files of about equal size: values spread in turn, tensors largest first into the
    smallest file."""
    if count == 1:
        return [items]
    files: list[list[WriteItem]] = [[] for _ in range(count)]
    sizes = [0] * count
    values = [item for item in items if item.type == WriteItemType.BYTE_IO]
    for n, item in enumerate(values):
        files[n % count].append(item)
    tensors = sorted((item for item in items if item.type != WriteItemType.BYTE_IO), key=_nbytes, reverse=True)
    for item in tensors:
        smallest = sizes.index(min(sizes))
        files[smallest].append(item)
        sizes[smallest] += _nbytes(item)
    return [part for part in files if part]


def _nbytes(item: WriteItem) -> int:
    assert item.tensor_data is not None
    return item.tensor_data.size.numel() * item.tensor_data.properties.dtype.itemsize


def metadata_of(content: bytes, where: str, trusted: bool, load_id: str | None = None) -> Metadata:
    """DCP's metadata from the bytes of ``.metadata``, read as :func:`~.trust.load_metadata` reads them, with the
    storage facts DCP's readers add (``load_id``: the reader's, where it has one)."""
    metadata = load_metadata(content, where, trusted)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    if load_id is not None:
        metadata.storage_meta.load_id = load_id
    return metadata


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
        self._entries = _Entries(place, records)
        self._storage_data: dict[MetadataIndex, Any] = {}
        self._metadata: Metadata | None = None
        self._trusted = trusted

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self._storage_data = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        content = self.place.read(METADATA)
        record = self._entries.recorded(METADATA, 0)
        where = str(self.place.location(METADATA))
        if record is None or len(content) != record.length:
            raise IntegrityError(f"{where} has {len(content)} bytes, not what its manifest says (truncated?)")
        _check(zlib_ng.crc32(content), record.crc, where)
        return metadata_of(content, where, self._trusted)

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
                for item in items:
                    self._read_item(name, f, item, planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_item(self, name: str, f: IO[bytes], item: ReadItem, planner: LoadPlanner) -> None:
        record, where = self._entries.of(self._storage_data[item.storage_index], item.storage_index.fqn)
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(_read_whole(f, record, where)))
            return
        target = planner.resolve_tensor(item).detach()
        sizes, dtype = self._saved_chunk(item)
        if _whole(item, sizes) and _read_saved_into(f, record, target, dtype, where):
            planner.commit_tensor(item, target)
            return
        part = _read_saved(f, record, sizes, dtype, where)  # a part of it: as DCP's reader, the saved tensor whole
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


class _Entries:
    """The manifest's records of a directory's entries, found by where DCP's metadata says each lies."""

    def __init__(self, place: Place, records: Mapping[str, Sequence[EntryRecord]]) -> None:
        self.place = place
        self._records = {(name, record.offset): record for name, part in records.items() for record in part}
        # where each file lies, for messages: spelling it out for each of 96 entries took 1.5 ms of a 0.09 s load
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


class SavedTensors:
    """The entries of a checkpoint directory that :class:`PlaceStorageWriter` wrote, read without DCP's planning:
    each straight into its place in the destination, checked as it arrives.

    What a load reads whole (a model every rank holds, a ZeRO optimizer's partition) is read this way, by name, when
    its object takes it, into the object's own tensors: reading 0.3 GB into new memory cost 3x reading it into
    tensors that exist (their page faults; 0.21 s against 0.06 s on tmpfs). A rank's own shards, on the world size
    that saved them, are read this way too (:meth:`plan`).

    Args:
        place: the checkpoint directory.
        records: every file's entries, by name, from the manifest.
        metadata: the directory's ``.metadata``.
    """

    def __init__(self, place: Place, records: Mapping[str, Sequence[EntryRecord]], metadata: Metadata) -> None:
        self.place = place
        self._entries = _Entries(place, records)
        self._metadata = metadata
        self._files: dict[str, IO[bytes]] = {}
        self._closed = False

    def read(self, fqn: str, into: torch.Tensor | None = None) -> torch.Tensor:
        """The saved tensor ``fqn``, whole, read into ``into`` (a contiguous CPU tensor of its shape and dtype) or
        into a new tensor.

        Raises:
            IntegrityError: an entry read is corrupt or truncated, or the manifest does not record it.
        """
        storage = self._metadata.state_dict_metadata[fqn]
        assert isinstance(storage, TensorStorageMetadata)
        dtype = storage.properties.dtype
        if into is None:
            into = torch.empty(storage.size, dtype=dtype)
        for chunk in storage.chunks:
            info = self._metadata.storage_data[MetadataIndex(fqn, chunk.offsets)]
            record, where = self._entries.of(info, fqn)
            f = self._open(info.relative_path)
            region = into
            for dim, (start, length) in enumerate(zip(chunk.offsets, chunk.sizes)):
                region = region.narrow(dim, start, length)
            if not _read_saved_into(f, record, region, dtype, where):
                region.copy_(_read_saved(f, record, chunk.sizes, dtype, where))
        return into

    def fits(self, fqn: str, target: torch.Tensor) -> bool:
        """Whether :meth:`read` can read ``fqn`` into ``target``."""
        storage = self._metadata.state_dict_metadata.get(fqn)
        return (
            isinstance(storage, TensorStorageMetadata)
            and _laid_out(target, storage.properties.dtype)
            and target.shape == storage.size
        )

    def plan(self, state: dict[str, Any]) -> Fill | None:
        """How to fill ``state``, a nested state as DCP loads it (tensors, ``DTensor``\\ s and values), in place and
        without DCP's planning: where each of its tensors is exactly one saved chunk (a rank's own shards, on the
        world size that saved them; a tensor saved whole). ``None`` where some tensor needs resharding or an entry is
        not recorded (DCP reads it then). Reads nothing.

        DCP's planning took 0.015 s of a 0.11 s load of 0.3 GB of FSDP2 shards (tmpfs).
        """
        flat, paths = _compat.dcp_flatten(state)
        values: list[tuple[MetadataIndex, tuple[Any, ...]]] = []
        tensors: list[tuple[MetadataIndex, torch.Tensor]] = []
        for fqn, value in flat.items():
            saved = self._metadata.state_dict_metadata.get(fqn)
            if isinstance(value, DTensor) or type(value) in (torch.Tensor, torch.nn.Parameter):
                local = value.to_local() if isinstance(value, DTensor) else value
                offsets, sizes = _compat.dtensor_block(value) if isinstance(value, DTensor) else _block_of(value)
                index = MetadataIndex(fqn, offsets)
                if not (isinstance(saved, TensorStorageMetadata) and _holds(saved, offsets, sizes, local)):
                    return None
                record = self._recorded(index)
                if record is None or record.data_offset < 0:
                    return None
                tensors.append((index, local.detach()))
            elif isinstance(saved, BytesStorageMetadata) and not isinstance(value, torch.Tensor):
                if self._recorded(MetadataIndex(fqn)) is None:
                    return None
                values.append((MetadataIndex(fqn), paths[fqn]))
            else:  # a ShardedTensor (FSDP1's), or what the directory does not hold: DCP reads it, or says so
                return None
        values.sort(key=lambda read: self._place_of(read[0]))  # in file order, as DCP's reader reads
        tensors.sort(key=lambda read: self._place_of(read[0]))
        return Fill(self, state, values, tensors)

    def reading(self, index: MetadataIndex, nbytes: int) -> ChunkReading | None:
        """The ``nbytes`` of the saved chunk ``index``'s tensor, to read in parts from first to last, checked once
        the last arrives; ``None`` where the manifest records the entry as an archive to read whole (earlier
        releases')."""
        info = self._metadata.storage_data[index]
        record, where = self._entries.of(info, index.fqn)
        if record.data_offset < 0:
            return None
        return ChunkReading(self._open(info.relative_path), record, nbytes, where)

    def _recorded(self, index: MetadataIndex) -> EntryRecord | None:
        info = self._metadata.storage_data.get(index)
        return None if info is None else self._entries.recorded(info.relative_path, info.offset, info.length)

    def _place_of(self, index: MetadataIndex) -> tuple[str, int]:
        info = self._metadata.storage_data[index]
        return info.relative_path, info.offset

    def read_entry(self, index: MetadataIndex, into: memoryview | None = None) -> bytearray | None:
        """The entry ``index``: a value's bytes, whole; or a tensor's bytes read into ``into``, checked."""
        info = self._metadata.storage_data[index]
        record, where = self._entries.of(info, index.fqn)
        f = self._open(info.relative_path)
        if into is None:
            return _read_whole(f, record, where)
        _read_entry(f, record, into, where)
        return None

    def _open(self, name: str) -> IO[bytes]:
        if self._closed:
            raise RuntimeError(f"{self.place} {CLOSED_EARLY}")
        if name not in self._files:
            self._files[name] = self.place.open(name)
        return self._files[name]

    def close(self) -> None:
        self._closed = True
        for f in self._files.values():
            f.close()
        self._files.clear()


class ChunkReading:
    """The bytes of one saved chunk's tensor, read in parts in their order; their CRC-32 computed as they arrive and
    checked against the manifest's once the last has.

    Args:
        f: the file that holds the entry.
        record: the entry's record.
        nbytes: the size of its tensor's bytes.
        where: the entry, for messages.
    """

    def __init__(self, f: IO[bytes], record: EntryRecord, nbytes: int, where: str) -> None:
        self._f = f
        self._record = record
        self._nbytes = nbytes
        self._where = where
        self._crc = 0
        self._done = 0

    def read_into(self, view: memoryview) -> None:
        """Read the next ``view.nbytes`` bytes of the tensor into ``view``.

        Raises:
            IntegrityError: the file ends early, or the tensor's bytes, all read, do not match their CRC-32.
        """
        if self._done + view.nbytes > self._nbytes:
            raise IntegrityError(f"{self._where}: read past the {self._nbytes} bytes of its tensor")
        self._f.seek(self._record.data_offset + self._done)
        self._crc = _read_into(self._f, view, self._where, self._crc)
        self._done += view.nbytes
        if self._done == self._nbytes:
            _check(self._crc, self._record.data_crc, self._where)


class SavedTensor:
    """One saved tensor of a directory, read whole when its object takes it: the
    :class:`~ignite_zero.loading.deferred.Source` of the views of its meta tensor.

    Args:
        saved: the directory's entries.
        fqn: the tensor's name.
        size: its shape.
    """

    def __init__(self, saved: SavedTensors, fqn: str, size: torch.Size) -> None:
        self._saved = saved
        self._fqn = fqn
        self._size = size

    def read(self, view: torch.Tensor) -> torch.Tensor:
        whole = self._saved.read(self._fqn)
        if self._is_whole(view):
            return whole
        return torch.empty(0, dtype=view.dtype).set_(
            whole.untyped_storage(), view.storage_offset(), view.size(), view.stride()
        )

    def read_into(self, view: torch.Tensor, target: torch.Tensor) -> bool:
        if not (self._is_whole(view) and self._saved.fits(self._fqn, target)):
            return False
        self._saved.read(self._fqn, target)
        return True

    def _is_whole(self, view: torch.Tensor) -> bool:
        return view.storage_offset() == 0 and view.shape == self._size and view.is_contiguous()


@dataclasses.dataclass(frozen=True)
class Fill:
    """What :meth:`SavedTensors.plan` found: the values and the tensors of a state, each in one entry.

    A collective load reads the values when it reads what every object needs, and the tensors, into the objects'
    own memory, only once every rank has checked its entries.
    """

    saved: SavedTensors
    state: dict[str, Any]
    values: list[tuple[MetadataIndex, tuple[Any, ...]]]
    tensors: list[tuple[MetadataIndex, torch.Tensor]]

    def read_values(self, weights_only: bool = True) -> None:
        """Read each value and put it where it was in the state, as DCP's planner loads it (with
        ``torch.load(..., weights_only=weights_only)``)."""
        for index, path in self.values:
            content = self.saved.read_entry(index)
            assert content is not None
            node: Any = self.state
            for step in path[:-1]:
                node = node[step]
            node[path[-1]] = load_value(content, f"{self.saved.place.location()}, entry {index.fqn}", weights_only)

    def read_tensors(self) -> None:
        """Read each tensor straight into its place."""
        for index, target in self.tensors:
            self.saved.read_entry(index, torch_zip.tensor_bytes(target))


def _block_of(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The offsets and sizes of a tensor that is whole."""
    return (0,) * tensor.dim(), tuple(tensor.shape)


def _holds(saved: TensorStorageMetadata, offsets: Sequence[int], sizes: Sequence[int], local: torch.Tensor) -> bool:
    """Whether one chunk of ``saved`` is exactly the block ``offsets``, ``sizes``, which ``local`` holds in CPU memory
    laid out as saved."""
    block = (tuple(offsets), tuple(sizes))
    chunks = {(tuple(chunk.offsets), tuple(chunk.sizes)) for chunk in saved.chunks}
    return _laid_out(local, saved.properties.dtype) and tuple(local.shape) == block[1] and block in chunks


def _laid_out(target: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the bytes of a saved tensor of ``dtype`` can be read straight into ``target``: one run of CPU memory."""
    return target.device.type == "cpu" and target.is_contiguous() and target.dtype == dtype


def _read_saved_into(f: IO[bytes], record: EntryRecord, target: torch.Tensor, dtype: torch.dtype, where: str) -> bool:
    """Read a saved tensor straight into ``target`` if it is laid out alike in CPU memory; else read nothing and
    return ``False``."""
    if record.data_offset < 0 or not _laid_out(target, dtype):
        return False
    _read_entry(f, record, torch_zip.tensor_bytes(target), where)
    return True


def _read_saved(
    f: IO[bytes], record: EntryRecord, sizes: Sequence[int], dtype: torch.dtype, where: str
) -> torch.Tensor:
    """A saved tensor, read into a new one."""
    if record.data_offset < 0:  # written by torch.save (4 GiB or more): its archive, read whole
        return torch.load(io.BytesIO(_read_whole(f, record, where)), map_location="cpu", weights_only=True)
    saved = torch.empty(tuple(sizes), dtype=dtype)
    _read_entry(f, record, torch_zip.tensor_bytes(saved), where)
    return saved


def _whole(item: ReadItem, sizes: Sequence[int]) -> bool:
    return all(start == 0 for start in item.storage_offsets) and tuple(item.lengths) == tuple(sizes)


def _read_into(f: IO[bytes], view: memoryview, where: str, crc: int = 0) -> int:
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


def _read_entry(f: IO[bytes], record: EntryRecord, data: memoryview, where: str) -> None:
    """Read an archive's entry: its tensor's bytes into ``data``, the rest (headers, pickle, directory) around it
    into a small buffer, each byte checked by the CRC-32 of the tensor's bytes and of the whole entry."""
    f.seek(record.offset)
    head = bytearray(record.data_offset - record.offset)
    tail = bytearray(record.offset + record.length - record.data_offset - data.nbytes)
    crc = _read_into(f, memoryview(head), where)
    data_crc = _read_into(f, data, where)
    crc = _read_into(f, memoryview(tail), where, zlib_ng.crc32_combine(crc, data_crc, data.nbytes))
    _check(data_crc, record.data_crc, where)
    _check(crc, record.crc, where)


def _read_whole(f: IO[bytes], record: EntryRecord, where: str) -> bytearray:
    f.seek(record.offset)
    data = bytearray(record.length)
    _check(_read_into(f, memoryview(data), where), record.crc, where)
    return data


def _check(crc: int, expected: int, where: str) -> None:
    if crc != expected:
        raise IntegrityError(f"{where} is corrupt (CRC-32 {crc:#010x}, {expected:#010x} expected)")
