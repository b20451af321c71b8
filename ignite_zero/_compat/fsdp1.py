"""FSDP1 internals: the ``FlatParameter`` layout of torch's ``FullyShardedDataParallel`` (for
:mod:`ignite_zero.adapters.fsdp`).

FSDP1 has no public way to read one rank's shard parameter by parameter: its state-dict paths unshard whole units
and clone every rank's shard. The ``FlatParameter`` attributes read here are documented in its docstring and
unchanged since torch 2.0; :func:`check_fsdp1_layout` turns a future change into a clear error instead of a wrong
checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.fsdp import FlatParameter, FullyShardedDataParallel

__all__ = [
    "FlatParamEntry",
    "SharedParamEntry",
    "check_fsdp1_layout",
    "fsdp1_flat_param",
    "fsdp1_local_shard",
    "fsdp1_orig_params",
    "fsdp1_param_entries",
    "fsdp1_shared_entries",
    "is_fsdp_flattened",
]

_FLAT_PARAM_ATTRIBUTES = ("_fqns", "_shapes", "_shard_param_infos", "_param_infos", "_shared_param_infos", "_params")


@dataclass(frozen=True)
class FlatParamEntry:
    """One original parameter inside an FSDP1 ``FlatParameter``, as seen from this rank.

    ``name`` is relative to the module the FSDP1 unit wraps. This rank's flat shard holds elements
    ``[full_offset, full_offset + shard_numel)`` of the flattened parameter, at
    ``[shard_offset, shard_offset + shard_numel)``; ``shard_numel`` is 0 when it holds none.
    """

    name: str
    shape: tuple[int, ...]
    owner: nn.Module
    shard_offset: int
    shard_numel: int
    full_offset: int


@dataclass(frozen=True)
class SharedParamEntry:
    """A parameter tied to another one of the same ``FlatParameter``: ``name`` is the same tensor as ``primary``."""

    name: str
    primary: str
    owner: nn.Module


def check_fsdp1_layout(unit: FullyShardedDataParallel) -> None:
    """Raise ``RuntimeError`` if this torch's FSDP1 no longer has the internals read here."""
    flat = getattr(getattr(unit, "_handle", None), "flat_param", None)
    missing = [] if hasattr(unit, "_handle") else ["FullyShardedDataParallel._handle"]
    if flat is not None:
        missing += [f"FlatParameter.{name}" for name in _FLAT_PARAM_ATTRIBUTES if not hasattr(flat, name)]
    if missing:
        raise RuntimeError(
            f"FSDP1 of torch {torch.__version__} has no {', '.join(missing)}: ignite_zero cannot read its shards. "
            "Please report it, or use FSDP2 (`fully_shard`)."
        )


def fsdp1_flat_param(unit: FullyShardedDataParallel) -> FlatParameter | None:
    """The ``FlatParameter`` of an FSDP1 unit; ``None`` for a unit that owns no parameters."""
    check_fsdp1_layout(unit)
    handle = unit._handle
    return None if handle is None else handle.flat_param


def fsdp1_param_entries(flat: FlatParameter) -> list[FlatParamEntry]:
    """The original parameters of ``flat`` in flattening order (shared ones excluded)."""
    return [
        FlatParamEntry(
            name=name,
            shape=tuple(shape),
            owner=param_info.module,
            shard_offset=(shard_info.offset_in_shard or 0) if shard_info.in_shard else 0,
            shard_numel=(shard_info.numel_in_shard or 0) if shard_info.in_shard else 0,
            full_offset=(shard_info.intra_param_start_idx or 0) if shard_info.in_shard else 0,
        )
        for name, shape, param_info, shard_info in zip(
            flat._fqns, flat._shapes, flat._param_infos, flat._shard_param_infos
        )
    ]


def fsdp1_shared_entries(flat: FlatParameter) -> list[SharedParamEntry]:
    """The parameters of ``flat`` that are tied to another of its parameters."""
    return [
        SharedParamEntry(
            name=_join(info.module_name, info.param_name),
            primary=_join(info.prim_module_name, info.prim_param_name),
            owner=info.module,
        )
        for info in flat._shared_param_infos
    ]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def fsdp1_local_shard(flat: FlatParameter) -> torch.Tensor:
    """This rank's flat shard in full precision (padded; on the CPU when parameters are offloaded).

    ``_local_shard`` rather than ``flat.data``: between forward and backward ``data`` may point at the
    unsharded or low-precision buffer. Before FSDP1's lazy initialisation (first forward) only ``data`` exists.
    """
    return getattr(flat, "_local_shard", flat.data)


def fsdp1_orig_params(flat: FlatParameter) -> list[nn.Parameter] | None:
    """The original parameters (views of ``flat``) in flattening order with ``use_orig_params=True``, else ``None``."""
    return None if flat._params is None else list(flat._params)


def is_fsdp_flattened(tensor: torch.Tensor) -> bool:
    """Whether FSDP1 flattened ``tensor``: a ``FlatParameter``, or an original parameter (``use_orig_params=True``)."""
    from torch.distributed.fsdp._common_utils import _is_fsdp_flattened

    return _is_fsdp_flattened(tensor)
