"""fairscale FSDP internals: where fairscale's ``FullyShardedDataParallel`` keeps this rank's shards (for
:mod:`ignite_zero.adapters.fairscale_fsdp`).

fairscale 0.4.13 has no way to read one rank's shard parameter by parameter without collectives on every rank:
``state_dict()`` unshards every unit on every rank's GPU, ``local_state_dict()`` needs CUDA and gives flat shards
without their layout. The attributes read here are set by ``FullyShardedDataParallel.__init__``,
``_shard_parameters_`` and ``_lazy_init``, and by ``FlattenParamsWrapper``; :func:`check_fairscale_fsdp_layout`
turns a change into a clear error instead of a wrong checkpoint. fairscale is imported only for objects whose own
class comes from it, since the import is slow.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "FAIRSCALE_WRAPPER_SEGMENTS",
    "FairscaleParamEntry",
    "FairscaleShardedParam",
    "check_fairscale_fsdp_layout",
    "fairscale_fsdp_class",
    "fairscale_fsdp_params",
    "fairscale_release_full_params",
    "fairscale_shares_across_units",
    "fairscale_version",
    "is_fairscale_fsdp",
    "is_fairscale_fsdp_param",
]

# The attributes fairscale's wrappers keep the wrapped module in (FullyShardedDataParallel, FlattenParamsWrapper), so
# segments of the names under them that the unwrapped module's state_dict() lacks.
FAIRSCALE_WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_fpw_module"})

_FAIRSCALE_UNIT_ATTRIBUTES = (
    "params",
    "_num_flatten_params",
    "numel_padded_per_param",
    "rank",
    "world_size",
    "process_group",
    "mixed_precision",
    "has_full_params",
    "_free_full_params",
    "_has_shared_params",
)
_FAIRSCALE_FLAT_ATTRIBUTES = ("_param_infos", "_shared_param_infos", "_param_shapes", "_param_numels")


def fairscale_fsdp_class() -> type | None:
    """fairscale's ``FullyShardedDataParallel`` class if fairscale is importable, else ``None``."""
    try:
        from fairscale.nn import FullyShardedDataParallel  # type: ignore[import-untyped]
    except ImportError:
        return None
    return FullyShardedDataParallel


def fairscale_version() -> str:
    """The installed fairscale's version, for messages."""
    try:
        from fairscale import __version__  # type: ignore[import-untyped]
    except ImportError:
        return "(not installed)"
    return str(__version__)


def is_fairscale_fsdp(module: Any) -> bool:
    """Whether ``module`` is a fairscale ``FullyShardedDataParallel`` (subclasses included); imports fairscale only
    for objects with a class from a ``fairscale.`` module among their bases."""
    if not _from_fairscale(type(module)):
        return False
    cls = fairscale_fsdp_class()
    return cls is not None and isinstance(module, cls)


# By class, as long as the class lives: every save asks it of each of a model's modules, which share a few classes.
_fairscale_classes: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()


def _from_fairscale(cls: type) -> bool:
    """Whether a class from a ``fairscale.`` module is among the bases of ``cls``."""
    known = _fairscale_classes.get(cls)
    if known is None:
        known = _fairscale_classes[cls] = any(base.__module__.startswith("fairscale.") for base in cls.__mro__)
    return known


def is_fairscale_fsdp_param(tensor: Any) -> bool:
    """Whether fairscale's FSDP manages ``tensor``: a ``FlatParameter``, or an original parameter under
    ``flatten_parameters=False``; on one rank too, where it is not sharded."""
    return hasattr(tensor, "_is_sharded") and hasattr(tensor, "_orig_size")


def check_fairscale_fsdp_layout(unit: Any) -> None:
    """Raise ``RuntimeError`` if this fairscale's FSDP no longer has the internals read here."""
    missing = [f"FullyShardedDataParallel.{name}" for name in _FAIRSCALE_UNIT_ATTRIBUTES if not hasattr(unit, name)]
    if not missing:
        for index, param in enumerate(unit.params):
            flat = index < unit._num_flatten_params
            attributes = ("_is_sharded", "_orig_size", *(_FAIRSCALE_FLAT_ATTRIBUTES if flat else ()))
            missing += [f"parameter.{name}" for name in attributes if not hasattr(param, name)]
    if missing:
        raise RuntimeError(
            f"FullyShardedDataParallel of fairscale {fairscale_version()} has no {', '.join(sorted(set(missing)))}: "
            "ignite_zero cannot read its shards. Shard the model with torch's FullyShardedDataParallel or "
            "fully_shard instead, or please report it."
        )


def fairscale_shares_across_units(unit: Any) -> bool:
    """Whether ``unit`` holds parameters of another unit (``append_shared_param``, experimental in fairscale)."""
    return bool(unit._has_shared_params)


@dataclass(frozen=True)
class FairscaleParamEntry:
    """One original parameter inside a parameter of a fairscale FSDP unit.

    It is ``owner``'s parameter ``name``, of full ``shape``; its elements start at ``offset`` in the unsharded,
    flattened parameter of the unit.
    """

    name: str
    owner: nn.Module
    shape: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class FairscaleSharedEntry:
    """A parameter tied to another one of the same flat parameter: ``owner.name`` is ``primary_owner.primary``."""

    name: str
    owner: nn.Module
    primary: str
    primary_owner: nn.Module


@dataclass(frozen=True)
class FairscaleShardedParam:
    """A parameter of a fairscale FSDP unit (what its optimizer holds) as this rank holds it.

    ``shard`` is this rank's data in full precision: a padded, 1-D slice when sharded, else the whole parameter
    (a flat parameter, or an original one under ``flatten_parameters=False``). Its first ``length`` elements are
    elements ``[start, start + length)`` of the unsharded, flattened parameter; the rest is padding.
    """

    param: nn.Parameter
    shard: torch.Tensor
    start: int
    length: int
    entries: list[FairscaleParamEntry]
    shared: list[FairscaleSharedEntry]


def fairscale_fsdp_params(unit: Any) -> list[FairscaleShardedParam]:
    """The parameters ``unit`` manages itself (not those of units inside it), in the order of ``unit.params``.

    fairscale shards a parameter as ``torch.flatten(p).chunk(world_size)`` and pads every chunk to the first
    one's size (``FullyShardedDataParallel._get_shard``); ``numel_padded_per_param`` cross-checks that.

    Raises:
        RuntimeError: the internals changed (see :func:`check_fairscale_fsdp_layout`), or the shard does not have
            the layout ``_get_shard`` gives it.
    """
    check_fairscale_fsdp_layout(unit)
    owners = {id(p): (m, name) for m in unit.modules() for name, p in m.named_parameters(recurse=False)}
    params = []
    for index, param in enumerate(unit.params):
        # `_fp32_shard` rather than `data`: in a forward or backward `data` may be the full or fp16 parameter.
        # Before the lazy initialisation (first forward) only `data` exists.
        shard = getattr(param, "_fp32_shard", param.data)
        numel = param._orig_size.numel()
        start, length = 0, numel
        if param._is_sharded:
            start = unit.rank * shard.numel()
            length = max(0, min(shard.numel(), numel - start))
        if shard.numel() - length != unit.numel_padded_per_param[index]:
            raise RuntimeError(
                f"A FullyShardedDataParallel of fairscale {fairscale_version()} holds {shard.numel()} elements of a "
                f"parameter of {numel} with {unit.numel_padded_per_param[index]} of padding on rank {unit.rank}: not "
                "the layout ignite_zero reads. Please report it."
            )
        if index < unit._num_flatten_params:
            offsets = [sum(param._param_numels[:i]) for i in range(len(param._param_numels))]
            entries = [
                FairscaleParamEntry(name, owner, tuple(shape), offset)
                for (_, owner, name), shape, offset in zip(param._param_infos, param._param_shapes, offsets)
            ]
            # (module name, primary's module name, module, name, primary's module, primary's name)
            shared = [
                FairscaleSharedEntry(name, owner, primary, primary_owner)
                for _, _, owner, name, primary_owner, primary in param._shared_param_infos
            ]
        else:
            owner, name = owners[id(param)]
            entries, shared = [FairscaleParamEntry(name, owner, tuple(param._orig_size), 0)], []
        params.append(FairscaleShardedParam(param, shard, start, length, entries, shared))
    return params


def fairscale_release_full_params(unit: Any) -> None:
    """Drop the full parameters ``unit`` keeps between forwards (``reshard_after_forward=False``, the root by
    default), so that the next forward gathers the shards a load wrote into; a no-op when it keeps none."""
    if unit.has_full_params:
        unit._free_full_params()
