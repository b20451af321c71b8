"""The index of a sharded checkpoint's entries (:class:`EntryIndex`): each entry's path in the saved state, each
tensor's dtype and shape, its chunks and where each lies, and where each value lies. It is what a load needs of
DCP's ``.metadata``, as plain data in a file of its own beside it (JSON, its table of integers compressed), sealed by
the manifest as every file is: a load of our own checkpoint neither unpickles ``.metadata`` nor builds its thousands
of objects, and checks every size and offset against the files over arrays.

``.metadata`` is still written, for DCP's own readers and for loads that DCP plans (resharding); a checkpoint without
an index (another tool's, or written before it) is indexed from its ``.metadata``.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ignite_zero import _compat
from ignite_zero.storage.formats.base import IntegrityError

__all__ = ["EntryIndex", "EntryPlace", "SavedChunk", "TensorLayout"]

# The columns of the index's table, a row for each chunk of a tensor and for each value; a tensor's shape, its chunk's
# offsets and its chunk's sizes follow, each padded to the largest number of dimensions (a shape padded with 1, an
# offset with 0). A value's dtype is -1; a tensor without chunks has one row, its file -1.
_NAME, _FILE, _OFFSET, _LENGTH, _DTYPE, _NDIM = range(6)
_FIXED = 6
_TABLE = np.dtype("<i8")
# No size, offset or length of a checkpoint comes near it: beyond, a product or a sum of two might overflow.
_LARGEST = 1 << 52


class EntryPlace(NamedTuple):
    """Where an entry lies: its file, offset and length (the fields of DCP's storage information, by its names)."""

    relative_path: str
    offset: int
    length: int


class SavedChunk(NamedTuple):
    """A chunk of a saved tensor: the block it holds and where its entry lies."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    place: EntryPlace


class TensorLayout(NamedTuple):
    """A saved tensor: its dtype, shape and chunks."""

    dtype: torch.dtype
    size: torch.Size
    chunks: tuple[SavedChunk, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.size) * self.dtype.itemsize


class EntryIndex:
    """The entries of a sharded checkpoint, by their flat names (``names``, in the order saved), from the index's file
    (:meth:`parse`) or from DCP's metadata (:meth:`of_metadata`). Its sizes and offsets are what that file or
    ``.metadata`` says: :meth:`check_bounds` checks them against the files before anything is allocated from them.

    Args:
        names: each entry's flat name, in the order saved.
        paths: each entry's path in the nested state it was saved from, in the same order.
        files: the files its table refers to (:attr:`files`).
        dtypes: the dtypes its table refers to.
        table: a row of 64-bit integers for each chunk of a tensor and each value, entry by entry in order (the
            columns are the module's ``_NAME`` to ``_NDIM``, then the padded shape, offsets and sizes).
    """

    def __init__(
        self,
        names: list[str],
        paths: list[tuple[Any, ...]],
        files: list[str],
        dtypes: list[torch.dtype],
        table: np.ndarray,
    ) -> None:
        self.names = names
        self.paths = dict(zip(names, paths))
        self.files = files
        self._dtypes = dtypes
        self._table = table
        self._dims = (table.shape[1] - _FIXED) // 3
        self._rows: list[list[int]] = table.tolist()
        starts = _starts(table[:, _NAME])
        stops = [*starts[1:].tolist(), len(table)]
        self._rows_of = {names[self._rows[start][_NAME]]: (start, stop) for start, stop in zip(starts.tolist(), stops)}

    @classmethod
    def of_metadata(cls, metadata: Metadata, where: str) -> EntryIndex:
        """The index of what DCP's ``metadata`` describes.

        Raises:
            IntegrityError: a chunk of a tensor is not among the entries, or not of the tensor's dimensions.
        """
        places = {
            (index.fqn, None if index.offset is None else tuple(index.offset)): info
            for index, info in metadata.storage_data.items()
        }
        described = metadata.state_dict_metadata
        tensors = [storage for storage in described.values() if isinstance(storage, TensorStorageMetadata)]
        dims = max((len(storage.size) for storage in tensors), default=0)
        files: dict[str, int] = {}
        dtypes: dict[torch.dtype, int] = {}
        rows: list[list[int]] = []
        paths = []
        for number, (name, storage) in enumerate(described.items()):
            paths.append(_compat.dcp_entry_path(metadata, name))
            if not isinstance(storage, TensorStorageMetadata):
                info = places.get((name, None))
                if info is None:
                    raise IntegrityError(f"{where}: value {name} has no entry (corrupt, forged)")
                file = files.setdefault(info.relative_path, len(files))
                rows.append([number, file, info.offset, info.length, -1, 0, *[1] * dims, *[0] * dims, *[1] * dims])
                continue
            dtype = dtypes.setdefault(storage.properties.dtype, len(dtypes))
            size = list(storage.size)
            pad = dims - len(size)
            shape = [*size, *[1] * pad]
            if not storage.chunks:
                rows.append([number, -1, 0, 0, dtype, len(size), *shape, *[0] * dims, *[1] * dims])
            for chunk in storage.chunks:
                info = places.get((name, tuple(chunk.offsets)))
                if info is None or len(chunk.offsets) != len(size) or len(chunk.sizes) != len(size):
                    raise IntegrityError(
                        f"{where}: a chunk of tensor {name} lies outside it or its entry (corrupt, forged)"
                    )
                file = files.setdefault(info.relative_path, len(files))
                offsets, sizes = [*chunk.offsets, *[0] * pad], [*chunk.sizes, *[1] * pad]
                rows.append([number, file, info.offset, info.length, dtype, len(size), *shape, *offsets, *sizes])
        try:
            table = np.array(rows, dtype=np.int64).reshape(-1, _FIXED + 3 * dims)
        except (TypeError, ValueError, OverflowError) as error:
            raise IntegrityError(f"{where}: a size or an offset is not an integer (corrupt, forged): {error}") from None
        return cls(list(described), paths, list(files), list(dtypes), table)

    def to_json(self) -> bytes:
        """The index as its file holds it (:meth:`parse` reads it back): JSON of the paths, files and dtypes, and the
        table as one string, base64 of its little-endian integers compressed (a tenth of their size)."""
        value = {
            "paths": list(map(list, self.paths.values())),
            "files": self.files,
            "dtypes": [str(dtype).removeprefix("torch.") for dtype in self._dtypes],
            "dims": self._dims,
            "rows": len(self._table),
            "table": base64.b64encode(zlib.compress(self._table.astype(_TABLE).tobytes(), 1)).decode("ascii"),
        }
        return json.dumps(value, separators=(",", ":")).encode()

    @classmethod
    def parse(cls, content: bytes, recorded: int) -> EntryIndex:
        """The index as :meth:`to_json` gives it.

        Args:
            content: the bytes of the index.
            recorded: how many entries the manifest records: the table has a row for each at most, and one for each
                tensor without chunks; nothing larger is inflated.

        Raises:
            ValueError: ``content`` is not such an index, or its rows refer to what it does not hold.
        """
        value = json.loads(content)
        if not isinstance(value, dict):
            raise ValueError("not a mapping")
        paths, files, dtype_names, dims, rows, encoded = map(
            value.get, ("paths", "files", "dtypes", "dims", "rows", "table")
        )
        if not (isinstance(paths, list) and all(_is_path(path) for path in paths)):
            raise ValueError("its paths are not lists of names and positions")
        if not (isinstance(files, list) and all(_is_file_name(name) for name in files)):
            raise ValueError("its files are not names of files of the directory")
        if len(set(files)) < len(files):  # entries of two names for one file would escape the check of overlaps
            raise ValueError("it names a file twice")
        if not (isinstance(dtype_names, list) and type(dims) is int and 0 <= dims <= 64 and isinstance(encoded, str)):
            raise ValueError("it lacks its dtypes, dimensions or table")
        most_rows = recorded + len(paths)
        if type(rows) is not int or not 0 <= rows <= most_rows:
            raise ValueError(f"its table claims {rows} rows, more than the {most_rows} that its entries may take")
        dtypes = [_DTYPES.get(name) if isinstance(name, str) else None for name in dtype_names]
        if not all(isinstance(dtype, torch.dtype) for dtype in dtypes):
            raise ValueError(f"its dtypes {dtype_names} are not all torch's")
        width = _FIXED + 3 * dims
        nbytes = rows * width * _TABLE.itemsize
        try:
            inflating = zlib.decompressobj()
            data = inflating.decompress(base64.b64decode(encoded, validate=True), nbytes + 1)
        except (binascii.Error, zlib.error) as error:
            raise ValueError(f"its table is not compressed in base64: {error}") from error
        if len(data) != nbytes or not inflating.eof:
            raise ValueError(f"its table is not {rows} rows of {width} 64-bit integers")
        table = np.frombuffer(data, dtype=_TABLE).reshape(-1, width).astype(np.int64)
        _check_table(table, len(paths), len(files), len(dtypes), dims)
        names = [".".join(map(str, path)) for path in paths]  # as DCP names an entry by its path
        index = cls(names, [tuple(path) for path in paths], files, dtypes, table)  # type: ignore[arg-type]
        if len(index.paths) != len(paths):
            raise ValueError("two of its entries have one name")
        return index

    def layout(self, name: str) -> TensorLayout | None:
        """The saved tensor ``name``; ``None`` for a value.

        Raises:
            KeyError: no entry is so named.
        """
        start, stop = self._rows_of[name]
        first = self._rows[start]
        if first[_DTYPE] < 0:
            return None
        ndim, dims = first[_NDIM], self._dims
        chunks = tuple(
            SavedChunk(
                tuple(row[_FIXED + dims : _FIXED + dims + ndim]),
                tuple(row[_FIXED + 2 * dims : _FIXED + 2 * dims + ndim]),
                EntryPlace(self.files[row[_FILE]], row[_OFFSET], row[_LENGTH]),
            )
            for row in self._rows[start:stop]
            if row[_FILE] >= 0
        )
        return TensorLayout(self._dtypes[first[_DTYPE]], torch.Size(first[_FIXED : _FIXED + ndim]), chunks)

    def chunk(self, name: str, offsets: Sequence[int]) -> tuple[torch.dtype, tuple[int, ...], EntryPlace] | None:
        """The dtype, sizes and place of the chunk of the saved tensor ``name`` at ``offsets``; ``None`` where it has
        no such chunk or is no tensor. Looked up for each of thousands of tensors of a load: read off the table."""
        span = self._rows_of.get(name)
        if span is None:
            return None
        rows, ndim = self._rows, len(offsets)
        if rows[span[0]][_NDIM] != ndim or rows[span[0]][_DTYPE] < 0:
            return None
        at, wanted = _FIXED + self._dims, list(offsets)
        for n in range(*span):
            row = rows[n]
            if row[at : at + ndim] == wanted and row[_FILE] >= 0:
                sizes = tuple(row[at + self._dims : at + self._dims + ndim])
                return self._dtypes[row[_DTYPE]], sizes, EntryPlace(self.files[row[_FILE]], row[_OFFSET], row[_LENGTH])
        return None

    def value_place(self, name: str) -> EntryPlace | None:
        """Where the value ``name`` lies; ``None`` where the index has no such value."""
        span = self._rows_of.get(name)
        if span is None:
            return None
        row = self._rows[span[0]]
        return EntryPlace(self.files[row[_FILE]], row[_OFFSET], row[_LENGTH]) if row[_DTYPE] < 0 else None

    def check_bounds(self, file_sizes: Mapping[str, int], where: str) -> None:
        """Raise :class:`IntegrityError` unless every entry lies inside its file (of ``file_sizes``: a file missing
        there, one host's of a replicated checkpoint, bounds nothing) and over no other, and every tensor's chunks
        lie within it and their entries and hold all of it. ``where``: what the index was read from, for messages."""
        placed = self._table[self._table[:, _FILE] >= 0]
        file, offset, length = placed[:, _FILE], placed[:, _OFFSET], placed[:, _LENGTH]
        known = np.array([name in file_sizes for name in self.files], dtype=bool)
        sizes = np.array([file_sizes.get(name, 0) for name in self.files], dtype=np.int64)
        outside = (offset < 0) | (length < 0) | (offset > _LARGEST) | (length > _LARGEST)
        outside |= known[file] & (offset + length > sizes[file])
        if outside.any():
            row = placed[int(np.argmax(outside))].tolist()  # Python integers: a sum of two cannot overflow
            name, path = self.names[row[_NAME]], self.files[row[_FILE]]
            size = file_sizes.get(path, row[_OFFSET] + row[_LENGTH])
            raise IntegrityError(
                f"{where} places entry {name} at [{row[_OFFSET]}, {row[_OFFSET] + row[_LENGTH]}) of {path}, which has "
                f"{size} bytes: truncated, corrupt or forged"
            )
        order = np.lexsort((offset + length, offset, file))
        file, start, end = file[order], offset[order], (offset + length)[order]
        over = (file[1:] == file[:-1]) & (start[1:] < end[:-1])
        if over.any():
            first = int(np.argmax(over))
            a, b = (self.names[placed[order[n], _NAME]] for n in (first, first + 1))
            raise IntegrityError(f"{where} places entries {a} and {b} of {self.files[file[first]]} over each other")
        self._check_chunks(where)

    def _check_chunks(self, where: str) -> None:
        """The chunks' part of :meth:`check_bounds`."""
        tensors, dims = self._table[self._table[:, _DTYPE] >= 0], self._dims
        if not len(tensors):
            return
        shape = tensors[:, _FIXED : _FIXED + dims]
        offsets = tensors[:, _FIXED + dims : _FIXED + 2 * dims]
        sizes = tensors[:, _FIXED + 2 * dims :]
        itemsize = np.array([dtype.itemsize for dtype in self._dtypes], dtype=np.int64)[tensors[:, _DTYPE]]
        # past 2 ** 62 in floating point, a product overflows in integers: more bytes than any entry holds
        nbytes, fits = _nbytes(sizes, itemsize)
        inside = (np.abs(tensors[:, _FIXED:]) <= _LARGEST).all(axis=1) & fits
        inside &= ((offsets >= 0) & (sizes >= 0) & (offsets + sizes <= shape)).all(axis=1)
        inside &= nbytes <= tensors[:, _LENGTH]
        chunked = tensors[:, _FILE] >= 0
        if not inside[chunked].all():
            row = tensors[chunked][int(np.argmin(inside[chunked]))]
            raise IntegrityError(
                f"{where}: a chunk of tensor {self.names[row[_NAME]]} lies outside it or its entry (corrupt, forged)"
            )
        starts = _starts(tensors[:, _NAME])
        held = np.add.reduceat(np.where(chunked, nbytes, 0), starts)
        need, fits = _nbytes(shape[starts], itemsize[starts])
        short = (shape[starts] < 0).any(axis=1) | ~fits | (need > held)
        if short.any():
            name = self.names[tensors[starts[int(np.argmax(short))], _NAME]]
            raise IntegrityError(f"{where}: tensor {name} claims more bytes than its chunks hold: corrupt or forged")


def _nbytes(sizes: np.ndarray, itemsize: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The bytes of blocks of ``sizes`` (a row each) of items of ``itemsize``, and whether each is within 2 ** 62 (if
    not, its figure is meaningless)."""
    # a dimension of 0 counts as 1: a tensor of no elements whose other dimensions overflow cannot be made either
    fits = np.prod(np.maximum(np.abs(sizes), 1).astype(np.float64), axis=1) * itemsize < 2.0**62
    return np.prod(np.where(fits[:, None], sizes, 0), axis=1) * itemsize, fits


def _starts(column: np.ndarray) -> np.ndarray:
    """Where each run of equal values of ``column`` starts."""
    return np.flatnonzero(np.diff(column, prepend=-1)) if len(column) else np.zeros(0, dtype=np.int64)


def _is_path(path: object) -> bool:
    """Whether ``path`` is a path: names and positions (what they make is checked when they are nested)."""
    return (
        isinstance(path, list)
        and bool(path)
        and all(type(step) is str or (type(step) is int and step >= 0) for step in path)
    )


def _is_file_name(name: object) -> bool:
    """Whether ``name`` names a file of the directory itself: no other name for it, nothing outside it."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name


# torch's dtypes by name, the only names an index may give: looked up, never imported
_DTYPES = {name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}


def _check_table(table: np.ndarray, entries: int, files: int, dtypes: int, dims: int) -> None:
    """Raise ``ValueError`` unless every row of ``table`` refers to an entry, a file and a dtype of the index, rows by
    entry, every entry with a row, and each entry's rows agree on what it is."""
    name, file, dtype, ndim = table[:, _NAME], table[:, _FILE], table[:, _DTYPE], table[:, _NDIM]
    if len(table) and ((name < 0) | (name >= entries)).any():
        raise ValueError("a row of its table names no entry")
    if (np.diff(name) < 0).any() or len(np.unique(name)) != entries:
        raise ValueError("its table is not by entry, a row or more for each")
    if ((file < -1) | (file >= files) | (dtype < -1) | (dtype >= dtypes) | (ndim < 0) | (ndim > dims)).any():
        raise ValueError("a row of its table refers to a file, a dtype or dimensions it does not hold")
    if ((dtype < 0) & ((file < 0) | (ndim != 0))).any():
        raise ValueError("a value of its table has no place, or dimensions")
    starts = _starts(name)
    counts = np.diff(np.append(starts, len(table)))
    first = np.repeat(starts, counts)
    described = table[:, [_DTYPE, _NDIM, *range(_FIXED, _FIXED + dims)]]
    if (described != described[first]).any() or ((file < 0) & (np.repeat(counts, counts) > 1)).any():
        raise ValueError("the rows of an entry disagree on what it is")
    padding = np.arange(dims)[None, :] >= ndim[:, None]
    for column, pad in ((_FIXED, 1), (_FIXED + dims, 0), (_FIXED + 2 * dims, 1)):
        if (table[:, column : column + dims][padding] != pad).any():
            raise ValueError("its table's padding is not 1 for a size, 0 for an offset")
