"""The single-file format: torch's zip archive sealed with an integrity trailer (:mod:`~.file_trailer`), read
whole, mapped, or in checked parts (:mod:`~.file_reads`), and verified (:mod:`~.file_verification`).

:class:`FileReader` reads a consolidated save or a plain ``torch.save`` file.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist

from ignite_zero import _compat, tree
from ignite_zero.storage.formats.base import (
    ExportedTensor,
    IntegrityError,
    Reader,
    Verification,
    human_size,
    listed_leaves,
    listed_object,
    tensor_entry,
    value_entry,
    written_by,
)
from ignite_zero.storage.formats.file_reads import FileParts, ReadChecks, read_bytes
from ignite_zero.storage.formats.file_trailer import is_legacy_format, read_trailer
from ignite_zero.storage.formats.file_verification import verify_file
from ignite_zero.storage.formats.trust import refusing_code
from ignite_zero.storage.places import READ_BLOCK, SMALL_READ_BLOCK, Place, StoredFile

__all__ = ["FileReader"]


class FileReader(Reader):
    """A checkpoint file (a consolidated save, or plain ``torch.save``, zip or legacy format): its identity is its
    size and the checksum its trailer holds.

    Mapped with ``mmap`` where it can be, so that the ranks of one host share its pages. On an object store, each
    rank reads the file's structure, then only what its objects need, with ranged reads checked as they arrive
    (:class:`ReadChecks`): the tensors of whole entries, the partition of a ZeRO optimizer, and, for FSDP objects,
    the elements of each tensor their shards hold, read as they load (:mod:`ignite_zero.adapters.deferred`).

    Args:
        place: its directory.
        name: its name there.
    """

    ext = "pt"
    is_directory = False
    sharded = False

    def __init__(self, place: Place, name: str) -> None:
        self.place = place
        self.name = name
        self.path = place.location(name)
        self.stored = StoredFile(place, name)
        self._source: FileParts | None = None
        self._checks: ReadChecks | None = None

    def identity(self) -> tuple[Any, ...] | None:
        if not self.place.is_file(self.name):
            return None
        trailer = read_trailer(self.stored)  # cheap: the end of the file only; fails on a truncated file
        return self.place.size(self.name), None if trailer is None else trailer["directory_crc32"]

    @classmethod
    def at(cls, place: Place, name: str) -> FileReader:
        return cls(place, name)

    def exists(self) -> bool:
        return self.place.is_file(self.name)

    def modified(self) -> float:
        return self.place.modified(self.name)

    def verify(self, whole: bool = True) -> Verification:
        self.check_exists()
        # A load checks the pickled structure here, and each record as a rank reads it (:meth:`parts`): checking
        # them all here would read the whole file once more (on an object store: download it on every host).
        trailer = verify_file(self.stored, records=True if whole else _is_structure)
        if trailer is None:
            why = "written by another tool"
            if is_legacy_format(self.stored):
                why = "torch's legacy format, `_use_new_zipfile_serialization=False`, has no room for one"
            return Verification(False, "integrity trailer", why)
        summary = f"{human_size(self.stored.size)}, CRC-32 of every record and of the directory match"
        return Verification(True, "integrity trailer", summary, trailer)

    def load(self, weights_only: bool, progress: Callable[[int, int], None] | None = None) -> Any:
        """Everything the file holds, its tensors mapped from the file (copied for the legacy format; read whole
        where files cannot be mapped, as on an object store)."""
        self.check_exists()
        if self.place.maps_files:
            mmap = not is_legacy_format(self.stored)
            with refusing_code(str(self.path)):
                loaded = torch.load(self.path, map_location="cpu", weights_only=weights_only, mmap=mmap)
        else:
            loaded = self.read_tensors(self.structure(weights_only))
        if progress is not None:
            progress(self.stored.size, self.stored.size)
        return loaded

    def listing(self) -> dict[str, Any]:
        trailer = read_trailer(self.stored)
        state = self.structure(weights_only=not self.trusted)
        objects = []
        for name, value in state.items() if isinstance(state, Mapping) else [("(state)", state)]:
            entries = [
                tensor_entry(key, leaf.dtype, tuple(leaf.shape))
                if isinstance(leaf, torch.Tensor)
                else value_entry(key, leaf)
                for key, leaf in listed_leaves(value)
            ]
            objects.append(listed_object(str(name), type(value).__name__, entries))
        return {
            "schema": 1,
            "path": str(self.path),
            "format": "file",
            "files": 1,
            "bytes": self.stored.size,
            "written_by": written_by(trailer),
            "objects": objects,
        }

    def tensors(self, only: str) -> tuple[list[ExportedTensor], dict[str, str]]:
        ranged = not self.place.maps_files
        # mapped: tensors are read when their bytes are; by ranged reads (an object store), one at a time when written
        loaded = self.structure(not self.trusted) if ranged else self.load(not self.trusted)
        mapped = not ranged and not is_legacy_format(self.stored)
        if not isinstance(loaded, Mapping):
            raise ValueError(f"{self.path} holds a {type(loaded).__name__}, not a state dict to export")
        if only in loaded:
            state = loaded[only]
        elif loaded and all(isinstance(value, torch.Tensor) for value in loaded.values()):
            state = loaded  # a single-object save: the model's state dict itself
        else:
            raise KeyError(
                f"The checkpoint has no entry {only!r} (it holds {sorted(loaded)}); pass --only with one of them"
            )
        found: list[ExportedTensor] = []
        aliases: dict[str, str] = {}
        written: dict[tuple[Any, ...], str] = {}  # a tensor's memory, as (storage, offset, shape, stride): its name
        for path, value in tree.leaves(state):
            if not isinstance(value, torch.Tensor):
                continue
            name = ".".join(map(str, path))
            storage = value.untyped_storage()
            where = _compat.storage_offset_in_file(storage) if ranged else storage.data_ptr()
            view = (where, value.storage_offset(), tuple(value.shape), value.stride())
            if value.numel() and view in written:
                aliases[name] = written[view]
                continue
            written[view] = name
            release: Callable[[], None] = functools.partial(_drop_pages, value) if mapped else (lambda: None)
            read = functools.partial(self.read_tensors, value) if ranged else functools.partial(_itself, value)
            found.append(ExportedTensor(name, value.dtype, tuple(value.shape), read, release))
        return found, aliases

    def close(self) -> None:
        if self._source is not None:
            self._source.close()
            self._source = None

    def parts(self) -> FileParts:
        """What reads the views of this file's tensors that objects take, checked
        (:class:`~ignite_zero.storage.formats.file_reads.FileParts`): open until :meth:`close`."""
        if self._source is None:
            f = self.place.open(self.name, block_size=SMALL_READ_BLOCK)
            self._source = FileParts(f, self.read_checks(f), self.path)
        return self._source

    def structure(self, weights_only: bool) -> Any:
        """What the file holds, with tensors on the meta device: the pickle and the record headers only (a local
        file in torch's legacy format: loaded)."""
        if is_legacy_format(self.stored):
            if self.place.maps_files:
                return self.load(weights_only)
            raise ValueError(
                f"{self.path} is in torch's legacy format (`_use_new_zipfile_serialization=False`), which cannot be "
                "read in parts: copy it to a local file, or save it again in the default format"
            )
        # small blocks: the pickle is read in pieces, and every record's header by itself
        with self.place.open(self.name, block_size=SMALL_READ_BLOCK) as f, refusing_code(str(self.path)):
            structure = torch.load(f, map_location="meta", weights_only=weights_only)
        _map_tensors(functools.partial(_inside, self.path, self.stored.size), structure)
        return structure

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
                    storages[offset] = read_bytes(f, checks, offset, meta.nbytes(), offset, offset + meta.nbytes())
                copy = torch.empty(0, dtype=tensor.dtype)
                return copy.set_(storages[offset], tensor.storage_offset(), tensor.size(), tensor.stride())

            return _map_tensors(real, entries)

    def read_checks(self, f: IO[bytes]) -> ReadChecks:
        """How reads of this file are checked, from its central directory and trailer read once (``f``: the file,
        open, the first time)."""
        if self._checks is None:
            self._checks = ReadChecks(self.stored, f)
        return self._checks

    def check_exists(self) -> None:
        """Raise :class:`FileNotFoundError` unless the file is there, naming this rank."""
        if not self.place.is_file(self.name):
            raise FileNotFoundError(f"Checkpoint file {self.path} does not exist on rank {_this_rank()}")


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


def _inside(path: str | Path, size: int, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (on the meta device), if the bytes its pickle gives its storage lie inside the file of ``size``
    bytes: checked before anything is allocated for them."""
    storage = tensor.untyped_storage()
    offset = _compat.storage_offset_in_file(storage)
    if offset < 0 or offset + storage.nbytes() > size:
        raise IntegrityError(
            f"{path}: a storage of {storage.nbytes()} bytes at offset {offset} lies past the end of the file "
            f"({size} bytes): corrupt or forged"
        )
    return tensor


def _this_rank() -> int:
    """This process's rank in the default process group, 0 without one (for messages)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _is_structure(record: str) -> bool:
    """Whether a record of a checkpoint file is part of its structure (the pickle, versions) and not a storage."""
    return "/data/" not in record


def _itself(value: torch.Tensor) -> torch.Tensor:
    return value


def _drop_pages(tensor: torch.Tensor) -> None:
    """Let the kernel drop the pages of a tensor mapped from the checkpoint file once it is written; only for such
    tensors (on anonymous memory, dropping pages would zero them).

    They are clean file pages that it would reclaim under pressure anyway, but until then they count as resident:
    an export would otherwise grow by the whole checkpoint. A no-op where ``madvise`` is missing.
    """
    page = mmap.PAGESIZE
    start = tensor.untyped_storage().data_ptr()
    length = tensor.untyped_storage().nbytes()
    first = start - start % page
    try:
        _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(length + start - first), _MADV_DONTNEED)
    except (OSError, AttributeError):
        pass


_MADV_DONTNEED = 4


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)
