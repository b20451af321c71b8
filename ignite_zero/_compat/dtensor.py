"""DTensor layouts: where a rank's local tensor sits in the full tensor, which placements have a layout, and a DTensor
of a given local tensor.

:mod:`ignite_zero.adapters._fsdp2` and :mod:`ignite_zero.storage.formats.dcp_saved` need each rank's block of a
DTensor as DCP records it; torch computes it in a private function and keeps ``fully_shard``'s strided shards in a
private placement class.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any

import torch.distributed as dist

__all__ = [
    "dtensor_block",
    "dtensor_detached",
    "dtensor_layout",
    "dtensor_local",
    "dtensor_of_local",
    "unsupported_placement",
]


def dtensor_block(tensor: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The global offsets and sizes of this rank's local tensor of the DTensor ``tensor``: one block of the full
    tensor, on any mesh and with any ``Shard``, ``_StridedShard`` and ``Replicate`` placements.

    From torch's own ``compute_local_shape_and_global_offset`` (what DCP records for each DTensor shard), so that
    uneven, empty and strided shards follow torch wherever it changes its rules. A rank outside the tensor's mesh
    holds an empty block.
    """
    meta, placements, mesh = dtensor_layout(tensor)
    blocks = _blocks.get(mesh)
    if blocks is None:
        blocks = _blocks[mesh] = {}
    key = (meta.shape, placements, dist.get_rank() if dist.is_initialized() else -1)
    block = blocks.get(key)
    if block is None:
        block = blocks[key] = _dtensor_block(meta.shape, mesh, placements)
    return block


def dtensor_local(tensor: Any) -> Any:
    """This rank's local tensor of the DTensor ``tensor``: the tensor ``to_local()`` views with gradients off, without
    its autograd function (which costs more than a small tensor's save or load), nor the ``Parameter`` mark it gives
    a parameter's. For reading and copying its data and layout, not for a result that autograd should see."""
    return tensor._local_tensor


def dtensor_layout(tensor: Any) -> tuple[Any, Any, Any]:
    """The global layout of the DTensor ``tensor``: its shape, stride and dtype (one named tuple), its placements and
    its mesh, read from its spec at once; ``shape``, ``stride()`` and ``dtype`` each pass through DTensor's handling
    of tensor methods, which costs more than the rest of a small tensor's layout check."""
    spec = tensor._spec
    return spec.tensor_meta, spec.placements, spec.mesh


def dtensor_detached(tensor: Any) -> Any:
    """``tensor.detach()`` of the DTensor ``tensor`` (a view of its data, out of autograd), made from its local tensor
    and its layout: the same DTensor, without the dispatch of ``detach`` through DTensor's operator handling, which
    costs more than the rest of a small parameter's ``state_dict()`` entry."""
    from torch.distributed.tensor import DTensor

    return DTensor(tensor._local_tensor.detach(), tensor._spec, requires_grad=False)


def dtensor_of_local(like: Any, local: Any) -> Any:
    """A DTensor laid out like the DTensor ``like`` (its mesh, placements, shape and stride), of ``local``'s dtype,
    whose local tensor is ``local`` itself, wherever ``local`` lies; local, no communication.

    ``DTensor.from_local`` moves a local tensor that is not on its mesh's device type: the optimizer state of an FSDP2
    parameter offloaded to the CPU (``CPUOffloadPolicy``) would go to the GPU, as a copy that writes into ``local``
    never reach. FSDP2 builds its own offloaded parameters as this does, from the local tensor and the layout.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import TensorMeta

    spec = dataclasses.replace(like._spec, tensor_meta=TensorMeta(like.shape, like.stride(), local.dtype))
    return DTensor(local, spec, requires_grad=False)


# A model has few distinct shapes and layouts, so torch's computation, slow enough to show in every load, is kept by
# mesh for as long as the mesh lives (a mesh holds its process groups); the rank is part of the key, since meshes of
# two process groups in turn may compare equal.
_blocks: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], tuple[tuple[int, ...], tuple[int, ...]]]] = (
    weakref.WeakKeyDictionary()
)


def _dtensor_block(shape: Any, mesh: Any, placements: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sizes, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    if len(offsets) != len(shape):  # this rank is not part of the mesh
        return (0,) * len(shape), (0,) * len(shape)
    return tuple(int(o) for o in offsets), tuple(int(s) for s in sizes)


def unsupported_placement(placement: Any) -> str | None:
    """Why a DTensor placement cannot be checkpointed, or ``None`` for ``Shard``, ``Replicate`` and
    ``_StridedShard`` (private in torch: what ``fully_shard`` puts over a tensor-parallel ``Shard``)."""
    if type(placement) in _laid_out_placements():
        return None
    from torch.distributed.tensor import Partial

    if isinstance(placement, Partial):
        return (
            "a pending reduction (Partial): each rank holds a partial sum, not a part of the value; "
            "reduce it first (`redistribute(placements=[Replicate()])` or `full_tensor()`) or keep it out of "
            "the checkpointed state"
        )
    return (
        f"a custom placement ({type(placement).__qualname__}) whose layout ignite_zero cannot know; "
        "use Shard, Replicate or fully_shard's strided shards"
    )


@functools.cache
def _laid_out_placements() -> frozenset[type]:
    """The placement classes whose layout torch computes: asked of every placement of every tensor of a save."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return frozenset({Shard, Replicate, _StridedShard})
