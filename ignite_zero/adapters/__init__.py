"""Adapters: one small ``Stateful``-style class per kind of sharded state, and :func:`adapt` to pick them.

Each adapter's ``state_dict()`` is a collective that returns the full state on the recipient rank and ``{}``
elsewhere; its ``load_state_dict()`` restores the object from a full state saved on any world size. They work
with stock ignite's ``Checkpoint`` and with ``torch.distributed.checkpoint`` too;
:class:`ignite_zero.Checkpoint` applies them to ``to_save`` by itself.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ignite_zero import tree
from ignite_zero.adapters.base import ShardedState, copy_structure
from ignite_zero.adapters.fairscale_fsdp import (
    FairscaleFSDPModelState,
    FairscaleFSDPOptimizerState,
    holds_fairscale_fsdp_parameters,
    is_fairscale_fsdp_module,
)
from ignite_zero.adapters.fsdp import (
    FSDPModelState,
    FSDPOptimizerState,
    holds_sharded_parameters,
    is_fsdp_module,
    owns_parameters,
)
from ignite_zero.adapters.per_rank import PerRank
from ignite_zero.adapters.zero import ZeROState
from ignite_zero.rng import RandomState

__all__ = [
    "FSDPModelState",
    "FSDPOptimizerState",
    "FairscaleFSDPModelState",
    "FairscaleFSDPOptimizerState",
    "PerRank",
    "ShardedState",
    "ZeROState",
    "adapt",
    "copy_structure",
]


def adapt(objects: Any, recipient_rank: int) -> Any:
    """The objects to checkpoint in place of those of a nested ``to_save`` (or ``to_load``).

    Data-parallel wrappers give way to their module; FSDP1/FSDP2 models become :class:`FSDPModelState`; an
    optimizer whose parameters belong to one of those models becomes its :class:`FSDPOptimizerState`; fairscale
    ``FullyShardedDataParallel`` models and their optimizers become :class:`FairscaleFSDPModelState` and
    :class:`FairscaleFSDPOptimizerState` the same way; optimizers
    with ``consolidate_state_dict`` (ZeRO, OSS) become :class:`ZeROState`; a :class:`~ignite_zero.RandomState`
    becomes a :class:`PerRank`; anything else stays as it is.

    Raises:
        ValueError: an adapter was made for another recipient rank, or an optimizer updates FSDP-sharded
            parameters (torch's or fairscale's) of a model that is not among ``objects``.
    """
    unwrapped = tree.map_tree(lambda _, obj: _unwrap(obj), objects)
    models = [obj for _, obj in tree.leaves(unwrapped) if is_fsdp_module(obj) or is_fairscale_fsdp_module(obj)]
    return tree.map_tree(lambda path, obj: _adapt(tree.describe(path), obj, models, recipient_rank), unwrapped)


def _unwrap(obj: Any) -> Any:
    while isinstance(obj, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        obj = obj.module
    return obj


def _adapt(path: str, obj: Any, models: list[nn.Module], recipient_rank: int) -> Any:
    if isinstance(obj, ShardedState):
        if obj.recipient_rank != recipient_rank:
            raise ValueError(
                f"{obj!r} sends its state to rank {obj.recipient_rank}, but the checkpoint is consolidated on rank "
                f"{recipient_rank}; create the adapter with `recipient_rank={recipient_rank}`"
            )
        return obj
    if is_fairscale_fsdp_module(obj):  # first: its check() refuses a module that holds torch FSDP units too
        return FairscaleFSDPModelState(obj, recipient_rank, name=path)
    if is_fsdp_module(obj):
        return FSDPModelState(obj, recipient_rank)
    if isinstance(obj, RandomState):  # every rank's generators differ
        return PerRank(obj, recipient_rank)
    if callable(getattr(obj, "consolidate_state_dict", None)):
        return ZeROState(obj, recipient_rank)
    fairscale = isinstance(obj, torch.optim.Optimizer) and holds_fairscale_fsdp_parameters(obj)
    if isinstance(obj, torch.optim.Optimizer) and (models or holds_sharded_parameters(obj) or fairscale):
        owner = next((model for model in models if owns_parameters(model, obj)), None)
        if owner is not None and is_fairscale_fsdp_module(owner):
            return FairscaleFSDPOptimizerState(owner, obj, recipient_rank, name=path)
        if owner is not None:
            return FSDPOptimizerState(owner, obj, recipient_rank)
        if fairscale:
            raise ValueError(
                f"The optimizer {path} updates parameters of a fairscale FullyShardedDataParallel model, but none of "
                "the models beside it holds them, so only this rank's shard of its state could be saved. Put its "
                "model in `to_save` too, e.g. {'model': model, 'optimizer': optimizer}."
            )
        if holds_sharded_parameters(obj):
            raise ValueError(
                f"The optimizer {path} updates parameters sharded by FSDP, but none of the models beside it holds "
                "them, so only this rank's shard of its state could be saved. Put its FSDP model in `to_save` too, "
                "e.g. {'model': model, 'optimizer': optimizer}."
            )
    return obj
