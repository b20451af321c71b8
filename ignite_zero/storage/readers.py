"""Reading checkpoints: one reader per format, which loading asks for the checkpoint's identity, its verification,
and the entries the objects of one rank need.

- :class:`FileReader`: a single file (a consolidated save, or plain ``torch.save``, zip or legacy format), mapped
  with ``mmap`` where it can be, so that the ranks of one host share its pages. On an object store, each rank reads
  the file's structure, then only what its objects need, with ranged reads checked as they arrive
  (:class:`~ignite_zero.integrity.ReadChecks`): the tensors of whole entries, the partition of a ZeRO optimizer,
  and, for FSDP objects, the elements of each tensor their shards hold, read as they load
  (:mod:`ignite_zero.deferred`).
- :class:`DirectoryReader`: a sharded checkpoint directory (``torch.distributed.checkpoint``), from which every
  rank reads only what it needs: FSDP ranks their own shards into templates of them, ZeRO ranks the state of the
  parameters they own, and every rank the objects it holds whole.
"""

from __future__ import annotations

import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

import torch

from ignite_zero import _compat, deferred, integrity, sharded, tree
from ignite_zero.adapters import ShardedState
from ignite_zero.adapters.zero import as_saved_optimizer_state
from ignite_zero.agreement import rank_and_world
from ignite_zero.storage.places import READ_BLOCK, SMALL_READ_BLOCK, Place, StoredFile, split

__all__ = [
    "DirectoryReader",
    "FileReader",
    "Filled",
    "Reader",
    "entries_of",
    "is_candidate",
    "reader_at",
    "reader_for",
]


@dataclass(frozen=True)
class Filled:
    """An object's template of its own shards, filled from a sharded checkpoint: loaded with ``load_sharded``."""

    state: Any


class Reader(ABC):
    """One checkpoint, as loading reads it.

    Attributes:
        path: where the checkpoint lies, as users name it: a path, or a URL.
    """

    path: Path | str

    #: the extension of the checkpoints of this format, as its saver names them
    ext: str

    @abstractmethod
    def identity(self) -> Any | None:
        """What this rank sees of the checkpoint, cheaply, to compare with other ranks; ``None`` if nothing."""

    @abstractmethod
    def verify(self) -> None:
        """Check the whole checkpoint against its integrity record; raise :class:`~ignite_zero.IntegrityError`."""

    @abstractmethod
    def modified(self) -> float:
        """When the checkpoint was completed, in seconds since the epoch."""

    @abstractmethod
    def entries(self, objects: Mapping, weights_only: bool) -> Any:
        """The entry of every object of ``objects`` (nested as ``objects``): what it loads."""

    def close(self) -> None:
        """End the reads of deferred tensors that :meth:`entries` gave (:mod:`ignite_zero.deferred`)."""
        return None

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class FileReader(Reader):
    """A checkpoint file: its identity is its size and the checksum its trailer holds.

    Args:
        place: its directory.
        name: its name there.
    """

    ext = "pt"

    def __init__(self, place: Place, name: str) -> None:
        self.place = place
        self.name = name
        self.path = place.location(name)
        self.stored = StoredFile(place, name)
        self._source: _Parts | None = None
        self._checks: integrity.ReadChecks | None = None

    def identity(self) -> tuple[Any, ...] | None:
        if not self.place.is_file(self.name):
            return None
        trailer = integrity.read_trailer(self.stored)  # cheap: the end of the file only; fails on a truncated file
        return self.place.size(self.name), None if trailer is None else trailer["directory_crc32"]

    def modified(self) -> float:
        return self.place.modified(self.name)

    def verify(self) -> None:
        self._existing()
        # On an object store every rank checks each record it reads as it reads it: checking them all here would
        # download the whole file. The pickled structure is read whole, and checked here.
        integrity.verify_file(self.stored, records=True if not self.place.remote else _is_structure)

    def load(self, weights_only: bool) -> Any:
        """Everything the file holds, its tensors mapped from the file (copied for the legacy format; read whole
        from an object store)."""
        self._existing()
        if self.place.remote:
            return self.read_tensors(self.structure(weights_only))
        mmap = not integrity.is_legacy_format(self.stored)
        return torch.load(self.path, map_location="cpu", weights_only=weights_only, mmap=mmap)

    def entries(self, objects: Mapping, weights_only: bool) -> Any:
        if not self.place.remote:
            return entries_of(objects, self.load(weights_only))
        self._existing()
        entries = entries_of(objects, self.structure(weights_only))
        # before any tensor is read: each sharded object's own part of its entry only, and FSDP's parts read later
        later = {}
        for path, obj in tree.leaves(objects):
            if isinstance(obj, ShardedState) and obj.loads_deferred:
                later[path] = tree.get(entries, path)
                _replace(entries, path, None)
            elif isinstance(obj, ShardedState) and (part := obj.part_needed()) is not None:
                _replace(entries, path, part.select(tree.get(entries, path)))
        entries = self.read_tensors(entries)
        for path, entry in later.items():
            _replace(entries, path, deferred.defer(entry, self._parts()))
        return entries

    def close(self) -> None:
        if self._source is not None:
            self._source.close()
            self._source = None

    def _parts(self) -> _Parts:
        if self._source is None:
            self._source = _Parts(self)
        return self._source

    def structure(self, weights_only: bool) -> Any:
        """What the file holds, with tensors on the meta device: the pickle and the record headers only (a local
        file in torch's legacy format: loaded)."""
        if integrity.is_legacy_format(self.stored):
            if not self.place.remote:
                return self.load(weights_only)
            raise ValueError(
                f"{self.path} is in torch's legacy format (`_use_new_zipfile_serialization=False`), which cannot be "
                "read in parts: copy it to a local file, or save it again in the default format"
            )
        # small blocks: the pickle is read in pieces, and every record's header by itself
        with self.place.open(self.name, block_size=SMALL_READ_BLOCK) as f:
            return torch.load(f, map_location="meta", weights_only=weights_only)

    def read_tensors(self, entries: Any) -> Any:
        """``entries`` with each meta tensor replaced by the tensor read from the file (storages shared as saved),
        each storage checked against its record's CRC-32."""
        storages: dict[int, torch.UntypedStorage] = {}
        with self.place.open(self.name, block_size=READ_BLOCK) as f:
            checks = self.read_checks(f)

            def real(tensor: torch.Tensor) -> torch.Tensor:
                meta = tensor.untyped_storage()
                offset = _compat.storage_offset_in_file(meta)
                if offset not in storages:
                    storages[offset] = _read_bytes(f, checks, offset, meta.nbytes(), offset, offset + meta.nbytes())
                copy = torch.empty(0, dtype=tensor.dtype)
                return copy.set_(storages[offset], tensor.storage_offset(), tensor.size(), tensor.stride())

            return _map_tensors(real, entries)

    def read_checks(self, f: IO[bytes]) -> integrity.ReadChecks:
        """How reads of this file are checked, from its central directory and trailer read once (``f``: the file,
        open, the first time)."""
        if self._checks is None:
            self._checks = integrity.ReadChecks(self.stored, f)
        return self._checks

    def _existing(self) -> None:
        if not self.place.is_file(self.name):
            raise FileNotFoundError(f"Checkpoint file {self.path} does not exist on rank {rank_and_world()[0]}")


def _is_structure(record: str) -> bool:
    """Whether a record of a checkpoint file is part of its structure (the pickle, versions) and not a storage."""
    return "/data/" not in record


class _Parts:
    """Reads the views of a file's tensors that FSDP objects take (a :class:`~ignite_zero.deferred.Source`): the
    bytes from the view's first element to its last, in the checked spans that hold them."""

    def __init__(self, reader: FileReader) -> None:
        self._f = reader.place.open(reader.name, block_size=SMALL_READ_BLOCK)
        self._checks = reader.read_checks(self._f)
        self._path = reader.path

    def read(self, view: torch.Tensor) -> torch.Tensor:
        if self._f.closed:
            raise RuntimeError(f"{self._path} was closed before this rank read all it loads from it")
        storage = view.untyped_storage()
        record = _compat.storage_offset_in_file(storage)
        first, last = _extent(view)
        size = view.element_size()
        data = _read_bytes(self._f, self._checks, record, storage.nbytes(), record + first * size, record + last * size)
        return torch.empty(0, dtype=view.dtype).set_(data, view.storage_offset() - first, view.size(), view.stride())

    def close(self) -> None:
        self._f.close()


def _extent(view: torch.Tensor) -> tuple[int, int]:
    """The elements ``[first, last)`` of its storage that ``view`` spans (its strides are not negative)."""
    first = int(view.storage_offset())
    if view.numel() == 0:
        return first, first
    return first, first + sum((length - 1) * stride for length, stride in zip(view.shape, view.stride())) + 1


def _read_bytes(
    f: IO[bytes], checks: integrity.ReadChecks, record: int, size: int, start: int, stop: int
) -> torch.UntypedStorage:
    """The bytes ``[start, stop)`` of ``f``, within the record whose data lies at ``[record, record + size)``, read
    straight into a new storage in reads of up to 8 MiB (one request each on a store) over the checked spans that
    hold them, each span checked as its last byte arrives."""
    storage = torch.UntypedStorage(stop - start)
    if stop == start:
        return storage
    out = memoryview(cast(Any, torch.empty(0, dtype=torch.uint8).set_(storage).numpy())).cast("B")
    spans = checks.spans(record, size, start, stop)  # contiguous
    position, last = spans[0][0], spans[-1][1]
    f.seek(position)
    index, crc = 0, 0
    while position < last:
        chunk = memoryview(f.read(min(READ_BLOCK, last - position)))
        if not len(chunk):
            raise integrity.IntegrityError(f"{f}: the file ends inside {spans[index][3]} (truncated)")
        low, high = max(position, start), min(position + len(chunk), stop)
        if low < high:
            out[low - start : high - start] = chunk[low - position : high - position]
        while len(chunk):  # the chunk's bytes, span by span
            _, span_stop, expected, what = spans[index]
            taken = chunk[: span_stop - position]
            crc = sharded.crc32(taken, crc)
            position += len(taken)
            chunk = chunk[len(taken) :]
            if position == span_stop:
                checks.check(crc, expected, what)
                index, crc = index + 1, 0
    return storage


def _map_tensors(func: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    """``value`` with every tensor ``t`` in it replaced by ``func(t)``, in place where containers allow: a model's
    state dict keeps its ``_metadata``."""
    if isinstance(value, torch.Tensor):
        return func(value)
    if isinstance(value, dict):
        for key, item in value.items():
            value[key] = _map_tensors(func, item)
    elif isinstance(value, list):
        value[:] = [_map_tensors(func, item) for item in value]
    elif isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_map_tensors(func, item) for item in value)
    return value


def _replace(entries: Any, path: tree.Path, value: Any) -> None:
    parent = tree.get(entries, path[:-1])
    parent[path[-1]] = value


class DirectoryReader(Reader):
    """A sharded checkpoint directory: its identity is the checksum of its manifest.

    Args:
        place: the directory.
    """

    ext = "dcp"

    def __init__(self, place: Place) -> None:
        self.place = place
        self.path = place.location()

    def modified(self) -> float:
        # a prefix of an object store has no time of its own: its manifest, written last, has
        return self.place.modified(sharded.MANIFEST) if self.place.remote else self.place.modified("")

    def identity(self) -> tuple[Any, ...] | None:
        if not self.place.exists():
            return None
        sharded.check_committed(self.place)
        manifest = self.place.read(sharded.MANIFEST) if self.place.is_file(sharded.MANIFEST) else None
        return ("sharded", None if manifest is None else zlib.crc32(manifest))

    def verify(self) -> None:
        sharded.verify(self.place)

    def entries(self, objects: Mapping, weights_only: bool) -> Any:
        """Read what each object needs: its own shards where it gives a template, else the saved entries it wants,
        whole (optimizer state keyed by index again)."""
        metadata = sharded.read_metadata(self.place)
        saved = {sharded.path_of(metadata, name) for name in metadata.state_dict_metadata}
        templates: dict[tuple[Any, ...], Any] = {}
        flat: dict[str, Any] = {}
        for path, obj in tree.leaves(objects):
            relative = {p[len(path) :] for p in saved if p[: len(path)] == path}
            if not relative:
                raise ValueError(  # ignite's words first, as for a file
                    f"Key '{'.'.join(map(str, path))}' from x is not found in y: the checkpoint has no such entry (it "
                    f"holds {sorted({str(p[0]) for p in saved})}); load only the objects it holds, or pass the right "
                    "directory."
                )
            template = obj.sharded_template(relative) if isinstance(obj, ShardedState) else None
            if template is not None:
                templates[path] = template
                continue
            wants: Callable[[tree.Path], bool] = obj.wants if isinstance(obj, ShardedState) else (lambda _: True)

            def keep(p: tree.Path, path: tree.Path = path, wants: Callable[[tree.Path], bool] = wants) -> bool:
                return p[: len(path)] == path and wants(p[len(path) :])

            flat.update(sharded.template(metadata, keep))
        state: dict[str, Any] = dict(flat)
        for path, template in templates.items():
            state[sharded.name_of(path)] = template
        sharded.load(state, self.place)
        nested = sharded.nest(metadata, {name: state[name] for name in flat})

        def entry(path: tuple[Any, ...], _: Any) -> Any:
            if path in templates:
                return Filled(state[sharded.name_of(path)])
            return as_saved_optimizer_state(tree.get(nested, path))

        return tree.map_tree(entry, objects)


def reader_for(where: str | Path, storage_options: Mapping[str, Any] | None = None) -> FileReader | DirectoryReader:
    """The reader of the checkpoint at ``where`` (a path or a URL): a directory is a sharded checkpoint, anything
    else a file."""
    parent, name = split(where, storage_options)
    return reader_at(parent, name, parent.is_dir(name))


def reader_at(place: Place, name: str, is_directory: bool) -> FileReader | DirectoryReader:
    """The reader of the checkpoint ``name`` in ``place``: a directory is a sharded checkpoint, anything else a
    file."""
    return DirectoryReader(place.child(name)) if is_directory else FileReader(place, name)


def is_candidate(name: str, is_directory: bool) -> bool:
    """Whether the entry ``name`` of a directory is named as a checkpoint of its kind (a file or a directory)."""
    return name.endswith(f".{(DirectoryReader if is_directory else FileReader).ext}")


def entries_of(objects: Mapping, loaded: Any) -> dict[str, Any]:
    """The entry of ``loaded`` for each object of ``objects``, as ignite pairs them: with a single object, a
    checkpoint without its key is that object's state itself."""
    if len(objects) == 1:
        key = next(iter(objects))
        if not isinstance(loaded, Mapping) or key not in loaded:  # a single-object save holds its state itself
            return {key: loaded}
    missing = [key for key in objects if key not in loaded]
    if missing:
        raise ValueError(  # ignite's words first (x: `to_load`, y: the checkpoint): code that matches them works
            f"Key '{missing[0]}' from x is not found in y: the checkpoint has no entry for {missing} (it holds "
            f"{sorted(loaded)}); load only the objects it holds, or pass the right file."
        )
    return {key: loaded[key] for key in objects}
