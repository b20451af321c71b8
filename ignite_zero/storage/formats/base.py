"""The protocol of every checkpoint format: what loading, ``find_latest``, the command line and the export ask of a
checkpoint (:class:`Reader`), and what the formats share (:class:`IntegrityError`, :func:`crc32`)."""

from __future__ import annotations

import json
import pickle
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch
from zlib_ng import zlib_ng

from ignite_zero import tree
from ignite_zero.storage.places import Place

__all__ = [
    "ExportedTensor",
    "CLOSED_EARLY",
    "IntegrityError",
    "Reader",
    "UnsafeCheckpointError",
    "Verification",
    "crc32",
    "human_size",
    "listed_leaves",
    "listed_object",
    "read_exactly",
    "tensor_entry",
    "value_entry",
    "written_by",
]


class IntegrityError(RuntimeError):
    """A checkpoint file is truncated, corrupt, or not a checkpoint at all."""


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint holds a pickle that would run code, or build objects other than data, when loaded: refused.

    Raised wherever a checkpoint is read (loading, ``find_latest``, ``inspect``, ``export``...) unless the user
    vouches for it: ``weights_only=False`` in Python, ``--trust`` on the command line.

    .. versionadded:: 0.1.0
    """


def read_exactly(f: IO[bytes], target: memoryview) -> bool:
    """Fill ``target`` from ``f``, however many reads it takes; ``False`` if the file ends first, for the caller to
    name the truncated file in its own terms."""
    filled = 0
    while filled < len(target):
        count = f.readinto(target[filled:])  # type: ignore[attr-defined]
        if not count:
            return False
        filled += count
    return True


def crc32(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """zlib's CRC-32 of ``data``, continuing from ``value`` (the CRC-32 of what came before): the very same values.

    zlib-ng's SIMD CRC-32 rather than the standard library's: several times faster, which keeps checksumming a
    small part of a save; zlib-ng also builds from source wherever a C compiler does.
    Like zlib, it releases the GIL for buffers over 5 KiB (DCP writes from threads) and takes buffers over 4 GiB.
    """
    return zlib_ng.crc32(data, value)


#: Why a read of a deferred tensor fails after its checkpoint was closed.
CLOSED_EARLY = "was closed before this rank read all it loads from it"


@dataclass(frozen=True)
class Verification:
    """What :meth:`Reader.verify` found in a complete checkpoint (a corrupt one raises :class:`IntegrityError`).

    Attributes:
        checked: whether the checkpoint carries its integrity record, and every byte matched it; False for one
            written by another tool, which loads unverified.
        record: the name of the integrity record, as messages say it.
        summary: what was checked, as ``ignite-zero verify`` prints it (``4 files, sizes and CRC-32 match the
            manifest``); where ``checked`` is False, why there is no record.
        facts: what the record says of the checkpoint's writing (versions, world size, files); empty if none.
    """

    checked: bool
    record: str
    summary: str
    facts: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ExportedTensor:
    """One tensor of a checkpoint, as an export reads it: what it is, and how to read it when it is written."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]
    release: Callable[[], None] = lambda: None  # once written: a mapped tensor's pages may go

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * int(torch.Size(self.shape).numel())


class Reader(ABC):
    """One checkpoint in one format: what loading, ``find_latest``, the command line and the export ask of it.

    Attributes:
        path: where the checkpoint lies, as users name it: a path, or a URL.
        trusted: whether its user vouches for it, so that it may run code when read (``--trust``): what
            :meth:`listing` and :meth:`tensors` read is unpickled as ``weights_only=False`` would; :meth:`load` takes
            its ``weights_only`` too. False by default (see
            :mod:`~ignite_zero.storage.formats.trust`).
    """

    #: the extension of the checkpoints of this format, as its saver names them
    ext: str
    #: whether the checkpoint is stored as a directory (or an object store's prefix) rather than as a file
    is_directory: bool
    #: whether each rank wrote its own part of it, rather than one rank the whole
    sharded: bool

    path: Path | str
    trusted: bool = False

    @classmethod
    @abstractmethod
    def at(cls, place: Place, name: str) -> Reader:
        """The reader of the checkpoint ``name`` in the directory ``place``."""

    @abstractmethod
    def exists(self) -> bool:
        """Whether there is anything under the checkpoint's name (complete or not)."""

    @abstractmethod
    def identity(self) -> Any | None:
        """What this rank sees of the checkpoint, cheaply, to compare with other ranks; ``None`` if nothing."""

    @abstractmethod
    def verify(self, whole: bool = True) -> Verification:
        """Check the checkpoint against its integrity record.

        Args:
            whole: check every byte wherever it lies. False: what a load needs checked before it reads, where its
                ranks check each part they read as they read it (a file's structure only).

        Raises:
            IntegrityError: naming the checkpoint and what differs (incomplete, truncated, corrupt).
        """

    @abstractmethod
    def modified(self) -> float:
        """When the checkpoint was completed, in seconds since the epoch."""

    @abstractmethod
    def load(self, weights_only: bool, progress: Callable[[int, int], None] | None = None) -> Any:
        """Everything the checkpoint holds, as one file of it would (what ``ignite-zero consolidate`` writes), but
        with a sharded checkpoint's dict keys as it stores them (:mod:`ignite_zero.loading.whole` restores them).

        Args:
            weights_only: as for ``torch.load``.
            progress: called with the bytes read so far and in all, as the reading goes.
        """

    @abstractmethod
    def listing(self) -> dict[str, Any]:
        """What ``ignite-zero inspect --json`` prints: the format, its files and bytes, who wrote it, and every
        object's entries (tensors by dtype and shape, other values by their ``repr``), read without loading any
        tensor."""

    @abstractmethod
    def tensors(self, only: str) -> tuple[list[ExportedTensor], dict[str, str]]:
        """The tensors of the entry ``only`` (a model's state dict), in order, each read when it is asked for; and
        the names of those that share another's memory, mapped to that one's name.

        Raises:
            KeyError: the checkpoint has no tensors under ``only``.
        """

    def close(self) -> None:
        """End the reads of deferred tensors that this reader gave (:mod:`ignite_zero.adapters.deferred`)."""
        return None

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def human_size(n: float) -> str:
    """A number of bytes as messages show it: ``62.2 KB``."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def written_by(facts: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Who wrote a checkpoint, from its integrity record, as listings show it."""
    return {key: facts.get(key) for key in ("ignite_zero", "torch", "world_size")} if facts else None


def tensor_entry(key: str, dtype: torch.dtype, shape: Sequence[int]) -> dict[str, Any]:
    """A tensor in a listing."""
    numel = 1
    for extent in shape:
        numel *= extent
    name = str(dtype).removeprefix("torch.")
    return {"key": key, "kind": "tensor", "dtype": name, "shape": list(shape), "bytes": numel * dtype.itemsize}


def value_entry(key: str, value: Any) -> dict[str, Any]:
    """A value that is no tensor in a listing: its ``repr``, and the value itself where JSON holds it exactly."""
    entry = {"key": key, "kind": "value", "repr": repr(value)}
    try:  # numbers, strings, lists of them
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return entry
    return {**entry, "value": value}


def listed_leaves(value: Any) -> list[tuple[str, Any]]:
    """Every leaf of ``value`` worth a line of a listing, with its dotted path: lists and tuples of plain values are
    shown whole."""

    def whole(node: Any) -> bool:
        return isinstance(node, (list, tuple)) and not any(isinstance(item, (Mapping, torch.Tensor)) for item in node)

    return [(".".join(map(str, path)), leaf) for path, leaf in tree.leaves(value, is_leaf=whole)]


def listed_object(name: str, type_name: str | None, entries: list[dict[str, Any]]) -> dict[str, Any]:
    """An object of a checkpoint in a listing: its entries, and how many tensors and bytes they hold."""
    tensors = [entry for entry in entries if entry["kind"] == "tensor"]
    nbytes = sum(entry["bytes"] for entry in tensors)
    return {"name": name, "type": type_name, "tensors": len(tensors), "bytes": nbytes, "entries": entries}
