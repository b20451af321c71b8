"""Adapters: one small ``Stateful``-style class per kind of sharded state, and :func:`adapt` to pick one.

Each adapter's ``state_dict()`` is a collective that returns the full state on the recipient rank and ``{}``
elsewhere; its ``load_state_dict()`` restores the object from a full state saved on any world size. They work
with stock ignite's ``Checkpoint`` and with ``torch.distributed.checkpoint`` too;
:class:`ignite_zero.Checkpoint` applies them to ``to_save`` by itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from ignite_zero.adapters.base import ShardedState, copy_structure
from ignite_zero.adapters.zero import ZeROState

__all__ = ["ShardedState", "ZeROState", "adapt", "copy_structure", "map_objects"]


def adapt(obj: Any, recipient_rank: int) -> Any:
    """The object to checkpoint in place of ``obj``: an adapter for sharded state, the wrapped module of a
    data-parallel wrapper, or ``obj`` itself.

    Raises:
        ValueError: ``obj`` is an adapter made for another recipient rank.
    """
    if isinstance(obj, ShardedState):
        if obj.recipient_rank != recipient_rank:
            raise ValueError(
                f"{obj!r} sends its state to rank {obj.recipient_rank}, but the checkpoint is consolidated on rank "
                f"{recipient_rank}; create the adapter with `recipient_rank={recipient_rank}`"
            )
        return obj
    if isinstance(obj, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        return adapt(obj.module, recipient_rank)
    if callable(getattr(obj, "consolidate_state_dict", None)):
        return ZeROState(obj, recipient_rank)
    return obj


def map_objects(objects: Any, func: Callable[[str, Any], Any], path: str = "") -> Any:
    """Apply ``func(path, leaf)`` to every object of a nested ``to_save``/``to_load`` mapping.

    ``path`` names the leaf for error messages, e.g. ``"['models'][0]"``. Mappings and lists/tuples are
    containers; anything else is a leaf (strings included).
    """
    if isinstance(objects, Mapping):
        return {key: map_objects(value, func, f"{path}[{key!r}]") for key, value in objects.items()}
    if isinstance(objects, Sequence) and not isinstance(objects, (str, bytes)):
        return [map_objects(value, func, f"{path}[{index}]") for index, value in enumerate(objects)]
    return func(path, objects)
