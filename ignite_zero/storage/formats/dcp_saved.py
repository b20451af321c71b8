"""The entries of a DCP directory that we wrote, read without DCP's planning (:class:`SavedTensors`): whole
tensors by name when their objects take them, a rank's own shards where each is one saved chunk, and a tensor's
bytes in order for a consolidation.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import IO, Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.tensor import DTensor

from ignite_zero import _compat
from ignite_zero.storage.formats import torch_zip
from ignite_zero.storage.formats.base import CLOSED_EARLY, IntegrityError
from ignite_zero.storage.formats.dcp_entries import (
    EntryRecord,
    RecordedEntries,
    check_crc,
    laid_out,
    read_checked,
    read_entries,
    read_entry,
    read_saved,
    read_saved_into,
    read_whole,
)
from ignite_zero.storage.formats.dcp_flat import flat_state
from ignite_zero.storage.formats.trust import load_value
from ignite_zero.storage.places import Place

__all__ = ["ChunkReading", "InPlaceReads", "SavedTensor", "SavedTensors"]


class SavedTensors:
    """The entries of a checkpoint directory that
    :class:`~ignite_zero.storage.formats.dcp_files.PlaceStorageWriter` wrote, read without DCP's planning: each
    straight into its place in the destination, checked as it arrives.

    What a load reads whole (a model every rank holds, a ZeRO optimizer's partition) is read this way, by name, when
    its object takes it, into the object's own tensors, which spares the page faults of new memory. A rank's own
    shards, on the world size that saved them, are read this way too (:meth:`in_place_reads`).

    Args:
        place: the checkpoint directory.
        records: every file's entries, by name, from the manifest.
        metadata: the directory's ``.metadata``.
    """

    def __init__(self, place: Place, records: Mapping[str, Sequence[EntryRecord]], metadata: Metadata) -> None:
        self.place = place
        self._entries = RecordedEntries(place, records)
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
            if not read_saved_into(f, record, region, dtype, where):
                region.copy_(read_saved(f, record, chunk.sizes, dtype, where))
        return into

    def fits(self, fqn: str, target: torch.Tensor) -> bool:
        """Whether :meth:`read` can read ``fqn`` into ``target``."""
        storage = self._metadata.state_dict_metadata.get(fqn)
        return (
            isinstance(storage, TensorStorageMetadata)
            and laid_out(target, storage.properties.dtype)
            and target.shape == storage.size
        )

    def in_place_reads(self, state: dict[str, Any]) -> InPlaceReads | None:
        """How to fill ``state``, a nested state as DCP loads it (tensors, ``DTensor``\\ s and values), in place and
        without DCP's planning: where each of its tensors is exactly one saved chunk (a rank's own shards, on the
        world size that saved them; a tensor saved whole). ``None`` where some tensor needs resharding or an entry is
        not recorded (DCP reads it then). Reads nothing.

        DCP's planning costs a noticeable part of a load of shards: this skips it.
        """
        flat, paths = flat_state(state)
        values: list[tuple[MetadataIndex, tuple[Any, ...]]] = []
        tensors: list[tuple[tuple[str, int], MetadataIndex, torch.Tensor]] = []
        for fqn, value in flat.items():
            saved = self._metadata.state_dict_metadata.get(fqn)
            if isinstance(value, DTensor) or type(value) in (torch.Tensor, torch.nn.Parameter):
                local = _compat.dtensor_local(value) if isinstance(value, DTensor) else value
                offsets, sizes = _compat.dtensor_block(value) if isinstance(value, DTensor) else _block_of(value)
                entry = self._entries_by_chunk.get((fqn, offsets))
                if entry is None or not isinstance(saved, TensorStorageMetadata):
                    return None
                if not _holds(saved, offsets, sizes, local):
                    return None
                index, info = entry
                if self._entries.recorded(info.relative_path, info.offset, info.length) is None:
                    return None
                tensors.append(((info.relative_path, info.offset), index, local.detach()))
            elif isinstance(saved, BytesStorageMetadata) and not isinstance(value, torch.Tensor):
                if self._recorded(MetadataIndex(fqn)) is None:
                    return None
                values.append((MetadataIndex(fqn), paths[fqn]))
            else:  # a ShardedTensor (FSDP1's), or what the directory does not hold: DCP reads it, or says so
                return None
        values.sort(key=lambda read: self._place_of(read[0]))  # in file order, as DCP's reader reads
        tensors.sort(key=lambda read: read[0])
        return InPlaceReads(self, state, values, [(index, target) for _, index, target in tensors])

    @functools.cached_property
    def _entries_by_chunk(self) -> dict[tuple[str, tuple[int, ...] | None], tuple[MetadataIndex, Any]]:
        """Each saved entry's index and where it lies, by its name and offsets: a tuple hashes and compares at a
        fraction of the cost of DCP's ``MetadataIndex``, looked up for each of thousands of tensors."""
        return {(index.fqn, index.offset): (index, info) for index, info in self._metadata.storage_data.items()}

    def reading(self, index: MetadataIndex, nbytes: int) -> ChunkReading:
        """The ``nbytes`` of the saved chunk ``index``'s tensor, to read in parts from first to last, checked once
        the last arrives."""
        info = self._metadata.storage_data[index]
        record, where = self._entries.of(info, index.fqn)
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
            return read_whole(f, record, where)
        read_entry(f, record, into, where)
        return None

    def read_entries(self, reads: Sequence[tuple[MetadataIndex, memoryview]]) -> None:
        """Read the tensors' bytes of the entries ``reads`` names into their views, checked, neighbours in a file
        together (see :func:`~.dcp_entries.read_entries`)."""
        by_file: dict[str, list[tuple[EntryRecord, memoryview, str]]] = {}
        for index, into in reads:
            info = self._metadata.storage_data[index]
            record, where = self._entries.of(info, index.fqn)
            by_file.setdefault(info.relative_path, []).append((record, into, where))
        for name, part in by_file.items():
            read_entries(self._open(name), part)

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
        self._crc = read_checked(self._f, view, self._where, self._crc)
        self._done += view.nbytes
        if self._done == self._nbytes:
            check_crc(self._crc, self._record.data_crc, self._where)


class SavedTensor:
    """One saved tensor of a directory, read whole when its object takes it: the
    :class:`~ignite_zero.adapters.deferred.Source` of the views of its meta tensor.

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
class InPlaceReads:
    """What :meth:`SavedTensors.in_place_reads` found: the values and the tensors of a state, each in one entry.

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
        """Read each tensor into its place, neighbours in a file together."""
        self.saved.read_entries([(index, torch_zip.tensor_bytes(target)) for index, target in self.tensors])


def _block_of(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The offsets and sizes of a tensor that is whole."""
    return (0,) * tensor.dim(), tuple(tensor.shape)


def _holds(saved: TensorStorageMetadata, offsets: tuple[int, ...], sizes: tuple[int, ...], local: torch.Tensor) -> bool:
    """Whether one chunk of ``saved`` is exactly the block ``offsets``, ``sizes``, which ``local`` holds in CPU memory
    laid out as saved."""
    if not (laid_out(local, saved.properties.dtype) and local.shape == sizes):
        return False
    return any(chunk.offsets == offsets and chunk.sizes == sizes for chunk in saved.chunks)
