"""torch.distributed.checkpoint (DCP) internals: its fsspec storage, host copies, flattening and ``.metadata``.

ignite_zero writes and reads DCP directories itself (:mod:`ignite_zero.storage.formats.dcp_files`,
:mod:`ignite_zero.storage.formats.directory`) so that DCP's own readers and ``dcp_to_torch_save`` take them, and
lets DCP stage and flatten states as DCP does; the pieces that takes are private in torch 2.11 to 2.14.
"""

from __future__ import annotations

from typing import Any

# DCP's writer and reader of fsspec URLs: torch 2.11 to 2.14 do not re-export them from torch.distributed.checkpoint.
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader as DcpFsspecReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter as DcpFsspecWriter

__all__ = [
    "DCP_VERSION",
    "DcpFsspecReader",
    "DcpFsspecWriter",
    "dcp_entry_path",
    "dcp_flatten",
    "dcp_metadata_globals",
    "dcp_storage_info",
]

#: The version ``FileSystemWriter`` records in ``.metadata`` (torch 2.11 to 2.14).
DCP_VERSION = "1.0.0"


def dcp_flatten(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, tuple[Any, ...]]]:
    """A nested state flattened as DCP's default planners flatten it: each entry by the name it is saved under (a
    container without tensors is one entry), and the path of each in ``state``."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, paths = flatten_state_dict(state)
    return dict(flat), {name: tuple(path) for name, path in paths.items()}


def dcp_entry_path(metadata: Any, name: str) -> tuple[Any, ...]:
    """The path, in the nested state it was saved from, of the flattened DCP entry ``name``
    (``("optimizer", "state", "3", "exp_avg")``), from the mapping DCP's default planner keeps in ``planner_data``."""
    planner_data = getattr(metadata, "planner_data", None) or {}
    return tuple(planner_data.get(name, (name,)))


def dcp_storage_info(relative_path: str, offset: int, length: int) -> Any:
    """Where an entry lies, as ``.metadata`` records it for DCP's readers: the private ``_StorageInfo`` of its
    file system writer (torch 2.11 to 2.14), which plain ``dcp.load`` and ``dcp_to_torch_save`` unpickle."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(relative_path, offset, length)


def dcp_metadata_globals() -> frozenset[tuple[str, str]]:
    """The globals that DCP's ``.metadata`` is made of, by module and name (torch 2.11 to 2.14): its metadata
    dataclasses, the private ``_StorageInfo`` of its file system writer, the enum of memory formats, the function
    that finds a layout by its name, ``torch.Size`` and ``pathlib``'s paths (a ``StorageMeta``'s checkpoint id).
    ``torch.<dtype>`` is admitted beside them. Nothing here runs code beyond building these values."""
    metadata = "torch.distributed.checkpoint.metadata"
    return frozenset(
        {
            (metadata, "Metadata"),
            (metadata, "MetadataIndex"),
            (metadata, "StorageMeta"),
            (metadata, "TensorStorageMetadata"),
            (metadata, "BytesStorageMetadata"),
            (metadata, "ChunkStorageMetadata"),
            (metadata, "TensorProperties"),
            (metadata, "_MEM_FORMAT_ENCODING"),
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
            ("torch.serialization", "_get_layout"),
            ("torch", "Size"),
            ("pathlib", "PosixPath"),
            ("pathlib", "PurePosixPath"),
            ("pathlib", "WindowsPath"),
            ("pathlib", "PureWindowsPath"),
            ("pathlib", "Path"),
        }
    )
