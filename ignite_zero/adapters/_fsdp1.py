"""FSDP1 (``FullyShardedDataParallel``): where a rank's shards are, as pieces to send and as targets to load into.

A rank's parameters live in one flat, padded shard per FSDP1 unit (``FlatParameter``). Its layout (which
elements of which original parameter the shard holds, and where) is read through :mod:`ignite_zero._compat`,
the only place that touches FSDP1 internals. Buffers and extra state are replicated on every rank; parameters
FSDP1 does not manage (ignored modules) too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FlatParameter, FullyShardedDataParallel, ShardingStrategy

from ignite_zero import _compat
from ignite_zero.adapters._fsdp_common import (
    ParamLayout,
    PendingModelLoad,
    Slot,
    add_unsharded,
    clean_name,
    quiet_state_dict_apis,
    whole_slot,
)
from ignite_zero.adapters.regions import Pieces

__all__ = [
    "check",
    "check_optimizer",
    "load_sharded_model",
    "load_sharded_optimizer",
    "model_pieces",
    "param_layouts",
    "param_names",
    "plan_model_load",
    "sharded_model_state",
    "sharded_optimizer_state",
]

_SHARDED = StateDictOptions(full_state_dict=False)


@dataclass
class _Unit:
    """One FSDP1 unit that owns parameters: its flat parameter, original parameters and tied ones."""

    prefix: str  # clean name of the wrapped module, with a trailing dot ("" for the root)
    flat: FlatParameter
    entries: list[_compat.FlatParamEntry]
    shared: list[_compat.SharedParamEntry]
    no_shard: bool

    def name(self, relative: str) -> str:
        return clean_name(self.prefix + relative)

    def slot(self, entry: _compat.FlatParamEntry, in_flat_shard: bool) -> Slot:
        """Where ``entry``'s elements sit in the flat shard (``in_flat_shard``) or in its own local tensor."""
        offset = entry.shard_offset if in_flat_shard else 0
        return Slot.flat(self.name(entry.name), entry.shape, entry.full_offset, entry.shard_numel, offset)


def _units(module: nn.Module) -> list[_Unit]:
    names = {id(m): name for name, m in module.named_modules()}
    units = []
    for unit in FullyShardedDataParallel.fsdp_modules(module):
        flat = _compat.fsdp1_flat_param(unit)
        if flat is None:
            continue
        prefix = clean_name(names[id(unit)])
        units.append(
            _Unit(
                prefix=f"{prefix}." if prefix else "",
                flat=flat,
                entries=_compat.fsdp1_param_entries(flat),
                shared=_compat.fsdp1_shared_entries(flat),
                no_shard=unit.sharding_strategy == ShardingStrategy.NO_SHARD,
            )
        )
    return units


def check(module: nn.Module) -> None:
    """Refuse, locally, what the gather cannot consolidate.

    Every sharding strategy is supported, the hybrid ones (``HYBRID_SHARD``, ``_HYBRID_SHARD_ZERO2``: shards
    replicated over groups of ranks, from a device mesh or a pair of process groups) and units that shard over a
    subgroup included: the gather takes each shard from one of its replicas.

    Raises:
        RuntimeError: this torch's FSDP1 no longer has the internals read here.
    """
    for unit in FullyShardedDataParallel.fsdp_modules(module):
        _compat.check_fsdp1_layout(unit)


def check_optimizer(module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """:func:`check`: an optimizer's state is laid out like the flat parameters of ``module``'s units."""
    check(module)


def _plain_modules(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Every module but FSDP1's wrappers, with the prefix of its entries in the unwrapped module's state dict."""
    for name, m in module.named_modules():
        if not isinstance(m, FullyShardedDataParallel):
            prefix = clean_name(name)
            yield (f"{prefix}." if prefix else ""), m


def _unmanaged_parameters(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """A module's own parameters that FSDP1 did not flatten (ignored ones): whole on every rank."""
    for name, param in module.named_parameters(recurse=False):
        if not _compat.is_fsdp_flattened(param):
            yield name, param


def _persistent_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    skipped = _compat.non_persistent_buffer_names(module)
    for name, buffer in module.named_buffers(recurse=False):
        if name not in skipped:
            yield name, buffer


def model_pieces(module: nn.Module) -> Pieces:
    """This rank's pieces of the full model state, keyed ``(name,)`` in the unwrapped module's ``state_dict()`` order:
    per module, its parameters, then its buffers and extra state."""
    pieces = Pieces()
    # Parameters are found per unit, but the order is per owning module: collect the additions by owner.
    owned: dict[int, list[Callable[[], None]]] = {}
    for unit in _units(module):
        shard = _compat.fsdp1_local_shard(unit.flat)
        for entry in unit.entries:
            slot = unit.slot(entry, True)
            owned.setdefault(id(entry.owner), []).append(functools.partial(slot.add_to, pieces, (slot.name,), shard))
        for shared in unit.shared:  # tied: sent once, the same tensor under both names on the recipient
            alias = functools.partial(pieces.add_alias, (unit.name(shared.name),), (unit.name(shared.primary),))
            owned.setdefault(id(shared.owner), []).append(alias)
    for prefix, m in _plain_modules(module):
        for add in owned.get(id(m), []):
            add()
        add_unsharded(pieces, prefix, m, [*_unmanaged_parameters(m), *_persistent_buffers(m)])
    return pieces


def plan_model_load(module: nn.Module, state_dict: Mapping[str, Any], strict: bool) -> PendingModelLoad:
    """How to copy this rank's part of a full model state into its shards, buffers and extra state; local.

    The plan checks everything before it copies anything.
    """
    plan = PendingModelLoad(type(module).__name__, state_dict, strict)
    for unit in _units(module):
        shard = _compat.fsdp1_local_shard(unit.flat)
        for entry in unit.entries:
            slot = unit.slot(entry, True)
            value = plan.expect(slot.name, slot.shape)
            if value is not None and slot.length:
                plan.copy(slot.local_part(shard), slot.full_part(value))
        for shared in unit.shared:  # loaded through its primary
            plan.expect(unit.name(shared.name), None)
    for prefix, m in _plain_modules(module):
        plan.expect_unsharded(prefix, m, [*_unmanaged_parameters(m), *_persistent_buffers(m)])
    return plan


def param_layouts(module: nn.Module) -> dict[int, ParamLayout]:
    """The layout of every parameter an optimizer of ``module`` may hold, by ``id``.

    With ``use_orig_params=False`` the optimizer holds the flat parameters, and element-wise state is a flat
    shard like theirs; with ``use_orig_params=True`` it holds the original parameters, each a view of its part
    of the flat shard (1-D, or the original shape under NO_SHARD).
    """
    layouts: dict[int, ParamLayout] = {}
    for unit in _units(module):
        originals = _compat.fsdp1_orig_params(unit.flat)
        if originals is None:
            shard = _compat.fsdp1_local_shard(unit.flat)
            slots = [unit.slot(entry, True) for entry in unit.entries]
            layouts[id(unit.flat)] = ParamLayout(unit.flat, (shard.numel(),), slots)
            continue
        for param, entry in zip(originals, unit.entries):
            # From the layout, not from `param.shape`: the view is unsharded between forward and backward.
            local_shape = entry.shape if unit.no_shard else (entry.shard_numel,)
            keeps_state = unit.no_shard or entry.shard_numel > 0
            layouts[id(param)] = ParamLayout(param, local_shape, [unit.slot(entry, False)], keeps_state)
    for prefix, m in _plain_modules(module):
        for name, param in _unmanaged_parameters(m):
            layouts.setdefault(id(param), ParamLayout(param, tuple(param.shape), [whole_slot(prefix + name, param)]))
    return layouts


def param_names(module: nn.Module) -> set[str]:
    """The names of every parameter an optimizer of ``module`` may hold state for (a flat parameter's many)."""
    return {slot.name for layout in param_layouts(module).values() for slot in layout.slots}


def sharded_model_state(module: nn.Module) -> dict[str, Any]:
    """This rank's shards as ``ShardedTensor`` objects, by the unwrapped module's names: torch's sharded state dict,
    which knows how FSDP1 flattens its parameters."""
    with quiet_state_dict_apis():
        return get_model_state_dict(module, options=_SHARDED)


def load_sharded_model(module: nn.Module, state: dict[str, Any]) -> None:
    """Load :func:`sharded_model_state`'s form, as torch's ``set_model_state_dict`` does."""
    with quiet_state_dict_apis():
        set_model_state_dict(module, state, options=_SHARDED)


def sharded_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's part of the optimizer state by parameter names, as torch's ``get_optimizer_state_dict`` gives it."""
    with quiet_state_dict_apis():
        return get_optimizer_state_dict(module, optimizer, options=_SHARDED)


def load_sharded_optimizer(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load :func:`sharded_optimizer_state`'s form, as torch's ``set_optimizer_state_dict`` does."""
    with quiet_state_dict_apis():
        set_optimizer_state_dict(module, optimizer, state, options=_SHARDED)
