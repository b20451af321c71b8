"""FSDP2 (``fully_shard``): where a rank's shards are, as pieces to send and as targets to load into.

Sharded parameters and their element-wise optimizer state are ``DTensor``s on any device mesh: 1-D FSDP2,
HSDP (``(Replicate(), Shard(0))``), FSDP2 over tensor parallelism (``(_StridedShard(0, sf), Shard(d))``), and
units on different meshes. A rank's local tensor is one block of the full tensor, whose offsets and sizes come
from torch's own DTensor metadata (:func:`ignite_zero._compat.dtensor_block`). Any DTensor operation may be a
collective (even ``t[0].numel()`` all-gathers), so DTensors are touched only through their local tensor
(:func:`ignite_zero._compat.dtensor_local`), ``shape``, ``stride()``, ``placements`` and ``device_mesh``.
"""

from __future__ import annotations

import functools
import math
import operator
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Placement

from ignite_zero import _compat
from ignite_zero.adapters._fsdp_common import ParamLayout, PendingModelLoad, Slot, add_value, clean_name, whole_slot
from ignite_zero.adapters.regions import Box, Pieces

__all__ = [
    "MeshLayout",
    "check",
    "check_optimizer",
    "dtensor_pieces",
    "dtensor_slot",
    "load_sharded_model",
    "load_sharded_optimizer",
    "model_pieces",
    "param_layouts",
    "param_names",
    "plan_model_load",
    "reshard",
    "sharded_model_state",
    "sharded_optimizer_state",
]


def reshard(module: nn.Module) -> None:
    """Put every FSDP2 module of ``module`` in its sharded state, as its own ``state_dict()`` does first; local.

    With ``reshard_after_forward=False`` a module keeps unsharded, plain parameters registered after a forward
    (e.g. an evaluation), which are not the ``DTensor`` parameters its optimizer holds.
    """
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def check(module: nn.Module) -> None:
    """Refuse, locally, what the gather cannot consolidate: the same error on every rank that holds the tensor.

    Any mesh is supported, over the whole world or a part of it (ranks outside a tensor's mesh hold none of it).

    Raises:
        ValueError: a parameter or buffer with a ``Partial`` placement (a pending reduction) or a placement other
            than ``Shard``, ``Replicate`` and FSDP2's strided shard, naming the tensor and its placements.
    """
    reshard(module)
    named = [*module.named_parameters(), *module.named_buffers()]
    _check_placements([tensor for _, tensor in named], lambda position: named[position][0])


def check_optimizer(module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """:func:`check`'s refusals for what ``optimizer`` holds: its parameters, whose layout its state has; local.

    They are the sharded parameters whether ``module`` is sharded at the moment or not: nothing is resharded.
    """
    params = [param for group in optimizer.param_groups for param in group["params"]]
    # named for the message alone; a module kept unsharded after a forward shows other tensors, and names none of them
    _check_placements(
        params, lambda position: _names_by_id(module).get(id(params[position]), "a parameter of its optimizer")
    )


def _check_placements(tensors: Sequence[torch.Tensor], name_of: Callable[[int], str]) -> None:
    """Refuse the first of ``tensors`` with a placement that cannot be checkpointed, named by its position."""
    for position, tensor in enumerate(tensors):
        if not isinstance(tensor, DTensor):
            continue
        for placement in tensor.placements:
            problem = _compat.unsupported_placement(placement)
            if problem is not None:
                raise ValueError(
                    f"{clean_name(name_of(position))} has placements {tensor.placements} on "
                    f"{_mesh_text(tensor.device_mesh)}: {placement} is {problem}"
                )


@dataclass(frozen=True)
class MeshLayout:
    """How a rank holds a DTensor: its mesh (shape and global ranks, row-major) and placements.

    Ranks of one mesh must agree on it; :func:`ignite_zero.adapters.regions.gather_pieces` compares them.
    """

    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    placements: str

    def __str__(self) -> str:
        return f"placements {self.placements} on a {self.shape} mesh of ranks {list(self.ranks)}"


def _mesh_text(mesh: DeviceMesh) -> str:
    return f"a {tuple(mesh.shape)} mesh of ranks {mesh.mesh.flatten().tolist()}"


@functools.lru_cache(maxsize=256)
def _layout(mesh: DeviceMesh, placements: Sequence[Placement]) -> MeshLayout:
    # One object per (mesh, placements): pickle writes it once per manifest, however many tensors share it (a
    # mesh of 1024 ranks would otherwise add 1024 numbers per tensor). Meshes live as long as training anyway.
    return MeshLayout(tuple(mesh.shape), tuple(mesh.mesh.flatten().tolist()), str(tuple(placements)))


# The block of each DTensor met, with the layout it was found from: a consolidated save asks for each parameter's
# twice (its model's pieces, its optimizer's layouts), at every save, and its layout seldom changes. By id, kept while
# the DTensor lives (tensors compare by value, which a weak dictionary would ask of them).
_boxes: dict[int, tuple[weakref.ref[DTensor], tuple[Any, ...], Box]] = {}


def dtensor_slot(name: str, tensor: DTensor) -> Slot:
    """Where this rank's local tensor of ``tensor`` sits in the full tensor: a block, from torch's metadata."""
    layout = _compat.dtensor_layout(tensor)
    kept = _boxes.get(id(tensor))
    # the same objects (shape, placements, mesh) as when it was found: a layout that changes is made anew
    if kept is not None and kept[0]() is tensor and all(map(operator.is_, kept[1], layout)):
        return Slot(name, kept[2])
    offsets, sizes = _compat.dtensor_block(tensor)
    local = tuple(_compat.dtensor_local(tensor).shape)
    if local != sizes and math.prod(sizes) + math.prod(local) > 0:
        raise RuntimeError(
            f"{name}: this rank holds a local tensor of shape {local}, but its placements {tensor.placements} give "
            f"{sizes}; please report it"
        )
    box = Box(tuple(tensor.shape), offsets, sizes)
    key = id(tensor)
    _boxes[key] = (weakref.ref(tensor, functools.partial(_forget_box, _boxes, key)), layout, box)
    return Slot(name, box)


def _forget_box(boxes: dict[int, Any], key: int, _: Any) -> None:
    # given the dictionary itself, not found by its global name: a tensor may die as the interpreter shuts down
    boxes.pop(key, None)


def dtensor_pieces(pieces: Pieces, key: tuple[Any, ...], slot: Slot, tensor: DTensor) -> None:
    """Add this rank's block of ``tensor`` (laid out like the parameter of ``slot``), with its mesh and placements."""
    _, placements, mesh = _compat.dtensor_layout(tensor)
    slot.add_to(pieces, key, _compat.dtensor_local(tensor), _layout(mesh, placements))


def model_pieces(module: nn.Module) -> Pieces:
    """This rank's pieces of the full model state, keyed ``(name,)`` in ``state_dict()`` order.

    ``state_dict()`` of an FSDP2 module reshards it (locally) and returns DTensor views of the shards: nothing
    is copied here.
    """
    pieces = Pieces()
    first: dict[int, str] = {}  # the first name of each tensor: tied parameters are one tensor under several
    for raw_name, kept in module.state_dict(keep_vars=True).items():
        name = clean_name(raw_name)
        named = first.setdefault(id(kept), name) if isinstance(kept, torch.Tensor) else name
        if named != name:  # sent once, the same tensor under both names on the recipient
            pieces.add_alias((name,), (named,))
        elif isinstance(kept, DTensor):  # its local tensor is the piece: no detached DTensor needed around it
            dtensor_pieces(pieces, (name,), dtensor_slot(name, kept), kept)
        else:
            add_value(pieces, (name,), kept)
    return pieces


def plan_model_load(module: nn.Module, state_dict: Mapping[str, Any], strict: bool) -> PendingModelLoad:
    """How to copy this rank's part of a full model state into its shards; local, one tensor at a time.

    Each rank copies its rows into the local tensors of the DTensors ``state_dict()`` returns (views of the
    shards), and the values of plain tensors into them, then ``load_state_dict`` runs FSDP2's hooks and extra state
    on those same tensors (copying a tensor onto itself allocates nothing). The plan checks everything before it
    copies anything.
    """
    plan = PendingModelLoad(type(module).__name__, state_dict, strict)
    to_load: dict[str, Any] = {}
    for raw_name, current in module.state_dict().items():
        name = clean_name(raw_name)
        value = plan.expect(name, tuple(current.shape) if isinstance(current, torch.Tensor) else None)
        if value is None:
            continue
        if isinstance(current, DTensor):
            slot = dtensor_slot(name, current)
            plan.copy(slot.local_part(_compat.dtensor_local(current)), slot.full_part(value))
            value = current
        elif isinstance(current, torch.Tensor):  # a buffer, or a parameter left whole: copied in place, one at a time
            plan.copy(current, value)
            value = current
        to_load[raw_name] = value
    plan.call(lambda values: _compat.load_module_state(module, values, strict=strict), to_load)
    return plan


def param_layouts(module: nn.Module) -> dict[int, ParamLayout]:
    """The layout of every parameter an optimizer of ``module`` may hold, by ``id``; parameters that are not
    sharded are whole on every rank."""
    reshard(module)
    layouts = {}
    for raw_name, param in module.named_parameters():
        name = clean_name(raw_name)
        if isinstance(param, DTensor):
            layouts[id(param)] = ParamLayout(
                param, tuple(_compat.dtensor_local(param).shape), [dtensor_slot(name, param)]
            )
        else:
            layouts[id(param)] = ParamLayout(param, tuple(param.shape), [whole_slot(name, param)])
    return layouts


# Sharded state dicts. FSDP2's parameters are DTensors already, so a module's own state_dict() is its sharded state,
# and an optimizer's holds the DTensors of that state: naming them is all torch's get/set_*_state_dict add here, and
# they rebuild maps of every parameter's names on every call (a third of a sharded save of many small tensors).
# The names are the consolidated state's, which are torch's for FSDP2 modules (the tests compare the two).


def _names_by_id(module: nn.Module) -> dict[int, str]:
    return {id(param): clean_name(name) for name, param in module.named_parameters()}


def _optimizer_param_names(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each parameter of ``optimizer``, in the order of its parameter groups (that of the indices of its
    ``state_dict()``)."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    names = _names_by_id(module)
    if not all(id(param) in names for param in params):
        reshard(module)  # only then: kept unsharded after a forward, it shows other parameters than its optimizer's
        names = _names_by_id(module)
    return [names[id(param)] for param in params]


def param_names(module: nn.Module) -> set[str]:
    """The names of every parameter an optimizer of ``module`` may hold state for (a tied one's first name): the
    same whether a module is sharded or not, which registers other tensors under the same names."""
    return set(_names_by_id(module).values())


@torch.no_grad()
def sharded_model_state(module: nn.Module) -> dict[str, Any]:
    """This rank's shards (DTensor views), buffers and extra state, by the unwrapped module's names, as torch's
    ``get_model_state_dict(module, options=StateDictOptions(full_state_dict=False))`` gives them, in its order: the
    entries under a wrapper's segment (a compiled or checkpointed part) move to the end, as it renames them."""
    # the module's own entries, detached here: DTensor's detach() through its dispatch costs most of state_dict()
    named = [(clean_name(name), name, _detached(value)) for name, value in module.state_dict(keep_vars=True).items()]
    state = {name: value for name, raw, value in named if name == raw}
    state.update((name, value) for name, raw, value in named if name != raw)
    return state


def _detached(value: Any) -> Any:
    """``value.detach()`` for a tensor, as ``state_dict()`` gives them; anything else (extra state) as it is."""
    if type(value) is DTensor:  # a DTensor parameter is one, marked as a parameter
        return _compat.dtensor_detached(value)
    return value.detach() if isinstance(value, torch.Tensor) else value


@torch.no_grad()
def load_sharded_model(module: nn.Module, state: Mapping[str, Any]) -> None:
    """Load :func:`sharded_model_state`'s form through ``module.load_state_dict`` (strict), under the module's own
    names, as torch's ``set_model_state_dict`` does."""
    own_names = {clean_name(name): name for name in module.state_dict(keep_vars=True)}
    _compat.load_module_state(module, {own_names.get(name, name): value for name, value in state.items()})


def sharded_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` keyed by parameter names: this rank's part of the state (DTensors laid out like
    the parameters), as torch's ``get_optimizer_state_dict(..., options=StateDictOptions(full_state_dict=False))``
    gives it for an optimizer that has state."""
    by_index = _optimizer_param_names(module, optimizer)
    indexed = optimizer.state_dict()
    return {
        "state": {by_index[index]: value for index, value in indexed["state"].items()},
        "param_groups": [
            {**group, "params": [by_index[index] for index in group["params"]]} for group in indexed["param_groups"]
        ],
    }


def load_sharded_optimizer(module: nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """Load :func:`sharded_optimizer_state`'s form through ``optimizer.load_state_dict``.

    Each parameter group of the optimizer takes the hyperparameters of the saved group that holds the same
    parameters, in whatever order; each parameter the state saved for it.

    Raises:
        ValueError: a parameter group of the optimizer holds parameters that no saved group holds exactly.
    """
    names = _optimizer_param_names(module, optimizer)
    saved_groups = state["param_groups"]
    group_of = {name: group for group in saved_groups for name in group["params"]}
    empty_groups = iter([group for group in saved_groups if not group["params"]])
    saved_state = state["state"]
    groups, by_index, start = [], {}, 0
    for position, group in enumerate(optimizer.param_groups):
        own = names[start : start + len(group["params"])]
        saved = group_of.get(own[0]) if own else next(empty_groups, None)
        if saved is None or sorted(saved["params"]) != sorted(own):
            raise ValueError(
                f"Parameter group {position} of this {type(optimizer).__name__} holds {own}, which no parameter group "
                f"of the checkpoint holds: build the optimizer's parameter groups as they were when it was saved"
            )
        groups.append({**saved, "params": list(range(start, start + len(own)))})
        by_index.update({start + i: saved_state[name] for i, name in enumerate(own) if name in saved_state})
        start += len(own)
    _compat.load_optimizer_state(optimizer, {"state": by_index, "param_groups": groups})
