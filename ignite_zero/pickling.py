"""A nested state taken apart into its structure, pickled without tensor data, and its tensors.

The transport sends the structure as a small header and the tensors as raw bytes; staging copies the tensors into
kept buffers and puts them back into the same structure.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

__all__ = ["join_tensors", "split_tensors"]


class _TensorExtractor(pickle.Pickler):
    """Pickles an object's structure and collects its tensors, each distinct tensor object once."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self._index: dict[int, int] = {}

    # Asked of each object but strings, numbers and plain containers, where persistent_id is asked of every one: a
    # snapshot of many small tensors holds tens of objects a tensor.
    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        if type(obj) not in (torch.Tensor, torch.nn.Parameter) or obj.layout != torch.strided or obj.is_quantized:
            raise TypeError(f"Cannot send a {type(obj).__name__} with layout {obj.layout}: only plain strided tensors")
        if obj.device.type == "meta":
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


class _TensorInjector(pickle.Unpickler):
    """Unpickles a structure, putting the tensors back by index."""

    def __init__(self, data: bytes, tensors: list[torch.Tensor]) -> None:
        super().__init__(io.BytesIO(data))
        self._tensors = tensors

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == (__name__, _tensor_at.__name__):
            return self._tensors.__getitem__
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


def join_tensors(structure: bytes, tensors: list[torch.Tensor]) -> Any:
    """The object :func:`split_tensors` took apart, with ``tensors`` in place of its own."""
    return _TensorInjector(structure, tensors).load()
