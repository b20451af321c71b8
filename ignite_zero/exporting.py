"""Export a model's weights from a checkpoint as Hugging Face-style safetensors, tensor by tensor.

The safetensors format is an 8-byte header length, a JSON header naming each tensor's dtype, shape and byte range,
then the bytes. The header needs only dtypes and shapes, which a checkpoint gives without reading any data (a file
mapped with ``mmap``, a sharded directory's metadata); so the header is written first and each tensor is then read,
converted and written on its own: memory holds one tensor at a time, never the whole state. Writing the format here
rather than with ``safetensors.torch.save_file``, which takes every tensor in memory at once, is what bounds it, and
it spares a dependency: ``safetensors`` is needed to read the output, not to write it (the tests read it back with
``safetensors.torch.load_file``).
"""

from __future__ import annotations

import ctypes
import functools
import json
import mmap
import os
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ignite_zero import _compat, integrity, sharded, tree
from ignite_zero.integrity import IntegrityError
from ignite_zero.storage.readers import DirectoryReader, FileReader, reader_for

__all__ = ["DTYPES", "export"]

#: The dtypes ``--dtype`` converts floating-point weights to.
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class _Entry:
    """One tensor to write: its name, what it will be (dtype, shape), and how to read it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]
    release: Callable[[], None] = lambda: None  # once written

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * int(torch.Size(self.shape).numel())


def export(
    source: str | Path,
    target: str | Path,
    *,
    only: str = "model",
    dtype: torch.dtype | None = None,
    max_shard_size: int = 5 * 10**9,
    progress: Callable[[int, int], None] | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> list[Path]:
    """Write the weights of the object ``only`` of a checkpoint as safetensors in the new directory ``target``.

    ``target`` gets ``model.safetensors``, or shards of at most ``max_shard_size`` bytes
    (``model-00001-of-00003.safetensors``...) and ``model.safetensors.index.json`` mapping every tensor to its
    file, as Hugging Face's loaders read them. Tensors that share their memory (tied weights) are written once,
    under their first name; each other name is recorded in the header's ``__metadata__`` as
    ``{"ignite_zero.aliases": {name: written name}}`` and left out of the index, as Hugging Face writes tied
    weights, whose models tie them again when loading. Values that are not tensors are left out.

    Args:
        source: a checkpoint file or a sharded checkpoint directory, a path or a URL; it is verified first. From
            an object store, one tensor is read at a time, with ranged reads.
        target: a directory that must not exist: nothing is ever overwritten.
        only: the entry of the checkpoint to export; a single-object save is that object itself.
        dtype: convert floating-point tensors to this dtype.
        max_shard_size: largest shard, in bytes (one tensor larger than that is a shard of its own).
        progress: called as ``progress(bytes written, total bytes)`` after each tensor.
        storage_options: options of the file system of a ``source`` URL (for S3: ``endpoint_url``...).

    Returns:
        The files written.

    Raises:
        FileExistsError: ``target`` exists.
        KeyError: the checkpoint has no entry ``only``.

    Examples:
        .. code-block:: python

            from ignite_zero import export

            export("ckpt/checkpoint_3.pt", "hf/model", dtype=torch.bfloat16)

            from safetensors.torch import load_file  # reading needs the safetensors package

            weights = load_file("hf/model/model.safetensors")

    .. versionadded:: 0.2.0
    """
    target = Path(target)
    if target.exists():
        raise FileExistsError(f"{target} exists; export never overwrites: choose another directory")
    reader = reader_for(source, storage_options)
    if reader.identity() is None:
        raise FileNotFoundError(f"Checkpoint {source} does not exist")
    reader.verify()
    entries, aliases = _entries(reader, only, dtype)
    shards = _shards(entries, max_shard_size)
    partial = target.with_name(f".{target.name}.ignite_zero-{uuid.uuid4().hex[:12]}.tmp")
    partial.mkdir(parents=True)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )
    metadata = {"format": "pt", "ignite_zero.aliases": json.dumps(aliases, sort_keys=True)} if aliases else None
    total = sum(entry.nbytes for entry in entries)
    written = 0

    def wrote(nbytes: int) -> None:
        nonlocal written
        written += nbytes
        if progress is not None:
            progress(written, total)

    for name, shard in zip(names, shards):
        _write_file(partial / name, shard, metadata or {"format": "pt"}, wrote)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {entry.name: name for name, shard in zip(names, shards) for entry in shard},
        }
        (partial / _INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
        names.append(_INDEX)
    os.rename(partial, target)  # the directory appears whole or not at all
    return [target / name for name in names]


def _entries(reader: Any, only: str, dtype: torch.dtype | None) -> tuple[list[_Entry], dict[str, str]]:
    """What to write, in order, and the names of tensors that share another's memory."""
    if isinstance(reader, DirectoryReader):
        return _directory_entries(reader, only, dtype), {}
    assert isinstance(reader, FileReader)
    remote = reader.place.remote
    # mapped: tensors are read when their bytes are; from an object store, read one at a time when written
    loaded = reader.structure(weights_only=True) if remote else reader.load(weights_only=True)
    mapped = not remote and not integrity.is_legacy_format(reader.stored)
    if not isinstance(loaded, Mapping):
        raise ValueError(f"{reader.path} holds a {type(loaded).__name__}, not a state dict to export")
    if only in loaded:
        state = loaded[only]
    elif loaded and all(isinstance(value, torch.Tensor) for value in loaded.values()):
        state = loaded  # a single-object save: the model's state dict itself
    else:
        raise KeyError(
            f"The checkpoint has no entry {only!r} (it holds {sorted(loaded)}); pass --only with one of them"
        )
    entries: list[_Entry] = []
    aliases: dict[str, str] = {}
    written: dict[tuple[Any, ...], str] = {}  # a tensor's memory, as (storage, offset, shape, stride): its name
    for path, value in tree.leaves(state):
        if not isinstance(value, torch.Tensor):
            continue
        name = ".".join(map(str, path))
        storage = value.untyped_storage()
        where = _compat.storage_offset_in_file(storage) if remote else storage.data_ptr()
        view = (where, value.storage_offset(), tuple(value.shape), value.stride())
        if value.numel() and view in written:
            aliases[name] = written[view]
            continue
        written[view] = name
        release: Callable[[], None] = functools.partial(_drop_pages, value) if mapped else (lambda: None)
        read = functools.partial(_read_remote, reader, value, dtype) if remote else _reading(value, dtype)
        entries.append(_Entry(name, _converted(value.dtype, dtype), tuple(value.shape), read, release))
    return entries, aliases


def _directory_entries(reader: DirectoryReader, only: str, dtype: torch.dtype | None) -> list[_Entry]:
    metadata = sharded.read_metadata(reader.place)
    entries = []
    for flat_name, storage in metadata.state_dict_metadata.items():
        path = sharded.path_of(metadata, flat_name)
        if path[:1] != (only,) or not isinstance(storage, TensorStorageMetadata):
            continue
        source_dtype = storage.properties.dtype

        def read(flat_name: str = flat_name, storage: Any = storage, source_dtype: torch.dtype = source_dtype) -> Any:
            template = {flat_name: torch.empty(storage.size, dtype=source_dtype)}
            sharded.load(template, reader.place)  # this tensor alone, from every file that holds a part of it
            return _as(template[flat_name], dtype)

        name = ".".join(map(str, path[1:]))
        entries.append(_Entry(name, _converted(source_dtype, dtype), tuple(storage.size), read))
    if not entries:
        raise KeyError(f"The checkpoint {reader.path} has no tensors under {only!r}; pass --only with another entry")
    return entries


def _converted(source: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and source.is_floating_point else source


def _reading(value: torch.Tensor, dtype: torch.dtype | None) -> Callable[[], torch.Tensor]:
    return lambda: _as(value, dtype)


def _read_remote(reader: FileReader, value: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The tensor whose structure ``value`` (on the meta device) gives, read from the object store."""
    return _as(reader.read_tensors(value), dtype)


def _as(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor if dtype is None or not tensor.is_floating_point() else tensor.to(dtype)


def _shards(entries: list[_Entry], max_shard_size: int) -> list[list[_Entry]]:
    shards: list[list[_Entry]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards


def _write_file(path: Path, entries: list[_Entry], metadata: dict[str, str], wrote: Callable[[int], None]) -> None:
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for entry in entries:
        if entry.dtype not in _SAFETENSORS_DTYPES:
            raise TypeError(f"{entry.name} is {entry.dtype}, which safetensors cannot hold; pass --dtype to convert it")
        header[entry.name] = {
            "dtype": _SAFETENSORS_DTYPES[entry.dtype],
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for chunk in _chunks(entries):
            f.write(chunk)
            wrote(len(chunk))
        f.flush()
        os.fsync(f.fileno())


def _chunks(entries: list[_Entry]) -> Iterator[memoryview]:
    for entry in entries:
        tensor = entry.read().detach().contiguous()
        if tuple(tensor.shape) != entry.shape or tensor.dtype != entry.dtype:
            raise IntegrityError(f"{entry.name} read back as {tensor.dtype} {tuple(tensor.shape)}, not as its metadata")
        yield memoryview(tensor.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
        entry.release()


def _drop_pages(tensor: torch.Tensor) -> None:
    """Let the kernel drop the pages of a tensor mapped from the checkpoint file once it is written; only for such
    tensors (on anonymous memory, dropping pages would zero them).

    They are clean file pages that it would reclaim under pressure anyway, but until then they count as resident:
    exporting a 954 MiB checkpoint grew file-backed resident memory by 955 MiB without this, and not at all with
    it. A no-op where ``madvise`` is missing.
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
