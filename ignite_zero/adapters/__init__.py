"""Adapters: one small ``Stateful``-style class per kind of sharded state, and :func:`adapt` to pick them.

Each adapter's ``state_dict()`` is a collective that returns the full state on the recipient rank and ``{}``
elsewhere; its ``load_state_dict()`` restores the object from a full state saved on any world size. They work
with stock ignite's ``Checkpoint`` and with ``torch.distributed.checkpoint`` too;
:class:`ignite_zero.Checkpoint` applies them to ``to_save`` by itself.

Tensors of a checkpoint reach ``load_state_dict`` deferred (:mod:`ignite_zero.adapters.deferred`): each adapter
reads only its parts of them, straight into its own tensors where it can.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ignite_zero import tree
from ignite_zero.adapters.base import ShardedState
from ignite_zero.adapters.fairscale_fsdp import (
    FairscaleFSDPModelState,
    FairscaleFSDPOptimizerState,
    holds_fairscale_fsdp_parameters,
    is_fairscale_fsdp_module,
)
from ignite_zero.adapters.fsdp import (
    FSDPModelState,
    FSDPOptimizerState,
    full_optimizer_state_to_plain,
    holds_sharded_parameters,
    is_fsdp_module,
    owns_parameters,
    plain_optimizer_state_to_full,
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
    "in_loadable_form",
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
    modules = [obj for _, obj in tree.leaves(unwrapped) if isinstance(obj, nn.Module)]
    # each module's kind found once (each test walks every submodule of a model that is not of that kind)
    fairscale = [module for module in modules if is_fairscale_fsdp_module(module)]
    models = [module for module in modules if any(module is m for m in fairscale) or is_fsdp_module(module)]
    return tree.map_tree(
        lambda path, obj: _adapt(tree.describe(path), obj, models, fairscale, recipient_rank), unwrapped
    )


def _unwrap(obj: Any) -> Any:
    while isinstance(obj, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        obj = obj.module
    return obj


def _adapt(path: str, obj: Any, models: list[nn.Module], fairscale: list[nn.Module], recipient_rank: int) -> Any:
    """The adapter of ``obj``, if it needs one; ``models``: the FSDP models (torch's or fairscale's) among the objects,
    ``fairscale``: those of them that hold fairscale units."""
    if isinstance(obj, ShardedState):
        if obj.recipient_rank != recipient_rank:
            raise ValueError(
                f"{obj!r} sends its state to rank {obj.recipient_rank}, but the checkpoint is consolidated on rank "
                f"{recipient_rank}; create the adapter with `recipient_rank={recipient_rank}`"
            )
        return obj
    if any(obj is model for model in fairscale):  # first: its check() refuses a module that holds torch FSDP units too
        return FairscaleFSDPModelState(obj, recipient_rank, name=path)
    if any(obj is model for model in models):
        return FSDPModelState(obj, recipient_rank)
    if isinstance(obj, RandomState):  # every rank's generators differ
        return PerRank(obj, recipient_rank)
    if callable(getattr(obj, "consolidate_state_dict", None)):
        return ZeROState(obj, recipient_rank)
    if isinstance(obj, torch.optim.Optimizer):
        owner = next((model for model in models if owns_parameters(model, obj)), None)
        if owner is not None and any(owner is model for model in fairscale):
            return FairscaleFSDPOptimizerState(owner, obj, recipient_rank, name=path)
        if owner is not None:
            return FSDPOptimizerState(owner, obj, recipient_rank)
        if holds_fairscale_fsdp_parameters(obj):
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


def in_loadable_form(path: str, obj: Any, entry: Any, models: list[nn.Module]) -> Any:
    """``entry`` in the form that ``obj`` (as :func:`adapt` made it) loads, where it was saved in the other form of
    optimizer state: by parameter names (from an FSDP model, or by ``get_state_dict``) for optimizers that load
    index-keyed state (plain ones, ZeRO and OSS), and index-keyed (a plain optimizer's file) for the optimizers of FSDP
    models, by name. Any other entry as it is.

    Args:
        path: the entry, for messages.
        obj: the object it loads into.
        entry: the saved entry.
        models: the models being loaded with it, among which the one whose parameters the optimizer updates.

    Raises:
        ValueError: the entry names parameters, and none of ``models`` holds the optimizer's parameters.
    """
    keys = _parameter_keys(entry)
    if isinstance(obj, FSDPOptimizerState) and keys == "positions":  # a plain optimizer's file
        return plain_optimizer_state_to_full(obj.module, entry)
    optimizer = obj.obj if isinstance(obj, ZeROState) else obj
    if not (isinstance(optimizer, torch.optim.Optimizer) and keys == "names"):
        return entry
    model = next((m for m in models if owns_parameters(m, optimizer)), None)
    if model is None:
        raise ValueError(
            f"The checkpoint entry {path} names its parameters (it was saved from an FSDP model): load it together "
            "with the model whose parameters the optimizer updates, e.g. {'model': model, 'optimizer': optimizer}"
        )
    # ZeRO's exposed param_groups are the global ones: the same index-keyed state as a plain optimizer's
    return full_optimizer_state_to_plain(model, optimizer, entry)


def _parameter_keys(entry: Any) -> str | None:
    """How a saved optimizer state keys its parameters, by its first param group: ``"positions"`` (a plain
    optimizer's, all indices), ``"names"`` (an FSDP model's, or ``get_state_dict``'s); ``None`` for another entry."""
    groups = entry.get("param_groups") if isinstance(entry, Mapping) else None
    if not groups or not isinstance(groups[0], Mapping):
        return None
    params = groups[0]["params"]
    if all(isinstance(p, int) for p in params):
        return "positions"
    return "names" if any(isinstance(p, str) for p in params) else None
