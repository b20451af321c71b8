"""Tensors of a checkpoint whose bytes are read when an adapter takes them, and only the bytes it takes.

A reader that cannot map a file (one on an object store) gives the objects whose loading takes parts of full
tensors (FSDP's, :attr:`~ignite_zero.adapters.ShardedState.loads_deferred`) entries whose tensors are on the meta
device, each tied to a *source* that can read any view of it. Such an object takes its elements of each full
tensor through :func:`realize`: ``realize(box_view_of_full)`` reads that view's bytes, checked, just before they are
copied into its shard, so that a rank reads its shards and no rank the whole file, and it holds at most one
tensor's part at a time. Where the part lies in one run of the file and its destination is one run of memory,
:func:`copy_into` reads it straight there, with no buffer between. Any other tensor passes through :func:`realize`
unchanged: the same load code serves files mapped with ``mmap`` and entries in memory.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch

from ignite_zero import tree

__all__ = ["Source", "copy_into", "defer", "is_deferred", "realize", "realize_all"]


class Source(Protocol):
    """What reads the views of deferred tensors."""

    def read(self, view: torch.Tensor) -> torch.Tensor:
        """The elements of ``view`` (a meta tensor of this source), as a CPU tensor of its shape and dtype."""
        ...

    def read_into(self, view: torch.Tensor, target: torch.Tensor) -> bool:
        """Read the elements of ``view`` straight into ``target`` (of its shape) if the source can; else read nothing
        and return ``False``."""
        ...


# By meta storage: every view of a deferred tensor shares its storage, and the entry lives as long as they do.
_sources: weakref.WeakKeyDictionary[torch.UntypedStorage, Source] = weakref.WeakKeyDictionary()


def is_deferred(value: Any) -> bool:
    """Whether ``value`` is a tensor whose bytes are still to be read (on the meta device)."""
    return isinstance(value, torch.Tensor) and value.is_meta


def defer(value: Any, source: Source) -> Any:
    """Tie every meta tensor of ``value`` (nested) to ``source``; return ``value``."""
    for _, leaf in tree.leaves(value):
        if is_deferred(leaf):
            _sources[leaf.untyped_storage()] = source
    return value


def realize(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself, or, for a view of a deferred tensor, its elements read now.

    Raises:
        RuntimeError: ``tensor`` is on the meta device and tied to no source (its reader is closed).
    """
    if not tensor.is_meta:
        return tensor
    return _source(tensor).read(tensor)


def copy_into(target: torch.Tensor, tensor: torch.Tensor) -> None:
    """``target.copy_(realize(tensor))``, reading a deferred ``tensor`` straight into ``target`` where it can, which
    spares new memory's page faults and a copy."""
    if tensor.is_meta and target.shape == tensor.shape and _source(tensor).read_into(tensor, target):
        return
    target.copy_(realize(tensor))


def _source(tensor: torch.Tensor) -> Source:
    source = _sources.get(tensor.untyped_storage())
    if source is None:
        raise RuntimeError(
            "A tensor of a checkpoint entry was to be read after its checkpoint was closed: load entries within "
            "Checkpoint.load_objects"
        )
    return source


def realize_all(value: Any) -> Any:
    """``value`` (nested) with every deferred tensor read: for the small values loaded whole (buffers, extra
    state)."""
    return tree.map_tree(lambda _, leaf: realize(leaf) if isinstance(leaf, torch.Tensor) else leaf, value)
