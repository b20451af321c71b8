"""``torch.save``'s archive, written by us: the same zip records, byte for byte, written straight from tensor memory,
each record's CRC-32 computed in the same pass.

``torch.save`` pickles an object, its storages replaced by references, then writes a zip archive of stored
(uncompressed) records: ``data.pkl``, ``.format_version``, ``.storage_alignment``, ``byteorder``, one ``data/<key>``
per storage, ``version`` and ``.data/serialization_id``, each record's data aligned to 64 bytes by padding in the
local header's extra field, each followed by a data descriptor with its CRC-32 and size; then the central directory
and the zip64 end records. :func:`write_archive` writes that archive to a stream that need not seek (a file, an
upload), at any position of it (DCP puts one archive per tensor into a rank's file), and returns where each
record's data lies and its CRC-32, so that a reader can read a storage straight into place and check it as it
arrives, and the CRC-32 of the whole archive (for a file's checksum, with :func:`zlib_ng.crc32_combine`).

A small tensor saved alone (most of DCP's entries) is written from its layout's archive, kept after the first:
the same bytes with the tensor's own, their CRC-32 and the serialization id put in. :func:`write_small_tensors`
writes many of them at once, their archives made together with numpy.

Every record is the same as ``torch.save``'s but the serialization id, which torch derives from its C++ standard
library's string hashes: ours is 40 digits too, from the CRC-32 of the record names and of their data. torch reads
it only to tell files apart.

Archives of any size are written as ``torch.save`` writes them: a record of 4 GiB or more, or one that starts 4 GiB or
more into the archive, carries a zip64 extra field in its local and central headers (before torch's padding) and a
data descriptor of 64-bit sizes; the end record says ``0xFFFF`` and ``0xFFFFFFFF`` where counts, the directory's size
or its offset do not fit, the zip64 end record, always written, holds them.
"""

from __future__ import annotations

import collections
import copyreg
import functools
import io
import pickle
import struct
import sys
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, NamedTuple

import numpy
import torch
from zlib_ng import zlib_ng

from ignite_zero import _compat
from ignite_zero.storage.formats.scratch import thread_buffer

__all__ = [
    "PICKLE_PROTOCOL",
    "Archive",
    "Record",
    "SmallArchive",
    "saved_as_its_bytes",
    "small_tensor_layout",
    "tensor_bytes",
    "write_archive",
    "write_small_tensors",
]

_LOCAL = struct.Struct("<4s5H3L2H")  # local file header, 30 bytes
_DESCRIPTOR = struct.Struct("<4s3L")  # data descriptor: CRC-32, compressed and uncompressed size
_DESCRIPTOR64 = struct.Struct("<4sL2Q")  # the same with 64-bit sizes, after a record with a zip64 extra field
_ZIP64_EXTRA = 0x0001  # the header id of the zip64 extra field
_CENTRAL = struct.Struct("<4s6H3L5H2L")  # central directory entry, 46 bytes
_ZIP64_END = struct.Struct("<4sQ2H2L4Q")  # zip64 end of central directory record, 56 bytes
_ZIP64_LOCATOR = struct.Struct("<4sLQL")
_END = struct.Struct("<4s4H2LH")
# Bit 11: UTF-8 names; bit 3: sizes and CRC-32 in a data descriptor after the data, which an empty record goes without.
# Version 0, no time, as torch's.
_UTF8, _DESCRIBED = 0x0800, 0x0008
# The zip64 end record of torch's archives says "made by" 0x031e (Unix, spec 3.0) and "needs" 4.5.
_ZIP64_MADE_BY, _ZIP64_NEEDS = 0x031E, 45
# Sizes and offsets from this one on, and counts from 0xFFFF on, live in zip64 fields; the 32- and 16-bit fields
# then say 0xFFFFFFFF and 0xFFFF.
_LIMIT = 0xFFFFFFFF
_COUNT_LIMIT = 0xFFFF
#: The pickle protocol of ``torch.save``, its default.
PICKLE_PROTOCOL = 2
# Each slice of a record is checksummed right after it is written, from the CPU's cache, where the write's copy left
# it: memory is not read a second time for the checksum.
_SLICE = 256 << 10
# Records up to this size (the pickle, the small records) are gathered with the headers; larger ones are written
# straight from their memory.
_SMALL = 64 << 10


@dataclass(frozen=True)
class Record:
    """One record of an archive.

    Attributes:
        name: its name in the archive (``data/0``), without the archive's folder.
        offset: where its data starts, from the archive's start.
        size: its data's size in bytes.
        crc: its data's CRC-32.
    """

    name: str
    offset: int
    size: int
    crc: int


@dataclass
class Archive:
    """An archive written by :func:`write_archive`.

    Attributes:
        size: its size in bytes.
        crc: the CRC-32 of all of it.
        records: its records in the order written.
    """

    size: int = 0
    crc: int = 0
    records: list[Record] = field(default_factory=list)

    def record(self, name: str) -> Record:
        """The record ``name`` (``data/0``)."""
        return next(record for record in self.records if record.name == name)


def tensor_bytes(tensor: torch.Tensor | torch.UntypedStorage) -> memoryview:
    """The bytes of a CPU tensor that is contiguous, or of an untyped storage, without a copy."""
    array: Any
    if isinstance(tensor, torch.Tensor):
        try:  # numpy's own view of the tensor: the fewest calls, for the thousands of small tensors of a state
            array = tensor.detach().numpy()
            return memoryview(array).cast("B")
        except (TypeError, RuntimeError):  # a dtype numpy lacks (bfloat16...), conjugate or negative bits
            flat = tensor.detach().reshape(-1)
    else:  # a flat uint8 array: its view is one of bytes already
        array = _storage_tensor(tensor).numpy()
        return memoryview(array)
    array = flat.view(torch.uint8).numpy()
    return memoryview(array).cast("B")


def _storage_tensor(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)


# The pickle of each layout of a tensor saved alone, as torch pickled it the first time: DCP's files hold one archive
# per tensor, most of them laid out alike (a model's layers, their moments), and pickling each anew is slow, its
# Python code out of the CPU's caches after each write of megabytes.
_PICKLES: dict[tuple[Any, ...], bytes] = {}
_PICKLES_KEPT = 1024


def _pickled(obj: Any, protocol: int) -> tuple[bytes, list[tuple[str, torch.UntypedStorage]]]:
    """``torch.save``'s pickle of ``obj`` and the storages it refers to, by their keys in it."""
    layout = _lone_tensor_layout(obj)
    if layout is not None:
        layout = (protocol, *layout)
    kept = None if layout is None else _PICKLES.get(layout)  # one look: writing threads may clear it meanwhile
    if kept is not None:
        return kept, [("0", obj.untyped_storage())]
    buffer = io.BytesIO()
    pickler = _Pickler(buffer, protocol)
    pickler.dump(obj)
    pickled, storages = buffer.getvalue(), list(pickler.storages.values())
    if layout is not None and [key for key, _ in storages] == ["0"]:  # its own storage, as a hit takes it
        if len(_PICKLES) >= _PICKLES_KEPT:
            _PICKLES.clear()
        _PICKLES[layout] = pickled
    return pickled, storages


def _lone_tensor_layout(obj: Any) -> tuple[Any, ...] | None:
    """All that torch's pickle of a plain CPU tensor saved alone depends on (its storage's type and size, and the
    tensor's offset, size, strides, ``requires_grad`` and conjugate and negative bits); ``None`` for anything else,
    pickled each time: a subclass (a ``Parameter``), a tensor with attributes of its own, a sparse, quantized or
    nested one, one on another device."""
    if type(obj) is not torch.Tensor or obj.__dict__ or obj.device.type != "cpu" or obj.is_nested:
        return None
    if obj.layout != torch.strided or obj.is_quantized:
        return None
    return (
        obj.dtype,
        obj.untyped_storage().nbytes(),
        obj.storage_offset(),
        tuple(obj.size()),
        obj.stride(),
        obj.requires_grad,
        obj.is_conj(),
        obj.is_neg(),
    )


# Types of what a state holds besides its tensors, which the pickler asks about one by one (twenty objects a tensor).
_NEVER_STORAGES = frozenset(
    {str, int, float, bool, type(None), tuple, list, dict, collections.OrderedDict, bytes, types.FunctionType}
)


def _reduce_tensor(protocol: int, tensor: torch.Tensor) -> Any:
    reduced = _compat.reduce_plain_tensor(tensor)
    return tensor.__reduce_ex__(protocol) if reduced is None else reduced


class _Pickler(pickle.Pickler):
    """``torch.save``'s pickle: storages become references ``("storage", type, key, location, numel)``, keys
    numbered in the order met; plain tensors are reduced as torch reduces them, with fewer steps
    (:func:`ignite_zero._compat.reduce_plain_tensor`)."""

    def __init__(self, file: IO[bytes], protocol: int) -> None:
        super().__init__(file, protocol=protocol)
        self.storages: dict[int, tuple[str, torch.UntypedStorage]] = {}
        # no method of its own in its table: a pickler that refers to itself lives until the collector's next pass,
        # and with it every object it pickled (ten a tensor) and every storage
        self.dispatch_table = {**copyreg.dispatch_table, torch.Tensor: functools.partial(_reduce_tensor, protocol)}

    def persistent_id(self, obj: Any) -> Any:
        kind = type(obj)
        if kind in _NEVER_STORAGES:  # asked of every object pickled: most are these
            return None
        saved = obj if kind is _compat.SavedStorage else _compat.saved_storage(obj)
        if saved is None:
            return None
        key, _ = self.storages.setdefault(saved.identity, (str(len(self.storages)), saved.storage))
        return ("storage", saved.storage_type, key, saved.location, saved.numel)


class _Writer:
    """Zip records written one after another to a stream, CRC-32 as they pass."""

    def __init__(self, write: Callable[[Any], object], alignment: int | None = None) -> None:
        self._write = write
        self._central: list[bytes] = []
        self._names: list[str] = []
        self._combined_crc = 0
        self.archive = Archive()
        self.alignment = _compat.storage_alignment() if alignment is None else alignment
        # headers and small records, written together before the next large record and at the end: one write and
        # one CRC-32 for the pieces before a tensor's bytes, not one each
        self._pending = bytearray()

    def _put(self, data: bytes | memoryview) -> None:
        self._pending += data
        self.archive.size += len(data)
        if len(self._pending) >= _SLICE:  # many small records: written as they come, a slice at a time
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            self._write(self._pending)
            self.archive.crc = zlib_ng.crc32(self._pending, self.archive.crc)
            self._pending = bytearray()  # a new one: what was written may still be held by the stream

    def record(
        self, name: str, data: bytes | memoryview, source: Callable[[memoryview], Iterable[memoryview]] | None = None
    ) -> None:
        full_name = f"archive/{name}".encode()
        start = self.archive.size
        view = memoryview(data).cast("B")
        size = view.nbytes
        # zip64 fields as torch's zip writer puts them: the sizes where the data is too large (the compressed one
        # still unknown, 0, in the local header), the header's offset where it starts too far into the archive
        large, far = size >= _LIMIT, start >= _LIMIT
        zip64 = large or far
        offset = (start,) if far else ()
        local_zip64 = _zip64_extra(((size, 0) if large else ()) + offset)
        central_zip64 = _zip64_extra(((size, size) if large else ()) + offset)
        # torch pads the extra field ("FB", its length, then "Z"s) so that the data starts on the alignment
        unpadded = start + _LOCAL.size + len(full_name) + len(local_zip64) + 4
        padding = -unpadded % self.alignment
        extra = local_zip64 + b"FB" + struct.pack("<H", padding) + b"Z" * padding
        flags = _UTF8 | _DESCRIBED if size else _UTF8
        header = _LOCAL.pack(b"PK\x03\x04", 0, flags, 0, 0, 0, 0, 0, 0, len(full_name), len(extra))
        self._put(header + full_name + extra)
        crc = self._data(view, source)
        self.archive.records.append(Record(name, self.archive.size - size, size, crc))
        if size:
            descriptor = _DESCRIPTOR64 if zip64 else _DESCRIPTOR
            self._put(descriptor.pack(b"PK\x07\x08", crc, size, size))
        entry = _CENTRAL.pack(
            b"PK\x01\x02",
            0,
            0,
            flags,
            0,
            0,
            0,
            crc,
            min(size, _LIMIT),
            min(size, _LIMIT),
            len(full_name),
            len(central_zip64),
            0,
            0,
            0,
            0,
            min(start, _LIMIT),
        )
        self._central.append(entry + full_name + central_zip64)
        self._names.append(name)
        self._combined_crc = zlib_ng.crc32_combine(self._combined_crc, crc, size)

    def _data(self, view: memoryview, source: Callable[[memoryview], Iterable[memoryview]] | None) -> int:
        """Write a record's data (see :func:`write_archive` for ``source``); its CRC-32."""
        crc = 0
        if view.nbytes <= _SMALL:  # gathered with the headers, arrived bytes too: small writes cost more than the copy
            for part in (view,) if source is None else source(view):
                crc = zlib_ng.crc32(part, crc)
                self._put(part)
            return crc
        self._flush()
        for begin in range(0, view.nbytes, _SLICE):
            piece = view[begin : begin + _SLICE]
            for part in (piece,) if source is None else source(piece):
                self._write(part)
                crc = zlib_ng.crc32(part, crc)
        self.archive.crc = zlib_ng.crc32_combine(self.archive.crc, crc, view.nbytes)
        self.archive.size += view.nbytes
        return crc

    def finish(self) -> Archive:
        names_crc = zlib_ng.crc32("\n".join(self._names).encode())
        self.record(".data/serialization_id", f"{names_crc:020d}{self._combined_crc:020d}".encode())
        directory_start, directory = self.archive.size, b"".join(self._central)
        entries = len(self._central)
        zip64_end = self.archive.size + len(directory)
        # the directory in a write of its own: a file's integrity trailer sums it by itself as it passes
        self._flush()
        self._put(directory)
        self._flush()
        self._put(
            _ZIP64_END.pack(
                b"PK\x06\x06",
                _ZIP64_END.size - 12,
                _ZIP64_MADE_BY,
                _ZIP64_NEEDS,
                0,
                0,
                entries,
                entries,
                len(directory),
                directory_start,
            )
            + _ZIP64_LOCATOR.pack(b"PK\x06\x07", 0, zip64_end, 1)
            + _END.pack(
                b"PK\x05\x06",
                0,
                0,
                min(entries, _COUNT_LIMIT),
                min(entries, _COUNT_LIMIT),
                min(len(directory), _LIMIT),
                min(directory_start, _LIMIT),
                0,
            )
        )
        self._flush()
        return self.archive


def _zip64_extra(values: tuple[int, ...]) -> bytes:
    """The zip64 extra field of the values that do not fit their header's fields (empty when all fit)."""
    if not values:
        return b""
    return struct.pack(f"<2H{len(values)}Q", _ZIP64_EXTRA, 8 * len(values), *values)


# Where a central directory entry holds its record's CRC-32, and its name's, extra field's and comment's lengths.
_CENTRAL_CRC, _CENTRAL_LENGTHS = 16, struct.Struct("<3H")


class _LoneTensorArchive:
    """The archive of a small tensor saved alone, for one layout of it: its bytes are the same for every tensor of that
    layout but for the tensor's own, their CRC-32 (in its data descriptor and its central directory entry) and the
    serialization id that follows from it (with its own CRC-32, likewise twice). Made from this template, the archives
    of many tensors cost three CRC-32 passes a tensor and a few array operations for all, not a pickle and seven
    records each.

    Args:
        tensor: a tensor of the layout (see :func:`_lone_tensor_layout`), written once as :class:`_Writer` writes it.
        protocol: the pickle protocol.
        alignment: the alignment of records' data; torch's setting if ``None``.
    """

    def __init__(self, tensor: torch.Tensor, protocol: int, alignment: int | None = None) -> None:
        written = bytearray()
        archive = _write_records(written.extend, tensor, None, protocol, alignment)
        names = [record.name for record in archive.records]
        data, version, serialization = (
            archive.record(name) for name in ("data/0", "version", ".data/serialization_id")
        )
        end = data.offset + data.size
        self._head, self._tail = bytes(written[: data.offset]), bytes(written[end:])
        #: where the tensor's bytes start in the archive
        self.data_offset = data.offset
        self._records = archive.records
        self._data_index, self._serialization_index = names.index("data/0"), names.index(".data/serialization_id")
        self._names_crc = zlib_ng.crc32("\n".join(names[: self._serialization_index]).encode())
        self._before_crc = 0
        for record in archive.records[: self._data_index]:
            self._before_crc = zlib_ng.crc32_combine(self._before_crc, record.crc, record.size)
        self._version = version
        # the serialization id's second number, but for the data's share of it (see archives_of())
        self._combined_without_data = numpy.uint64(
            zlib_ng.crc32_combine(
                zlib_ng.crc32_combine(self._before_crc, 0, data.size), self._version.crc, self._version.size
            )
        )
        # in the tail: the data descriptors' CRC-32 right after their signature, then each central entry's
        descriptors = [4, serialization.offset + serialization.size + 4 - end]
        directory = serialization.offset + serialization.size + _DESCRIPTOR.size - end
        central = []
        for _ in names:
            central.append(directory + _CENTRAL_CRC)
            name, extra, comment = _CENTRAL_LENGTHS.unpack_from(self._tail, directory + 28)
            directory += _CENTRAL.size + name + extra + comment
        self._data_crcs = (descriptors[0], central[self._data_index])
        self._serialization_at = serialization.offset - end
        self._serialization_crcs = (descriptors[1], central[self._serialization_index])
        self.size = len(written)

    def archives_of(self, data: memoryview, count: int, into: numpy.ndarray | None = None) -> _LoneArchives:
        """The archives of ``count`` tensors of this layout whose bytes are ``data``, one tensor's after another, made
        together (in ``into``, ``count`` times :attr:`size` bytes, if given): over arrays, but for three CRC-32 passes
        a tensor (its bytes, its serialization id, its archive), which ``zlib-ng`` makes in C."""
        head, size = len(self._head), self.size
        data_end = size - len(self._tail)
        rows = numpy.empty((count, size), dtype=numpy.uint8) if into is None else into.reshape(count, size)
        rows[:, :head] = numpy.frombuffer(self._head, dtype=numpy.uint8)
        rows[:, head:data_end] = numpy.frombuffer(data, dtype=numpy.uint8).reshape(count, -1)
        rows[:, data_end:] = numpy.frombuffer(self._tail, dtype=numpy.uint8)
        flat = rows.reshape(-1).data
        starts = range(0, count * size, size)
        data_crcs = numpy.array([zlib_ng.crc32(flat[at + head : at + data_end]) for at in starts], dtype=numpy.uint64)
        # the serialization id's second number: crc32_combine(crc32_combine(before, data, n), version, m) is the
        # data's CRC-32 shifted, XOR what the rest adds, the same for every tensor; its first number is in the tail
        combined = _crc32_shift(data_crcs, self._version.size) ^ self._combined_without_data
        serialization = data_end + self._serialization_at
        rows[:, serialization + 20 : serialization + 40] = (combined[:, None] // _POWERS_OF_TEN) % 10 + ord("0")
        serialization_crcs = numpy.array(
            [zlib_ng.crc32(flat[at + serialization : at + serialization + 40]) for at in starts], dtype=numpy.uint64
        )
        for crcs, places in ((data_crcs, self._data_crcs), (serialization_crcs, self._serialization_crcs)):
            little_endian = crcs.astype("<u4").view(numpy.uint8).reshape(count, 4)
            for at in places:
                rows[:, data_end + at : data_end + at + 4] = little_endian
        return _LoneArchives(
            flat,
            [zlib_ng.crc32(flat[at : at + size]) for at in starts],
            data_crcs.tolist(),
            serialization_crcs.tolist(),
        )

    def archive(self, made: _LoneArchives, place: int) -> Archive:
        """The records of the archive at ``place`` in ``made``, as :func:`write_archive` returns them."""
        records = list(self._records)
        for index, crc in ((self._data_index, made.data_crcs), (self._serialization_index, made.serialization_crcs)):
            kept = records[index]
            records[index] = Record(kept.name, kept.offset, kept.size, crc[place])
        return Archive(self.size, made.crcs[place], records)


class _LoneArchives(NamedTuple):
    """The archives of small tensors saved alone and laid out alike, made by :class:`_LoneTensorArchive`.

    Attributes:
        data: their bytes, one archive after another.
        crcs: each archive's CRC-32.
        data_crcs: the CRC-32 of each tensor's bytes.
        serialization_crcs: the CRC-32 of each archive's serialization id.
    """

    data: memoryview
    crcs: list[int]
    data_crcs: list[int]
    serialization_crcs: list[int]


# The powers of ten of a 20-digit number, largest first: the digits of CRC-32s combined, as ``%020d`` writes them.
_POWERS_OF_TEN = numpy.array([10**power for power in range(19, -1, -1)], dtype=numpy.uint64)


@functools.lru_cache(maxsize=64)
def _crc32_shift_tables(length: int) -> numpy.ndarray:
    """``crc32_combine(crc, 0, length)`` of every byte of a CRC-32 at each of its four places (read-only): that
    function is linear in ``crc`` (over GF(2)), so it is the XOR of these for the four bytes of any ``crc``."""
    tables = numpy.array(
        [[zlib_ng.crc32_combine(byte << (8 * place), 0, length) for byte in range(256)] for place in range(4)],
        dtype=numpy.uint64,
    )
    tables.setflags(write=False)
    return tables


def _crc32_shift(crcs: numpy.ndarray, length: int) -> numpy.ndarray:
    """``crc32_combine(crc, 0, length)`` of each of ``crcs``: the share of ``crc32(a + b)`` that ``crc32(a)`` makes,
    for any ``b`` of ``length`` bytes (``crc32(a + b) == shift(crc32(a)) ^ crc32(b)``)."""
    tables = _crc32_shift_tables(length)
    shifted = tables[0][crcs & 0xFF]
    for place in range(1, 4):
        shifted ^= tables[place][(crcs >> numpy.uint64(8 * place)) & 0xFF]
    return shifted


# The archive of each layout of a small tensor saved alone: DCP's files hold one archive per tensor, most of them laid
# out alike (a model's layers, their moments).
_LONE_TENSOR_ARCHIVES: dict[tuple[Any, ...], _LoneTensorArchive] = {}


def write_archive(
    stream: IO[bytes] | Callable[[Any], object],
    obj: Any,
    source: Callable[[memoryview], Iterable[memoryview]] | None = None,
    pickle_protocol: int = PICKLE_PROTOCOL,
    alignment: int | None = None,
) -> Archive:
    """Write ``obj`` to ``stream`` as ``torch.save(obj, stream)`` would, storages straight from their memory.

    Args:
        stream: a writable stream (written sequentially, never sought), or a function that writes all it is given.
        obj: what to save. Storages on an accelerator are copied to the host one at a time.
        source: given each slice of a storage's memory before it is written, returns the bytes to write in its place,
            in order: for a caller whose bytes are still arriving, or lie elsewhere (a consolidated save), to wait
            for them or point to them.
        pickle_protocol: ``torch.save``'s argument of that name.
        alignment: the alignment of records' data: torch's setting by default, which a caller that writes many
            archives at once reads once and passes (reading it costs more than writing a small tensor's archive).

    Returns:
        Where each record lies in what was written, and the CRC-32 of all of it.
    """
    write = stream.write if hasattr(stream, "write") else stream
    layout = _lone_tensor_layout(obj) if source is None else None
    if layout is None or not 0 < layout[1] <= _SMALL:
        return _write_records(write, obj, source, pickle_protocol, alignment)
    template = _lone_tensor_archive(obj, layout, pickle_protocol, alignment)
    made = template.archives_of(_storage_bytes(obj, layout), 1)
    write(made.data)
    return template.archive(made, 0)


def small_tensor_layout(tensor: Any) -> tuple[Any, ...] | None:
    """The layout of ``tensor`` if :func:`write_small_tensors` can write it: a plain CPU tensor (not a subclass, no
    attributes of its own), contiguous with the strides ``torch.empty`` gives its shape, the whole of its storage, of
    at most 64 KiB, without conjugate or negative bit; else ``None``. Tensors of equal layouts have archives alike but
    for their bytes."""
    if not (saved_as_its_bytes(tensor, out_of_autograd=False) and 0 < tensor.nbytes <= _SMALL):
        return None
    # as _lone_tensor_layout() gives it, its tests passed: one template serves a tensor whichever made its layout
    return (tensor.dtype, tensor.nbytes, 0, tuple(tensor.size()), tensor.stride(), tensor.requires_grad, False, False)


def saved_as_its_bytes(tensor: torch.Tensor, out_of_autograd: bool = True) -> bool:
    """Whether ``torch.save`` writes ``tensor`` as its bytes alone: a plain CPU tensor (as :func:`small_tensor_layout`
    takes them, at any size), the whole of its storage with the strides ``torch.empty`` gives its shape, and out of
    autograd unless ``out_of_autograd`` is false; a copy of it into any other memory is written alike."""
    return (  # one test after another, the cheapest first: asked of every tensor of a checkpoint
        type(tensor) is torch.Tensor
        and tensor.is_cpu
        and not (out_of_autograd and tensor.requires_grad)
        and tensor.layout == torch.strided
        and not (tensor.__dict__ or tensor.is_quantized or tensor.is_nested or tensor.is_conj() or tensor.is_neg())
        and tensor.is_contiguous()
        and tensor.untyped_storage().nbytes() == tensor.nbytes  # so its offset is 0
        # contiguous whatever the strides of dimensions of one element or none, which torch.save keeps as they are
        and not ((1 in tensor.shape or 0 in tensor.shape) and tensor.stride() != _row_major(tensor.shape))
    )


def _row_major(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` as ``torch.empty`` makes it."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class SmallArchive(NamedTuple):
    """Where a small tensor's archive written by :func:`write_small_tensors` lies, from the archive's start.

    Attributes:
        size: the archive's size in bytes.
        crc: its CRC-32.
        data_offset: where the tensor's bytes start in it.
        data_crc: their CRC-32.
    """

    size: int
    crc: int
    data_offset: int
    data_crc: int


def write_small_tensors(
    write: Callable[[Any], object],
    tensors: Sequence[torch.Tensor],
    layouts: Sequence[tuple[Any, ...]],
    alignment: int | None = None,
    pickle_protocol: int = PICKLE_PROTOCOL,
) -> list[SmallArchive]:
    """Write the archive of each of ``tensors``, one after another in their order, as :func:`write_archive` writes
    each: the archives of those laid out alike made together, which costs a few microseconds a tensor, not tens.

    The archives are made in memory that this thread's next call makes its own in (see
    :func:`~ignite_zero.storage.formats.scratch.thread_buffer`): ``write`` copies what it keeps.

    Args:
        write: a function that writes all it is given, or copies it.
        tensors: small tensors saved alone.
        layouts: their layouts, as :func:`small_tensor_layout` gives them (none of them ``None``).
        alignment: the alignment of records' data, as :func:`write_archive` takes it.
        pickle_protocol: ``torch.save``'s argument of that name.

    Returns:
        Where each tensor's archive lies, in their order.
    """
    alike: dict[tuple[Any, ...], list[int]] = {}
    for index, layout in enumerate(layouts):
        alike.setdefault(layout, []).append(index)
    templates = {
        layout: _lone_tensor_archive(tensors[indices[0]], layout, pickle_protocol, alignment)
        for layout, indices in alike.items()
    }
    total = sum(templates[layout].size * len(indices) for layout, indices in alike.items())
    rows = numpy.frombuffer(thread_buffer("small archives", total), dtype=numpy.uint8)
    made: list[Any] = [None] * len(tensors)
    start = 0
    for layout, indices in alike.items():
        template = templates[layout]
        group = [tensors[index] for index in indices]
        first = group[0]
        stacked = _uint8(thread_buffer("small tensors stacked", first.nbytes * len(group)))
        with torch.no_grad():
            out = stacked.view(first.dtype).view(len(group), *first.shape)
            data = tensor_bytes(torch.stack(group, out=out))
        size = template.size
        archives = template.archives_of(data, len(indices), rows[start : start + size * len(indices)])
        start += size * len(indices)
        for place, index in enumerate(indices):
            archive = SmallArchive(size, archives.crcs[place], template.data_offset, archives.data_crcs[place])
            made[index] = (archives.data[place * size : (place + 1) * size], archive)
    written = []
    for data, archive in made:
        write(data)
        written.append(archive)
    return written


def _uint8(buffer: memoryview) -> torch.Tensor:
    """``buffer`` (writable, not empty) as a tensor of bytes, sharing its memory."""
    return torch.frombuffer(buffer, dtype=torch.uint8)


def _lone_tensor_archive(
    tensor: torch.Tensor, layout: tuple[Any, ...], pickle_protocol: int, alignment: int | None
) -> _LoneTensorArchive:
    """The archive of ``layout``, made from ``tensor`` the first time."""
    key = (pickle_protocol, _compat.storage_alignment() if alignment is None else alignment, *layout)
    template = _LONE_TENSOR_ARCHIVES.get(key)  # one look: writing threads may clear it meanwhile
    if template is None:
        if len(_LONE_TENSOR_ARCHIVES) >= _PICKLES_KEPT:
            _LONE_TENSOR_ARCHIVES.clear()
        template = _LONE_TENSOR_ARCHIVES[key] = _LoneTensorArchive(tensor, pickle_protocol, alignment)
    return template


def _storage_bytes(tensor: torch.Tensor, layout: tuple[Any, ...]) -> memoryview:
    """The bytes of the storage of a plain CPU ``tensor`` of ``layout`` (see :func:`_lone_tensor_layout`): straight
    from the tensor where it is the whole of its storage, which costs less than a tensor made over the storage."""
    if _whole_storage(tensor, layout):
        return tensor_bytes(tensor)
    return tensor_bytes(tensor.untyped_storage())


def _whole_storage(tensor: torch.Tensor, layout: tuple[Any, ...]) -> bool:
    """Whether ``tensor``, of ``layout``, is the whole of its storage, contiguous, and without conjugate or negative
    bit (a view of its bytes would resolve those; torch saves them as set): its bytes are then the storage's."""
    dtype, nbytes, offset, *_, conjugate, negative = layout
    if offset or conjugate or negative or tensor.numel() * dtype.itemsize != nbytes:
        return False
    return tensor.is_contiguous()


def _write_records(
    write: Callable[[Any], object],
    obj: Any,
    source: Callable[[memoryview], Iterable[memoryview]] | None,
    pickle_protocol: int,
    alignment: int | None = None,
) -> Archive:
    """Write ``obj``'s archive record by record (see :func:`write_archive`)."""
    pickled, storages = _pickled(obj, pickle_protocol)
    writer = _Writer(write, alignment)
    writer.record("data.pkl", pickled)
    writer.record(".format_version", b"1")
    writer.record(".storage_alignment", str(writer.alignment).encode())
    writer.record("byteorder", sys.byteorder.encode())
    for key, storage in storages:
        writer.record(f"data/{key}", tensor_bytes(storage.cpu()), source)
    writer.record("version", _compat.storage_archive_version())
    return writer.finish()
