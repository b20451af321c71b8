"""A sharded checkpoint directory read as the state of one checkpoint file, in bounded memory: what
``ignite-zero consolidate`` writes.

:func:`unread_state` returns the state that :meth:`DirectoryReader.load
<ignite_zero.storage.formats.directory.DirectoryReader.load>` returns, with every tensor allocated but not read
(memory the kernel has not handed out yet, so not resident), and :class:`StreamedTensors`, the source of their
bytes for :func:`~ignite_zero.storage.formats.torch_zip.write_archive`. Asked for a slice of a tensor's memory, in
the order the writer writes them, it reads the rows of the tensor that hold it from every saved chunk into a window
of its own, and hands the window's bytes on. Each chunk's bytes are read once, in order, and checked against the
manifest's CRC-32 when the last of them arrives: a corrupt entry fails the write before the file is committed.

A directory without manifest (another tool's) is read unverified, each of its tensors whole when the writer comes
to it: memory then holds the largest tensor.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy
import torch

from ignite_zero.storage.formats.dcp_saved import ChunkReading, SavedTensors
from ignite_zero.storage.formats.directory import Contents, load_whole, nest
from ignite_zero.storage.formats.torch_zip import tensor_bytes
from ignite_zero.storage.places import Place

__all__ = ["WINDOW_BYTES", "StreamedTensors", "unread_state"]

#: The rows of a tensor read at a time, at most (a row larger than this is read alone).
WINDOW_BYTES = 64 << 20


def unread_state(
    place: Place,
    contents: Contents,
    progress: Callable[[int, int], None] | None = None,
    trusted: bool = False,
) -> tuple[dict[str, Any], StreamedTensors]:
    """The state of the checkpoint directory at ``place`` as one file holds it (but with dict keys as the directory
    stores them, as :meth:`~ignite_zero.storage.formats.directory.DirectoryReader.load` gives them), its tensors
    unread, and the source of their bytes; ``trusted``: its pickles unpickled whatever they hold (see
    :mod:`~ignite_zero.storage.formats.trust`).

    Args:
        place: the checkpoint directory.
        contents: what it holds (:func:`~.directory.read_contents`).
        progress: called with the bytes read so far and the total, after each window.
        trusted: unpickle whatever its pickles hold.

    Raises:
        UnsafeCheckpointError: a pickle of it holds anything but data, unless ``trusted``.
    """
    index = contents.entry_index
    layouts = {name: index.layout(name) for name in index.names}
    values: dict[str, Any] = {name: None for name, layout in layouts.items() if layout is None}
    load_whole(values, place, contents, trusted)  # the small values, read and checked now
    tensors = {
        name: torch.empty(layout.size, dtype=layout.dtype) for name, layout in layouts.items() if layout is not None
    }
    flat = {name: tensors[name] if name in tensors else values[name] for name in index.names}
    return nest(index, flat), StreamedTensors(place, contents, tensors, progress, trusted)


class StreamedTensors:
    """The bytes of a state's tensors, read from a checkpoint directory as a writer asks for them.

    Args:
        place: the checkpoint directory.
        contents: what it holds (:func:`~.directory.read_contents`); without the manifest's records (another tool's
            directory), each tensor is read whole.
        tensors: the state's tensors, unread, by their names in its index.
        progress: called with the bytes read so far and the total, after each window.
        trusted: a directory without records is read by DCP, whose ``.metadata`` is then unpickled whatever it holds.
    """

    def __init__(
        self,
        place: Place,
        contents: Contents,
        tensors: dict[str, torch.Tensor],
        progress: Callable[[int, int], None] | None = None,
        trusted: bool = False,
    ) -> None:
        self._trusted = trusted
        self._place = place
        self._contents = contents
        records, self._index = contents
        self._saved = None if records is None else SavedTensors(place, records, self._index)
        by_address = sorted((tensor.untyped_storage().data_ptr(), name) for name, tensor in tensors.items())
        self._starts = [address for address, _ in by_address]
        self._names = [name for _, name in by_address]
        self._tensors = tensors
        self._progress = progress
        self._total = sum(tensor.nbytes for tensor in tensors.values())
        self._done = 0
        self._window: _Window | None = None
        self._buffer = torch.empty(0, dtype=torch.uint8)  # the window's memory, reused
        self._readings: dict[str, list[_Chunk]] = {}

    def bytes_of(self, piece: memoryview) -> list[memoryview]:
        """The bytes of ``piece``, a slice of one of the tensors' memory (see ``write_archive``'s ``source``)."""
        address = numpy.frombuffer(piece, dtype=numpy.uint8).ctypes.data
        index = bisect.bisect_right(self._starts, address) - 1
        name = self._names[index]
        start = address - self._starts[index]
        stop = start + piece.nbytes
        parts = []
        while start < stop:  # a slice may run on into the next window
            window = self._window
            if window is None or window.name != name or not window.start <= start < window.stop:
                self._window = None  # its memory free before the next is read
                window = self._window = self._read(name, start)
                self._done += window.stop - window.start
                if self._progress is not None:
                    self._progress(min(self._done, self._total), self._total)
            end = min(stop, window.stop)
            part = window.data[start - window.start : end - window.start]
            parts.append(part if end == stop else memoryview(bytes(part)))  # the next window reuses the memory
            start = end
        return parts

    def read_all(self) -> None:
        """Read every tensor whole into its own memory (for a writer that reads the memory itself)."""
        for name, tensor in self._tensors.items():
            self._load_whole(name, tensor)

    def close(self) -> None:
        if self._saved is not None:
            self._saved.close()

    def _load_whole(self, name: str, into: torch.Tensor) -> None:
        if self._saved is not None:  # the files this source keeps open
            self._saved.read(name, into)
        else:
            load_whole({name: into}, self._place, self._contents, self._trusted)

    def _read(self, name: str, start: int) -> _Window:
        """The window of the tensor ``name`` that starts with the row holding its byte ``start``."""
        tensor = self._tensors[name]
        chunks = self._chunks(name, tensor)
        if chunks is None:  # into memory of its own, freed once the writer is past it
            whole = torch.empty_like(tensor)
            self._load_whole(name, whole)
            data = tensor_bytes(whole)
            return _Window(name, 0, data.nbytes, data)
        shape = tuple(tensor.shape) or (1,)
        row_bytes = math.prod(shape[1:]) * tensor.element_size()
        first = start // row_bytes
        last = min(shape[0], first + max(1, WINDOW_BYTES // row_bytes))
        nbytes = (last - first) * row_bytes
        if self._buffer.nbytes < nbytes:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8)
        rows = self._buffer[:nbytes].view(tensor.dtype).view(last - first, *shape[1:])
        for chunk in chunks:
            _read_rows(chunk, rows, first, last)
        return _Window(name, first * row_bytes, last * row_bytes, tensor_bytes(rows))

    def _chunks(self, name: str, tensor: torch.Tensor) -> list[_Chunk] | None:
        """Each chunk of the tensor ``name``, its reading made at the tensor's first window; ``None`` where the
        tensor is read whole (no manifest's records)."""
        if self._saved is None:
            return None
        if name not in self._readings:
            layout = self._index.layout(name)
            assert layout is not None, f"{name} is a value"
            chunks = []
            for chunk in layout.chunks:
                nbytes = math.prod(chunk.sizes) * tensor.element_size()
                reading = self._saved.reading(name, chunk.place, nbytes)
                chunks.append(_Chunk(chunk.offsets or (0,), chunk.sizes or (1,), reading))
            self._readings[name] = chunks
        return self._readings[name]


def _read_rows(chunk: _Chunk, rows: torch.Tensor, first: int, last: int) -> None:
    """Read what ``chunk`` holds of the rows ``[first, last)`` of its tensor into ``rows``, those rows: the chunk's
    next bytes."""
    offsets, sizes = chunk.offsets, chunk.sizes
    low, high = max(first, offsets[0]), min(last, offsets[0] + sizes[0])
    if low >= high:
        return
    region = rows[low - first : high - first]
    for dim in range(1, len(sizes)):
        region = region.narrow(dim, offsets[dim], sizes[dim])
    if region.is_contiguous():  # the chunk holds whole rows: read straight into the window
        chunk.reading.read_into(tensor_bytes(region))
    else:  # a part of each row (a tensor sharded on another dimension): read, then put in place
        part = torch.empty((high - low, *sizes[1:]), dtype=rows.dtype)
        chunk.reading.read_into(tensor_bytes(part))
        region.copy_(part)


class _Chunk(NamedTuple):
    """A saved chunk of a tensor (a scalar's as one row of one element) and the reading of its bytes."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    reading: ChunkReading


class _Window:
    """The bytes ``[start, stop)`` of a tensor's memory, read."""

    def __init__(self, name: str, start: int, stop: int, data: memoryview) -> None:
        self.name = name
        self.start = start
        self.stop = stop
        self.data = data
