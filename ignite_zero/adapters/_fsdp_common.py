"""What the FSDP1 and FSDP2 sources share: parameter names, and where a rank's elements of a parameter sit.

A *slot* says where the elements of one original parameter that this rank holds sit, both in a local tensor
laid out like the rank's parameter data (its shard) and in the full, unsharded tensor. The model, the
optimizer state (laid out like the parameters) and loading in both directions all go through slots, so the
FSDP kinds differ only in how they find them.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ignite_zero import _compat
from ignite_zero.adapters import deferred
from ignite_zero.adapters.regions import Box, Pieces
from ignite_zero.staging import detached

__all__ = [
    "PendingModelLoad",
    "ParamLayout",
    "Slot",
    "add_piece",
    "add_value",
    "add_unsharded",
    "clean_name",
    "has_extra_state",
    "quiet_state_dict_apis",
    "whole_slot",
]


def clean_name(name: str) -> str:
    """``name`` as in the unwrapped module's ``state_dict()``."""
    if not any(segment in name for segment in _compat.TORCH_WRAPPER_SEGMENTS):  # most names: no need to split
        return name
    return ".".join(part for part in name.split(".") if part not in _compat.TORCH_WRAPPER_SEGMENTS)


@contextmanager
def quiet_state_dict_apis() -> Iterator[None]:
    """torch's state-dict functions warn about FSDP1 internals they use themselves (ShardedTensor, state_dict_type)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed")
        yield


def has_extra_state(module: nn.Module) -> bool:
    """Whether ``module`` defines ``get_extra_state``: an entry of its own in the state dict, beside its tensors."""
    return type(module).get_extra_state is not nn.Module.get_extra_state


@dataclass(frozen=True)
class Slot:
    """This rank's elements of the parameter ``name``: the block ``box`` of the full tensor.

    A flat box (a range of the flattened full tensor, FSDP1's and fairscale's shards) is stored at
    ``[offset, offset + length)`` of the flattened local tensor; any other box (a DTensor's shard) is the whole
    local tensor.
    """

    name: str
    box: Box
    offset: int = 0

    @classmethod
    def flat(cls, name: str, shape: tuple[int, ...], start: int, length: int, offset: int = 0) -> Slot:
        """Elements ``[start, start + length)`` of the flattened parameter, at ``offset`` in the flat local tensor."""
        return cls(name, Box.range(shape, start, length), offset)

    @property
    def shape(self) -> tuple[int, ...]:
        """The full parameter's shape."""
        return self.box.shape

    @property
    def length(self) -> int:
        """How many of the parameter's elements this rank holds."""
        return self.box.numel

    def local_part(self, local: torch.Tensor) -> torch.Tensor:
        """The slot's elements in ``local``; a view (loading writes through it)."""
        if self.box.flat:
            return local.view(-1)[self.offset : self.offset + self.length]
        return local

    def full_part(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's elements of ``full``, shaped as :meth:`local_part` returns them."""
        return self.box.view(full)

    def add_to(self, pieces: Pieces, key: tuple[Any, ...], local: torch.Tensor, layout: Any = None) -> None:
        """Add this slot's piece of ``local`` to ``pieces`` as part of the full tensor ``key``."""
        add_piece(pieces, key, self.box, detached(self.local_part(local)), layout)

    @property
    def is_whole(self) -> bool:
        """Whether this rank holds the whole parameter, laid out as the full tensor."""
        return self.box.is_whole and self.offset == 0


def whole_slot(name: str, tensor: torch.Tensor) -> Slot:
    """The slot of a parameter that every rank holds whole (not sharded)."""
    return Slot(name, Box.whole(tensor.shape))


@dataclass
class ParamLayout:
    """An optimizer-visible parameter and the original parameters whose elements it holds on this rank.

    ``local_shape`` is the shape of the parameter's local data, which element-wise optimizer state (Adam's
    ``exp_avg``...) shares; for a DTensor it is that of ``to_local()``. ``keeps_state`` is False where the
    optimizer keeps no state for the parameter on this rank: FSDP1 gives an original parameter without local
    elements no gradient (``use_orig_params=True``), so the optimizer skips it.
    """

    param: torch.Tensor
    local_shape: tuple[int, ...]
    slots: list[Slot] = field(default_factory=list)
    keeps_state: bool = True


def add_piece(pieces: Pieces, key: tuple[Any, ...], box: Box, piece: torch.Tensor, layout: Any = None) -> None:
    """``pieces.add``, except that a full tensor without elements travels as a value: the transport needs
    pieces with elements, and such a tensor is known from its shape and dtype alone."""
    if math.prod(box.shape) == 0:
        pieces.values[key] = torch.empty(box.shape, dtype=piece.dtype)
        pieces.order.append(key)
    else:
        pieces.add(key, box, piece, layout)


def add_unsharded(pieces: Pieces, prefix: str, module: nn.Module, tensors: Iterable[tuple[str, Any]]) -> None:
    """Add a module's ``tensors`` that every rank holds whole, then its extra state if it defines any, under their
    names in the unwrapped ``state_dict()`` (``prefix`` + name)."""
    for name, value in tensors:
        add_value(pieces, (prefix + name,), value)
    if has_extra_state(module):
        add_value(pieces, (prefix + _compat.EXTRA_STATE_KEY,), module.get_extra_state())


def add_value(pieces: Pieces, key: tuple[Any, ...], value: Any) -> None:
    """``pieces.add_whole`` with the same care for tensors without elements as :func:`add_piece`."""
    if isinstance(value, torch.Tensor):
        add_piece(pieces, key, Box.whole(value.shape), detached(value))
    else:
        pieces.add_whole(key, value)


class PendingModelLoad:
    """Loading a full model state in two steps: check every entry, then change the module.

    Errors read as ``nn.Module.load_state_dict``'s, and a module is left untouched when there are any.

    Args:
        owner: the module's class name, for error messages.
        state_dict: the full state; only read.
        strict: as for ``nn.Module.load_state_dict``: missing and unexpected names are errors.
    """

    def __init__(self, owner: str, state_dict: Mapping[str, Any], strict: bool) -> None:
        self._owner = owner
        self._state = state_dict
        self._strict = strict
        self._expected: set[str] = set()
        self._missing: list[str] = []
        self._mismatched: list[str] = []
        self._actions: list[Callable[[], Any]] = []

    def expect(self, name: str, shape: tuple[int, ...] | None) -> Any:
        """The saved value of ``name``, or ``None`` when it is missing or is not a tensor of ``shape``
        (``None``: any value), which :meth:`run` then reports."""
        self._expected.add(name)
        if name not in self._state:
            self._missing.append(name)
            return None
        value = self._state[name]
        if shape is not None and (not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(shape)):
            found = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            self._mismatched.append(
                f"size mismatch for {name}: copying a param with shape {found} from checkpoint, the shape in "
                f"current model is {tuple(shape)}."
            )
            return None
        return value

    def expect_unsharded(self, prefix: str, module: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the saved values of a module's ``tensors`` that every rank holds whole, and set its extra state if it
        defines any, when the load runs; entries are named as :func:`add_unsharded` names them."""
        for name, value in tensors:
            saved = self.expect(prefix + name, tuple(value.shape))
            if saved is not None:
                self.copy(value, saved)
        if has_extra_state(module):
            saved = self.expect(prefix + _compat.EXTRA_STATE_KEY, None)
            if saved is not None:
                self.call(module.set_extra_state, saved)

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """Copy ``source`` into ``target`` when the plan runs (reading it then, if deferred)."""
        self._actions.append(lambda: deferred.copy_into(target, source))

    def call(self, func: Callable[[Any], Any], value: Any) -> None:
        """Call ``func(value)`` when the plan runs (reading the tensors of ``value`` then, if deferred)."""
        self._actions.append(lambda: func(deferred.realize_all(value)))

    def check(self) -> None:
        """Raise ``RuntimeError`` if an entry does not fit (or, when strict, is missing or unexpected)."""
        errors = []
        if self._strict:
            unexpected = [name for name in self._state if name not in self._expected]
            if self._missing:
                errors.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in self._missing) + ". ")
            if unexpected:
                errors.append("Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected) + ". ")
        errors += self._mismatched
        if errors:
            raise RuntimeError(f"Error(s) in loading state_dict for {self._owner}:\n\t" + "\n\t".join(errors))

    def run(self) -> None:
        """:meth:`check`, then change the module."""
        self.check()
        with torch.no_grad():
            for action in self._actions:
                action()
