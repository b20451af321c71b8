"""FSDP2 (``fully_shard``): where a rank's shards are, as pieces to send and as targets to load into.

Sharded parameters and their element-wise optimizer state are ``DTensor``s on a 1-D device mesh; a rank's
rows follow ``torch.chunk`` along the sharded dimension. Only public API is used. Any DTensor operation may
be a collective (even ``t[0].numel()`` all-gathers), so DTensors are touched only through ``to_local()``,
``shape``, ``stride()``, ``placements`` and ``device_mesh``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard

from ignite_zero.adapters._fsdp_common import LoadPlan, ParamLayout, Slot, add_value, clean_name, whole_slot
from ignite_zero.adapters.regions import Pieces

__all__ = [
    "check",
    "dtensor_like",
    "dtensor_slot",
    "model_pieces",
    "param_layouts",
    "plan_model_load",
    "reshard",
]


def reshard(module: nn.Module) -> None:
    """Put every FSDP2 module of ``module`` in its sharded state, as its own ``state_dict()`` does first; local.

    With ``reshard_after_forward=False`` a module keeps unsharded, plain parameters registered after a forward
    (e.g. an evaluation), which are not the ``DTensor`` parameters its optimizer holds.
    """
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def check(module: nn.Module, world_size: int) -> None:
    """Refuse, locally, what the gather cannot consolidate.

    Raises:
        ValueError: a parameter on a device mesh that is not 1-D (HSDP, FSDP2 with tensor parallelism), placed
            otherwise than ``Shard``/``Replicate``, or on a mesh that does not span the world.
    """
    reshard(module)
    for name, param in module.named_parameters():
        if not isinstance(param, DTensor):
            continue
        mesh = param.device_mesh
        if mesh.ndim != 1:
            raise ValueError(
                f"Parameter {clean_name(name)} is sharded over a {mesh.ndim}-D device mesh (placements "
                f"{param.placements}): HSDP and 2-D parallelism are not supported yet; use a 1-D mesh"
            )
        if type(param.placements[0]) not in (Shard, Replicate):
            raise ValueError(f"Parameter {clean_name(name)} has placement {param.placements[0]}: not supported yet")
        if mesh.size() != world_size:
            raise ValueError(
                f"Parameter {clean_name(name)} is sharded over {mesh.size()} ranks, but the world has {world_size}: "
                "sharding over a subgroup is not supported yet"
            )


def dtensor_slot(name: str, tensor: DTensor) -> Slot:
    """Where this rank's local tensor of ``tensor`` sits in the full tensor."""
    shape = tuple(tensor.shape)
    placement = tensor.placements[0]
    if not isinstance(placement, Shard):  # Replicate: `check` refuses anything else
        return Slot(name, shape, -1, 0, math.prod(shape))
    dim = placement.dim % len(shape)
    mesh = tensor.device_mesh
    size = shape[dim]
    chunk = -(-size // mesh.size())  # torch.chunk: trailing ranks may hold nothing
    start = min(mesh.get_local_rank() * chunk, size)
    length = min(chunk, size - start)
    local_rows = tensor.to_local().shape[dim]
    if local_rows != length:
        raise RuntimeError(f"{name}: this rank holds {local_rows} rows along dim {dim}, expected {length}")
    if dim == 0:  # a block of rows is one flat range: received in place, no staging
        row = math.prod(shape[1:])
        return Slot(name, shape, -1, start * row, length * row)
    return Slot(name, shape, dim, start, length)


def dtensor_like(param: DTensor, local: torch.Tensor) -> DTensor:
    """A DTensor laid out like ``param`` whose local tensor is ``local``; local, no communication."""
    return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())


def _tied_names(module: nn.Module) -> dict[str, str]:
    """Clean name of every parameter and buffer -> the first clean name of the same tensor."""
    first: dict[int, str] = {}
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    return {clean_name(name): clean_name(first.setdefault(id(tensor), name)) for name, tensor in named}


def model_pieces(module: nn.Module) -> Pieces:
    """This rank's pieces of the full model state, keyed ``(name,)`` in ``state_dict()`` order.

    ``state_dict()`` of an FSDP2 module reshards it (locally) and returns DTensor views of the shards: nothing
    is copied here.
    """
    pieces = Pieces()
    tied = _tied_names(module)
    for raw_name, value in module.state_dict().items():
        name = clean_name(raw_name)
        if tied.get(name, name) != name:  # sent once, the same tensor under both names on the recipient
            pieces.add_alias((name,), (tied[name],))
        elif isinstance(value, DTensor):
            dtensor_slot(name, value).add_to(pieces, (name,), value.to_local())
        else:
            add_value(pieces, (name,), value)
    return pieces


def plan_model_load(module: nn.Module, state_dict: Mapping[str, Any], strict: bool) -> LoadPlan:
    """How to copy this rank's part of a full model state into its shards; local, one tensor at a time.

    Each rank copies its rows into the local tensors of the DTensors ``state_dict()`` returns (views of the
    shards), then ``load_state_dict`` runs FSDP2's hooks, buffers and extra state on those same tensors
    (copying a tensor onto itself allocates nothing). The plan checks everything before it copies anything.
    """
    plan = LoadPlan(type(module).__name__, state_dict, strict)
    to_load: dict[str, Any] = {}
    for raw_name, current in module.state_dict().items():
        name = clean_name(raw_name)
        value = plan.expect(name, tuple(current.shape) if isinstance(current, torch.Tensor) else None)
        if value is None:
            continue
        if isinstance(current, DTensor):
            slot = dtensor_slot(name, current)
            plan.copy(slot.local_part(current.to_local()), slot.full_part(value))
            value = current
        to_load[raw_name] = value
    plan.call(lambda values: module.load_state_dict(values, strict=strict), to_load)
    return plan


def param_layouts(module: nn.Module) -> dict[int, ParamLayout]:
    """The layout of every parameter an optimizer of ``module`` may hold, by ``id``; parameters that are not
    sharded are whole on every rank."""
    reshard(module)
    layouts = {}
    for raw_name, param in module.named_parameters():
        name = clean_name(raw_name)
        if isinstance(param, DTensor):
            layouts[id(param)] = ParamLayout(param, tuple(param.to_local().shape), [dtensor_slot(name, param)])
        else:
            layouts[id(param)] = ParamLayout(param, tuple(param.shape), [whole_slot(name, param)])
    return layouts
