"""A nested state taken apart into its structure, pickled without tensor data, and its tensors.

The transport sends the structure as a small header and the tensors as raw bytes; staging copies the tensors into
kept buffers and puts them back into a copy of the same structure (:func:`rebuilt`), which shares with the state the
objects of classes marked :func:`immutable`.
"""

from __future__ import annotations

import collections
import io
import pickle
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["immutable", "join_tensors", "rebuilt", "split_plain", "split_tensors"]

_Class = TypeVar("_Class", bound=type)

# Classes whose objects never change once made: a copy of a structure in this process shares them.
_IMMUTABLE: set[type] = set()


def immutable(cls: _Class) -> _Class:
    """Mark ``cls`` (a class decorator) as one whose objects never change once made, nor anything they refer to: a
    copy made by :func:`rebuilt` shares them with the original rather than pickling and rebuilding each, which a
    state of thousands of entries would pay for at every asynchronous save."""
    _IMMUTABLE.add(cls)
    return cls


class _TensorExtractor(pickle.Pickler):
    """Pickles an object's structure and collects its tensors, each distinct tensor object once."""

    def __init__(self, file: io.BytesIO, share_immutable: bool = False) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self._index: dict[int, int] = {}
        #: objects of immutable classes, left out of the structure (only where ``share_immutable``)
        self.shared: list[Any] | None = [] if share_immutable else None

    # Asked of each object but strings, numbers and plain containers, where persistent_id is asked of every one: a
    # snapshot of many small tensors holds tens of objects a tensor.
    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            if self.shared is None or type(obj) not in _IMMUTABLE:
                return NotImplemented
            self.shared.append(obj)  # met once: the pickler refers to it by its memo after that
            return _shared_at, (len(self.shared) - 1,)
        if type(obj) not in (torch.Tensor, torch.nn.Parameter) or obj.layout != torch.strided or obj.is_quantized:
            raise TypeError(f"Cannot send a {type(obj).__name__} with layout {obj.layout}: only plain strided tensors")
        if obj.is_meta:
            raise TypeError("Cannot send a tensor on the meta device: it has no data")
        index = self._index.get(id(obj))
        if index is None:  # `self.tensors` keeps the object alive, so its id stays unique
            index = self._index[id(obj)] = len(self.tensors)
            self.tensors.append(obj)
        return _tensor_at, (index,)


def _tensor_at(index: int) -> torch.Tensor:
    """The name by which a structure refers to its ``index``-th tensor, which :func:`join_tensors` resolves to the
    tensor; it has no meaning of its own."""
    raise RuntimeError("unpickle what split_tensors() made with join_tensors()")


def _shared_at(index: int) -> Any:
    """As :func:`_tensor_at`, for the ``index``-th object shared by a copy (see :func:`rebuilt`)."""
    raise RuntimeError("only rebuilt() unpickles what it pickles")


class _TensorInjector(pickle.Unpickler):
    """Unpickles a structure, putting the tensors back by index, and the shared objects."""

    def __init__(self, data: bytes, tensors: list[torch.Tensor], shared: list[Any] | None = None) -> None:
        super().__init__(io.BytesIO(data))
        self._tensors = tensors
        self._shared = shared

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == (__name__, _tensor_at.__name__):
            return self._tensors.__getitem__
        if (module, name) == (__name__, _shared_at.__name__) and self._shared is not None:
            return self._shared.__getitem__
        return super().find_class(module, name)


def split_tensors(obj: Any) -> tuple[bytes, list[torch.Tensor]]:
    """``obj``'s structure, pickled without its tensors, and its tensors (each distinct tensor once).

    Raises:
        TypeError: ``obj`` holds a tensor without plain strided data (sparse, quantized, meta).
    """
    buffer = io.BytesIO()
    extractor = _TensorExtractor(buffer)
    extractor.dump(obj)
    return buffer.getvalue(), extractor.tensors


# What a structure that another process rebuilds may hold besides what pickle itself handles (numbers, strings,
# bytes, plain containers): none of these runs code of its own there, nor imports more than torch.
_PLAIN = frozenset(
    {
        collections.OrderedDict,
        bytearray,
        complex,
        torch.Size,
        torch.dtype,
        torch.device,
        torch.memory_format,
    }
)


class _NotPlain(Exception):
    pass


class _PlainExtractor(_TensorExtractor):
    """A :class:`_TensorExtractor` that gives up at the first object other than plain values and ``accepted``
    tensors."""

    def __init__(self, file: io.BytesIO, accepted: Callable[[torch.Tensor], bool]) -> None:
        super().__init__(file)
        self._accepted = accepted

    def reducer_override(self, obj: Any) -> Any:
        # their classes are met as their reductions name them, and the name each tensor is pickled as
        if type(obj) in _PLAIN or (isinstance(obj, type) and obj in _PLAIN) or obj is _tensor_at:
            return NotImplemented
        if not isinstance(obj, torch.Tensor) or not self._accepted(obj):
            raise _NotPlain
        return super().reducer_override(obj)


def split_plain(obj: Any, accepted: Callable[[torch.Tensor], bool]) -> tuple[bytes, list[torch.Tensor]] | None:
    """:func:`split_tensors` of ``obj`` if it holds nothing but plain values (numbers, strings, bytes, containers,
    torch's sizes, dtypes and devices) and tensors that ``accepted``; else ``None``. Another process rebuilds such a
    structure without running or importing anything of the user's."""
    buffer = io.BytesIO()
    extractor = _PlainExtractor(buffer, accepted)
    try:
        extractor.dump(obj)
    except _NotPlain:
        return None
    return buffer.getvalue(), extractor.tensors


def join_tensors(structure: bytes, tensors: list[torch.Tensor]) -> Any:
    """The object :func:`split_tensors` took apart, with ``tensors`` in place of its own."""
    return _TensorInjector(structure, tensors).load()


def rebuilt(obj: Any, tensors_for: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> Any:
    """A copy of ``obj`` with ``tensors_for(tensors)`` in place of its tensors (as :func:`split_tensors` lists
    them): its containers and values are copied, but objects of classes marked :func:`immutable`, shared.

    Raises:
        TypeError: ``obj`` holds a tensor without plain strided data (sparse, quantized, meta).
    """
    buffer = io.BytesIO()
    extractor = _TensorExtractor(buffer, share_immutable=True)
    extractor.dump(obj)
    return _TensorInjector(buffer.getvalue(), tensors_for(extractor.tensors), extractor.shared).load()
