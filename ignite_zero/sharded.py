"""The sharded format: a ``torch.distributed.checkpoint`` (DCP) directory that every rank writes its part of.

DCP writes one file per rank and, last, ``.metadata``; a directory without it is incomplete. On top of DCP, this
module adds what a checkpoint must carry (DESIGN.md invariants 5 and 6): every file's CRC-32 is computed while it
is written (a stream that passes the bytes through, :class:`ChecksummingWriter`), and the coordinator seals the
directory with a manifest, ``ignite_zero.json``, listing each file with its size and checksum. :func:`verify`
checks a directory against its manifest.

Reading goes through DCP too: a template names the entries a rank needs (tensors allocated from the directory's
metadata, or ``DTensor``\\ s of the rank's own shards for FSDP) and DCP fills them, resharding across world sizes.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from zlib_ng import zlib_ng

from ignite_zero import _compat, tree
from ignite_zero.integrity import IntegrityError

__all__ = [
    "MANIFEST",
    "ChecksummingWriter",
    "crc32",
    "is_sharded_checkpoint",
    "load",
    "name_of",
    "nest",
    "path_of",
    "read_manifest",
    "in_one_process",
    "read_metadata",
    "seal",
    "share",
    "template",
    "verify",
]

#: The manifest that seals a sharded checkpoint directory: each file's size and CRC-32.
MANIFEST = "ignite_zero.json"
_METADATA = ".metadata"
_FORMAT = "ignite_zero-sharded"
_READ_CHUNK = 1 << 20
# Each slice of a write is checksummed right after the copy into the file, while it is still in the CPU's cache:
# the CRC-32 of 320 MB of tensors written to tmpfs added 1-11 ms to 105-150 ms of writing in 256 KiB slices,
# 22-40 ms over DCP's whole writes (8 MB each) on the 2-core CI machine, where reading memory bounds it (~10 GB/s).
_WRITE_SLICE = 256 << 10


def crc32(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """zlib's CRC-32 of ``data``, continuing from ``value`` (the CRC-32 of what came before): the very same values.

    zlib-ng's SIMD CRC-32 rather than the standard library's: 9-33 GB/s against 2-7 GB/s for zlib over 600 MB, and
    59 against 3 GB/s over 256 KiB in cache (2-core CI machine). At zlib's speed, checksumming each rank's 300 MB
    took 0.05-0.2 s per save (FSDP2, 0.6 GB, 2 ranks), most of the 0.08 s a sharded save took beyond ``dcp.save``'s
    0.28 s. ISA-L (``isal``) is as fast within a save; zlib-ng also builds from source wherever a C compiler does.
    Like zlib, it releases the GIL for buffers over 5 KiB (DCP writes from threads) and takes buffers over 4 GiB.
    """
    return zlib_ng.crc32(data, value)


class _ChecksummingStream(io.RawIOBase):
    """Passes writes to a file, computing their CRC-32 on the way."""

    def __init__(self, stream: Any) -> None:
        super().__init__()
        self._stream = stream
        self.crc = 0
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, view.nbytes, _WRITE_SLICE):
            piece = view[start : start + _WRITE_SLICE]
            self._stream.write(piece)  # a buffered file: writes all of it, or raises
            self.crc = crc32(piece, self.crc)
        self.size += view.nbytes
        return view.nbytes

    def tell(self) -> int:
        return self._stream.tell()

    def flush(self) -> None:
        self._stream.flush()

    def fileno(self) -> int:
        return self._stream.fileno()


class _ChecksummingFileSystem(FileSystem):
    """DCP's local file system, recording the size and CRC-32 of every file written through it."""

    def __init__(self) -> None:
        super().__init__()
        self.written: dict[str, tuple[int, int]] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            checksumming = _ChecksummingStream(stream)
            yield checksumming
        self.written[Path(path).name] = (checksumming.size, checksumming.crc)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        record = self.written.pop(Path(path).name, None)
        if record is not None:  # `.metadata` is written as `.metadata.tmp`, then renamed
            self.written[Path(new_path).name] = record


class ChecksummingWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter``, also recording each file it writes: :attr:`written` maps its name to its size
    and CRC-32.

    Args:
        path: the checkpoint directory.
        thread_count: threads writing this rank's files.
        cache_staged_state_dict: keep the host copies of an asynchronous save for the next one.
    """

    def __init__(self, path: str | os.PathLike, thread_count: int = 1, cache_staged_state_dict: bool = False) -> None:
        super().__init__(path, thread_count=thread_count, cache_staged_state_dict=cache_staged_state_dict)
        self._files = _ChecksummingFileSystem()
        _compat.set_dcp_file_system(self, self._files)
        self._copies: Any = None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A host copy of ``state_dict`` for an asynchronous save; kept and reused when caching, pinned only where
        an accelerator can pin it."""
        if not self.cache_staged_state_dict:
            return super().stage(state_dict)
        create, copy = _compat.dcp_host_copies()
        if self._copies is not None:
            try:
                return copy(state_dict, self._copies)
            except (KeyError, RuntimeError):  # another layout than last time: new copies
                self._copies = None
        self._copies = create(state_dict, pin_memory=torch.cuda.is_available())
        return copy(state_dict, self._copies)

    @property
    def written(self) -> dict[str, tuple[int, int]]:
        return self._files.written


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a complete DCP checkpoint directory (its ``.metadata`` written)."""
    return (Path(path) / _METADATA).is_file()


def seal(directory: Path, files: Mapping[str, tuple[int, int]], **facts: Any) -> None:
    """Write the manifest of a checkpoint directory, durably: every file's size and CRC-32, and ``facts``."""
    manifest = {
        "format": _FORMAT,
        "version": 1,
        "files": {name: {"size": size, "crc32": crc} for name, (size, crc) in sorted(files.items())},
        **facts,
    }
    with open(directory / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The manifest of a checkpoint directory, ``None`` if it has none (written by DCP directly)."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except ValueError as error:
        raise IntegrityError(f"{path} is corrupt: {error}") from error
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
        raise IntegrityError(f"{path} is not an ignite_zero manifest")
    return manifest


def verify(directory: str | os.PathLike) -> dict[str, Any] | None:
    """Check a checkpoint directory against its manifest; return the manifest.

    A directory without manifest (written by ``dcp.save`` directly) passes with a warning if its ``.metadata`` is
    there.

    Raises:
        IntegrityError: naming the directory and what differs: an incomplete directory, a missing, truncated or
            corrupt file.
    """
    directory = Path(directory)
    if not is_sharded_checkpoint(directory):
        raise IntegrityError(f"{directory} is not a complete checkpoint: it has no {_METADATA} (interrupted save?)")
    manifest = read_manifest(directory)
    if manifest is None:
        warnings.warn(
            f"{directory} carries no ignite_zero manifest (written by another tool); loading it without verification.",
            stacklevel=3,
        )
        return None
    for name, expected in manifest["files"].items():
        path = directory / name
        if not path.is_file():
            raise IntegrityError(f"{directory}: file {name} is missing")
        size = path.stat().st_size
        if size != expected["size"]:
            raise IntegrityError(f"{directory}: file {name} has {size} bytes, {expected['size']} expected (truncated?)")
        crc = _file_crc(path)
        if crc != expected["crc32"]:
            raise IntegrityError(
                f"{directory}: file {name} is corrupt (CRC-32 {crc:#010x}, {expected['crc32']:#010x} expected)"
            )
    unlisted = sorted(p.name for p in directory.glob("*.distcp") if p.name not in manifest["files"])
    if unlisted:
        raise IntegrityError(f"{directory}: files {unlisted} are not in its manifest")
    return manifest


def _file_crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            crc = crc32(chunk, crc)
    return crc


def read_metadata(directory: str | os.PathLike) -> Metadata:
    """DCP's metadata of a checkpoint directory: every entry's name, shape and dtype, and where it lies."""
    return FileSystemReader(directory).read_metadata()


def path_of(metadata: Metadata, name: str) -> tuple[Any, ...]:
    """The path of a flattened entry in the nested state it was saved from (``("optimizer", "state", "3", ...)``)."""
    return _compat.dcp_entry_path(metadata, name)


def name_of(path: tuple[Any, ...]) -> str:
    """The name under which DCP saves the entry at ``path`` of a nested state."""
    return ".".join(map(str, path))


def template(metadata: Metadata, keep: Callable[[tuple[Any, ...]], bool]) -> dict[str, Any]:
    """A flat template to read the entries whose path ``keep`` accepts: tensors allocated from the metadata (read
    whole, whatever the sharding they were saved with), ``None`` for other values."""
    flat: dict[str, Any] = {}
    for name, storage in metadata.state_dict_metadata.items():
        if not keep(path_of(metadata, name)):
            continue
        if isinstance(storage, TensorStorageMetadata):
            flat[name] = torch.empty(storage.size, dtype=storage.properties.dtype)
        elif isinstance(storage, BytesStorageMetadata):
            flat[name] = None
    return flat


def nest(metadata: Metadata, flat: Mapping[str, Any]) -> dict[str, Any]:
    """The nested state that flat entries read with a :func:`template` came from (dict keys as strings, list
    indices as positions)."""
    nested: dict[str, Any] = {}
    for name, value in flat.items():
        path = path_of(metadata, name)
        node: Any = nested
        for step, following in zip(path[:-1], path[1:]):
            if isinstance(node, list):
                while len(node) <= step:
                    node.append(None)
                if node[step] is None:
                    node[step] = [] if isinstance(following, int) else {}
                node = node[step]
            else:
                node = node.setdefault(step, [] if isinstance(following, int) else {})
        if isinstance(node, list):
            while len(node) <= path[-1]:
                node.append(None)
            node[path[-1]] = value
        else:
            node[path[-1]] = value
    return nested


def share(state: Any, rank: int, world_size: int, keeper: int) -> Any:
    """This rank's share of a state that every rank holds alike (a DDP model, a trainer): its tensors are dealt
    round-robin over the ranks, everything else is kept by ``keeper``.

    Every rank then writes, and an asynchronous save stages, about ``1/world_size`` of such objects instead of all
    of them. Lists holding tensors stay whole with ``keeper`` (their positions are part of the names).

    Returns:
        The share, :data:`ignite_zero.tree.OMIT` in place of what this rank does not keep.
    """
    dealt = itertools.count()

    def deal(_: tree.Path, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value if next(dealt) % world_size == rank else tree.OMIT
        return value if rank == keeper else tree.OMIT

    def whole(value: Any) -> bool:  # only mappings that hold tensors are dealt item by item
        return not (
            isinstance(value, Mapping) and any(isinstance(leaf, torch.Tensor) for _, leaf in tree.leaves(value))
        )

    return tree.map_tree(deal, state, is_leaf=whole)


def load(state: dict[str, Any], directory: str | os.PathLike) -> None:
    """Fill ``state`` (flat template entries and nested ``DTensor`` states alike) from a checkpoint directory.

    Local: every rank reads what its own template names, so ranks need no collective to load.
    """
    with in_one_process():  # each rank reads its own
        dcp.load(state, checkpoint_id=directory, no_dist=True)


@contextmanager
def in_one_process() -> Iterator[None]:
    """Without DCP's warning that it assumes one process: where that is intended (``no_dist=True``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (load|save) in a single process")
        yield
