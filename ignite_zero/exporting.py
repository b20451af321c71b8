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

import dataclasses
import functools
import json
import os
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ignite_zero.storage.formats import IntegrityError, Reader, reader_for
from ignite_zero.storage.formats.base import ExportedTensor
from ignite_zero.storage.places import place_of

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


def export(
    source: str | Path,
    target: str | Path,
    *,
    only: str = "model",
    dtype: torch.dtype | None = None,
    max_shard_size: int = 5 * 10**9,
    progress: Callable[[int, int], None] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    weights_only: bool = True,
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
        weights_only: read the checkpoint's pickles as ``torch.load(..., weights_only=True)`` does (default):
            anything but data is refused. Pass False only for a checkpoint whose source you trust.

    Returns:
        The files written.

    Raises:
        FileExistsError: ``target`` exists.
        KeyError: the checkpoint has no entry ``only``.
        UnsafeCheckpointError: the checkpoint holds a pickle that would run code, unless not ``weights_only``.

    Examples:
        .. code-block:: python

            from ignite_zero import export

            export("ckpt/checkpoint_3.pt", "hf/model", dtype=torch.bfloat16)

            from safetensors.torch import load_file  # reading needs the safetensors package

            weights = load_file("hf/model/model.safetensors")

    .. versionadded:: 0.1.0
    """
    target = Path(target)
    if target.exists():
        raise FileExistsError(f"{target} exists; export never overwrites: choose another directory")
    entries, aliases = _entries(_verified_reader(source, storage_options, weights_only), only, dtype)
    return _write_directory(target, _shards(entries, max_shard_size), aliases, progress)


def _verified_reader(source: str | Path, storage_options: Mapping[str, Any] | None, weights_only: bool) -> Reader:
    """The reader of the checkpoint ``source``, verified before any tensor is exported.

    Raises:
        FileNotFoundError: ``source`` does not exist.
    """
    reader = reader_for(source, storage_options)
    reader.trusted = not weights_only
    if reader.identity() is None:
        raise FileNotFoundError(f"Checkpoint {source} does not exist")
    # mapped tensors are not checked as they are read: all of them first; tensors read by ranges are checked as read
    reader.verify(whole=place_of(source, storage_options).maps_files)
    return reader


def _write_directory(
    target: Path,
    shards: list[list[ExportedTensor]],
    aliases: dict[str, str],
    progress: Callable[[int, int], None] | None,
) -> list[Path]:
    """Write ``shards`` as safetensors files, and their index if there are several, into the new directory
    ``target``, which appears whole or not at all; return the files written."""
    partial = target.with_name(f".{target.name}.ignite_zero-{uuid.uuid4().hex[:12]}.tmp")
    partial.mkdir(parents=True)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )
    metadata = {"format": "pt", "ignite_zero.aliases": json.dumps(aliases, sort_keys=True)} if aliases else None
    total = sum(entry.nbytes for shard in shards for entry in shard)
    written = 0

    def wrote(nbytes: int) -> None:
        nonlocal written
        written += nbytes
        if progress is not None:
            progress(written, total)

    for name, shard in zip(names, shards):
        _write_file(partial / name, shard, metadata or {"format": "pt"}, wrote)
    if len(shards) > 1:
        _write_index(partial / _INDEX, names, shards, total)
        names.append(_INDEX)
    os.rename(partial, target)
    return [target / name for name in names]


def _write_index(path: Path, names: list[str], shards: list[list[ExportedTensor]], total: int) -> None:
    """The index of a sharded export: which file holds each tensor, as Hugging Face's loaders read it."""
    index = {
        "metadata": {"total_size": total},
        "weight_map": {entry.name: name for name, shard in zip(names, shards) for entry in shard},
    }
    path.write_text(json.dumps(index, indent=2, sort_keys=True))


def _entries(reader: Reader, only: str, dtype: torch.dtype | None) -> tuple[list[ExportedTensor], dict[str, str]]:
    """What to write, in order, converted to ``dtype``; and the names of tensors that share another's memory."""
    tensors, aliases = reader.tensors(only)
    entries = [
        dataclasses.replace(t, dtype=_converted(t.dtype, dtype), read=functools.partial(_read_as, t.read, dtype))
        for t in tensors
    ]
    return entries, aliases


def _converted(source: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and source.is_floating_point else source


def _read_as(read: Callable[[], torch.Tensor], dtype: torch.dtype | None) -> torch.Tensor:
    return _as(read(), dtype)


def _as(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor if dtype is None or not tensor.is_floating_point() else tensor.to(dtype)


def _shards(entries: list[ExportedTensor], max_shard_size: int) -> list[list[ExportedTensor]]:
    shards: list[list[ExportedTensor]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards


def _write_file(
    path: Path, entries: list[ExportedTensor], metadata: dict[str, str], wrote: Callable[[int], None]
) -> None:
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


def _chunks(entries: list[ExportedTensor]) -> Iterator[memoryview]:
    for entry in entries:
        tensor = entry.read().detach().contiguous()
        if tuple(tensor.shape) != entry.shape or tensor.dtype != entry.dtype:
            raise IntegrityError(f"{entry.name} read back as {tensor.dtype} {tuple(tensor.shape)}, not as its metadata")
        yield memoryview(tensor.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
        entry.release()
