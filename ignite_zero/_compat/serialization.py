"""torch's serialization: how ``torch.save`` reduces a plain tensor, what it records of a storage, and where
``torch.load`` found its bytes.

:mod:`ignite_zero.storage.formats.torch_zip` writes the archive ``torch.save`` writes, and
:mod:`ignite_zero.storage.formats.file` reads checkpoint files in parts; both need details that torch keeps in
private attributes and functions (a tensor's rebuild function, a storage's legacy class and size, the records'
alignment, where a record lies in its file), or that it sets only through a global option (the records' CRC-32).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "reduce_plain_tensor",
    "saved_storage",
    "serialization_crc32",
    "storage_alignment",
    "storage_archive_version",
    "storage_offset_in_file",
]


def storage_offset_in_file(storage: torch.UntypedStorage) -> int:
    """Where the bytes of a storage lie in the checkpoint file it was loaded from with ``map_location="meta"``.

    ``torch.load`` records it on each meta storage as ``_checkpoint_offset`` (torch 2.11 to 2.14), the offset of the
    record's data in the zip archive; there is no public accessor.
    """
    offset = getattr(storage, "_checkpoint_offset", None)
    if offset is None:
        raise RuntimeError(
            f"torch {torch.__version__} does not record where a storage lies in its file: ignite_zero cannot read "
            "checkpoint files in parts from an object store with this torch; use the versions it was tested with"
        )
    return int(offset)


@contextmanager
def serialization_crc32() -> Iterator[None]:
    """Make ``torch.save`` compute the CRC-32 of every record while it writes, whatever the user chose."""
    if torch.serialization.get_crc32_options():
        yield
        return
    torch.serialization.set_crc32_options(True)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(False)


@dataclass(frozen=True)
class SavedStorage:
    """What ``torch.save`` records of a storage that the pickled object refers to.

    Attributes:
        storage: its bytes (an untyped storage).
        identity: the same for every reference to the same storage.
        storage_type: the legacy class the loader rebuilds it as (``torch.FloatStorage``...).
        numel: its size in elements of ``storage_type``.
        location: its device as ``torch.load``'s ``map_location`` names it (``"cpu"``, ``"cuda:0"``).
    """

    storage: torch.UntypedStorage
    identity: int
    storage_type: Any
    numel: int
    location: str


def saved_storage(obj: Any) -> SavedStorage | None:
    """What ``torch.save``'s pickler records for ``obj`` when it is a storage (``None`` otherwise): the typed
    storages that tensors reduce to carry their dtype's legacy storage class and size in private attributes
    (``_untyped_storage``, ``_pickle_storage_type``, ``_size``), and storages are told apart by ``_cdata`` (torch
    2.11 to 2.14)."""
    if isinstance(obj, torch.storage.TypedStorage):
        storage = obj._untyped_storage
        storage_type, numel = getattr(torch, obj._pickle_storage_type()), obj._size()
    elif isinstance(obj, torch.UntypedStorage):
        storage, storage_type, numel = obj, torch.UntypedStorage, obj.nbytes()
    else:
        return None
    return SavedStorage(storage, storage._cdata, storage_type, numel, location_of(storage))


# torch.serialization.location_tag asks each registered device type in turn: a few microseconds for each of the
# thousands of storages of a state, for an answer that depends on the device alone.
_LOCATIONS: dict[torch.device, str] = {}


def location_of(storage: torch.UntypedStorage) -> str:
    """``torch.serialization.location_tag(storage)``: the device as ``torch.load``'s ``map_location`` names it."""
    device = storage.device
    location = _LOCATIONS.get(device)
    if location is None:
        location = _LOCATIONS[device] = torch.serialization.location_tag(storage)
    return location


def storage_alignment() -> int:
    """The alignment of the records' data in an archive ``torch.save`` writes (64 unless configured otherwise)."""
    return int(torch.serialization._get_storage_alignment())


def storage_archive_version() -> bytes:
    """The content of the ``version`` record that ``torch.save`` writes (``b"3\\n"`` with torch 2.11 to 2.14)."""
    return b"3\n"


# The legacy storage class (``torch.FloatStorage``...) that ``torch.save`` records for each dtype it wraps in a
# ``TypedStorage``; ``None`` for the dtypes it saves with their untyped storage (``_rebuild_tensor_v3``).
_LEGACY_STORAGE_TYPES: dict[torch.dtype, Any] = {}


def reduce_plain_tensor(tensor: torch.Tensor) -> tuple[Any, tuple[Any, ...]] | None:
    """What ``Tensor.__reduce_ex__`` gives for a plain CPU tensor, its storage given as the :class:`SavedStorage`
    that ``torch.save``'s pickler records of it: the same pickle, without the ``TypedStorage`` torch makes and the
    checks it runs for every tensor, which a state of thousands of tensors pays for in its pickle. ``None`` for any
    other tensor (a subclass, one with attributes, requiring grad, on another device, not strided, quantized
    or nested, of a dtype saved untyped): pickled as torch pickles it.

    torch 2.11 to 2.14 rebuild such a tensor with ``torch._utils._rebuild_tensor_v2(storage, offset, size, stride,
    requires_grad, backward_hooks[, metadata])``, the metadata its conjugate and negative bits.
    """
    if type(tensor) is not torch.Tensor or tensor.__dict__ or tensor.requires_grad or tensor.device.type != "cpu":
        return None
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested:
        return None
    dtype = tensor.dtype
    if dtype not in _LEGACY_STORAGE_TYPES:
        _LEGACY_STORAGE_TYPES[dtype] = (
            None
            if dtype in torch.storage._new_dtypes()
            else getattr(torch, torch.storage.TypedStorage(dtype=dtype, _internal=True)._pickle_storage_type())
        )
    storage_type = _LEGACY_STORAGE_TYPES[dtype]
    if storage_type is None:
        return None
    storage = tensor.untyped_storage()
    saved = SavedStorage(
        storage,
        storage._cdata,
        storage_type,
        storage.nbytes() // dtype.itemsize,
        location_of(storage),
    )
    args: tuple[Any, ...] = (
        saved,
        tensor.storage_offset(),
        tuple(tensor.size()),
        tensor.stride(),
        False,
        collections.OrderedDict(),
    )
    metadata = torch._utils.get_tensor_metadata(tensor)
    return torch._utils._rebuild_tensor_v2, (*args, metadata) if metadata else args
