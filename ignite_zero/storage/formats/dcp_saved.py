"""The entries of a DCP directory that we wrote, read without DCP's planning (:class:`SavedTensors`): whole
tensors by name when their objects take them, a rank's own shards where each is one saved chunk, and a tensor's
bytes in order for a consolidation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import IO, Any

import torch
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
    read_saved,
    read_saved_into,
    read_whole,
)
from ignite_zero.storage.formats.dcp_flat import flat_state
from ignite_zero.storage.formats.dcp_index import EntryIndex, EntryPlace
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
        index: the index of its entries.
    """

    def __init__(self, place: Place, records: Mapping[str, Sequence[EntryRecord]], index: EntryIndex) -> None:
        self.place = place
        self._entries = RecordedEntries(place, records)
        self._index = index
        self._files: dict[str, IO[bytes]] = {}
        self._closed = False

    def read(self, fqn: str, into: torch.Tensor | None = None) -> torch.Tensor:
        """The saved tensor ``fqn``, whole, read into ``into`` (a contiguous CPU tensor of its shape and dtype) or
        into a new tensor.

        Raises:
            IntegrityError: an entry read is corrupt or truncated, or the manifest does not record it.
        """
        layout = self._index.layout(fqn)
        assert layout is not None, f"{fqn} is a value"
        dtype = layout.dtype
        if into is None:
            into = torch.empty(layout.size, dtype=dtype)
        for chunk in layout.chunks:
            record, where = self._entries.of(chunk.place, fqn)
            f = self._open(chunk.place.relative_path)
            region = into
            for dim, (start, length) in enumerate(zip(chunk.offsets, chunk.sizes)):
                region = region.narrow(dim, start, length)
            if not read_saved_into(f, record, region, dtype, where):
                region.copy_(read_saved(f, record, chunk.sizes, dtype, where))
        return into

    def fill(self, flat: dict[str, Any], weights_only: bool = True) -> None:
        """Fill ``flat``, a flat template (a tensor of its saved shape and dtype for each tensor, anything for each
        value, as :func:`~.directory.template` makes it), with the entries it names, whole: each tensor read into it,
        chunk by chunk, each value as ``torch.load(..., weights_only=weights_only)`` reads it.

        Raises:
            IntegrityError: an entry read is corrupt or truncated, or the manifest does not record it.
        """
        for fqn, value in flat.items():
            if isinstance(value, torch.Tensor):
                self.read(fqn, value)
                continue
            place = self._index.value_place(fqn)
            assert place is not None, f"{fqn} is a tensor"
            where = f"{self.place.location()}, entry {fqn}"
            flat[fqn] = load_value(self.read_value(fqn, place), where, weights_only)

    def fits(self, fqn: str, target: torch.Tensor) -> bool:
        """Whether :meth:`read` can read ``fqn`` into ``target``."""
        layout = self._index.layout(fqn) if fqn in self._index.paths else None
        return layout is not None and laid_out(target, layout.dtype) and target.shape == layout.size

    def in_place_reads(self, state: dict[str, Any]) -> InPlaceReads | None:
        """How to fill ``state``, a nested state as DCP loads it (tensors, ``DTensor``\\ s and values), in place and
        without DCP's planning: where each of its tensors is exactly one saved chunk (a rank's own shards, on the
        world size that saved them; a tensor saved whole). ``None`` where some tensor needs resharding or an entry is
        not recorded (DCP reads it then). Reads nothing.

        DCP's planning costs a noticeable part of a load of shards: this skips it.
        """
        flat, paths = flat_state(state)
        index, entries = self._index, self._entries
        values: list[tuple[str, EntryPlace, tuple[Any, ...]]] = []
        tensors: list[tuple[str, EntryPlace, torch.Tensor]] = []
        for fqn, value in flat.items():
            if isinstance(value, DTensor) or type(value) in (torch.Tensor, torch.nn.Parameter):
                local = _compat.dtensor_local(value) if isinstance(value, DTensor) else value
                offsets, sizes = _compat.dtensor_block(value) if isinstance(value, DTensor) else _block_of(value)
                chunk = index.chunk(fqn, offsets)
                if chunk is None:
                    return None
                dtype, saved_sizes, place = chunk
                if saved_sizes != sizes or local.shape != sizes or not laid_out(local, dtype):
                    return None
                if entries.recorded(*place) is None:
                    return None
                tensors.append((fqn, place, local.detach()))
            elif not isinstance(value, torch.Tensor) and (at := index.value_place(fqn)) is not None:
                if entries.recorded(*at) is None:
                    return None
                values.append((fqn, at, paths[fqn]))
            else:  # a ShardedTensor (FSDP1's), or what the directory does not hold: DCP reads it, or says so
                return None
        values.sort(key=lambda read: read[1])  # in file order, as DCP's reader reads
        tensors.sort(key=lambda read: read[1])
        return InPlaceReads(self, state, values, tensors)

    def reading(self, fqn: str, place: EntryPlace, nbytes: int) -> ChunkReading:
        """The ``nbytes`` of the tensor of the saved chunk of ``fqn`` at ``place``, to read in parts from first to
        last, checked once the last arrives."""
        record, where = self._entries.of(place, fqn)
        return ChunkReading(self._open(place.relative_path), record, nbytes, where)

    def read_value(self, fqn: str, place: EntryPlace) -> bytearray:
        """The bytes of the value ``fqn``, whose entry lies at ``place``, checked."""
        record, where = self._entries.of(place, fqn)
        return read_whole(self._open(place.relative_path), record, where)

    def read_entries(self, reads: Sequence[tuple[str, EntryPlace, memoryview]]) -> None:
        """Read the tensors' bytes of the entries ``reads`` names (each by its name and place) into their views,
        checked, neighbours in a file together (see :func:`~.dcp_entries.read_entries`)."""
        by_file: dict[str, list[tuple[EntryRecord, memoryview, str]]] = {}
        for fqn, place, into in reads:
            record, where = self._entries.of(place, fqn)
            by_file.setdefault(place.relative_path, []).append((record, into, where))
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
    #: each value's name, place, and path in the state
    values: list[tuple[str, EntryPlace, tuple[Any, ...]]]
    #: each tensor's name and place, and the tensor to read it into
    tensors: list[tuple[str, EntryPlace, torch.Tensor]]

    def read_values(self, weights_only: bool = True) -> None:
        """Read each value and put it where it was in the state, as DCP's planner loads it (with
        ``torch.load(..., weights_only=weights_only)``)."""
        for fqn, place, path in self.values:
            content = self.saved.read_value(fqn, place)
            node: Any = self.state
            for step in path[:-1]:
                node = node[step]
            node[path[-1]] = load_value(content, f"{self.saved.place.location()}, entry {fqn}", weights_only)

    def read_tensors(self) -> None:
        """Read each tensor into its place, neighbours in a file together."""
        self.saved.read_entries([(fqn, place, torch_zip.tensor_bytes(target)) for fqn, place, target in self.tensors])


def _block_of(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The offsets and sizes of a tensor that is whole."""
    return (0,) * tensor.dim(), tuple(tensor.shape)
