"""Tensors of a checkpoint whose bytes are read when an adapter takes them, and only the bytes it takes.

A reader that cannot map a file (one on an object store) gives the objects whose loading takes parts of full
tensors (FSDP's, :attr:`~ignite_zero.adapters.ShardedState.loads_deferred`) entries whose tensors are on the meta
device, each tied to a *source* that can read any view of it. Such an object takes its elements of each full
tensor through :func:`realize`: ``realize(box_view_of_full)`` reads that view's bytes, checked, just before they are
copied into its shard, so that a rank reads its shards and no rank the whole file, and it holds at most one
tensor's part at a time (DESIGN invariant 4). Any other tensor passes through :func:`realize` unchanged: the same
load code serves files mapped with ``mmap`` and entries in memory.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch

from ignite_zero import tree

__all__ = ["Source", "defer", "realize", "realize_all"]


class Source(Protocol):
    """What reads the views of deferred tensors."""

    def read(self, view: torch.Tensor) -> torch.Tensor:
        """The elements of ``view`` (a meta tensor of this source), as a CPU tensor of its shape and dtype."""
        ...


# By meta storage: every view of a deferred tensor shares its storage, and the entry lives as long as they do.
_sources: weakref.WeakKeyDictionary[torch.UntypedStorage, Source] = weakref.WeakKeyDictionary()


def defer(value: Any, source: Source) -> Any:
    """Tie every meta tensor of ``value`` (nested) to ``source``; return ``value``."""
    for _, leaf in tree.leaves(value):
        if isinstance(leaf, torch.Tensor) and leaf.is_meta:
            _sources[leaf.untyped_storage()] = source
    return value


def realize(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself, or, for a view of a deferred tensor, its elements read now.

    Raises:
        RuntimeError: ``tensor`` is on the meta device and tied to no source (its reader is closed).
    """
    if not tensor.is_meta:
        return tensor
    source = _sources.get(tensor.untyped_storage())
    if source is None:
        raise RuntimeError(
            "A tensor of a checkpoint entry was to be read after its checkpoint was closed: load entries within "
            "Checkpoint.load_objects"
        )
    return source.read(tensor)


def realize_all(value: Any) -> Any:
    """``value`` (nested) with every deferred tensor read: for the small values loaded whole (buffers, extra
    state)."""
    return tree.map_tree(lambda _, leaf: realize(leaf) if isinstance(leaf, torch.Tensor) else leaf, value)
