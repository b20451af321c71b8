"""The one place where torch, ignite and fairscale versions are compared and their private internals touched.

Everything version- or internals-dependent lives here as a small function or flag, so that raising the
supported floor, or following an upstream change, means editing this file alone.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from packaging.version import Version

# DCP's writer and reader of fsspec URLs: torch 2.11 to 2.14 do not re-export them from torch.distributed.checkpoint.
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader as DcpFsspecReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter as DcpFsspecWriter

__all__ = [
    "MIN_TORCH_VERSION",
    "TORCH_VERSION",
    "CheckpointEvents",
    "consolidated_state_attribute",
    "dcp_entry_path",
    "dcp_host_copies",
    "default_store",
    "fairscale_oss_class",
    "serialization_crc32",
    "DcpFsspecReader",
    "DcpFsspecWriter",
    "storage_offset_in_file",
    "sharded_optimizer_kind",
    "zero_awaits_ddp",
]

#: Oldest torch release this package supports: the oldest on which the whole suite is known to pass (2.11.0 and
#: 2.12.1 once each; CI tests the 2.13.0 pin, then 2.14.1). Older releases fail it for reasons of their own:
#: - 2.10.0, 2.9.1: ``torch.load(..., map_location="meta")`` sets no ``_checkpoint_offset`` on the storages (2.10
#:   sets it under a fake tensor mode only), so :func:`storage_offset_in_file` refuses, and checkpoint files on an
#:   object store cannot be read in parts: 10 tests of tests/test_object_storage.py fail, everything else passes;
#: - 2.8, 2.7: ``dcp.async_save`` takes no ``no_dist`` (``dcp.save`` does from 2.7 on), so an asynchronous sharded
#:   save written by one rank alone fails; bridging it would take a process group of that rank alone for each such
#:   save, and the next difference rules these releases out anyway;
#: - 2.8, 2.7: FSDP2 over gloo sums the gradients of the ranks instead of averaging them (on 2 ranks a gradient
#:   2.0 times the unsharded one with 2.7.1 and 2.8.0, 1.0 with 2.9.1 and 2.13.0), so training differs from the
#:   unsharded twin the suite compares with; the checkpoints themselves hold what FSDP2 computed;
#: - 2.6: FSDP2 cannot run a forward on CPU (``'Stream' object has no attribute 'record_event'``), and
#:   ``dcp.save`` takes no ``no_dist`` either.
MIN_TORCH_VERSION = Version("2.11")
TORCH_VERSION = Version(Version(torch.__version__).base_version)

if TORCH_VERSION < MIN_TORCH_VERSION:  # pragma: no cover - guarded by install_requires
    raise ImportError(f"ignite_zero needs torch>={MIN_TORCH_VERSION}, found {torch.__version__}")

try:
    from ignite.handlers.checkpoint import CheckpointEvents
except ImportError:  # ignite < 0.5.3 fires no checkpoint events of its own
    from ignite.engine import EventEnum

    class CheckpointEvents(EventEnum):  # type: ignore[no-redef]
        """Events fired by :class:`ignite_zero.Checkpoint`."""

        SAVED_CHECKPOINT = "saved_checkpoint"


def default_store() -> dist.Store:
    """The key-value store of the default process group (torch keeps the accessor private)."""
    return dist.distributed_c10d._get_default_store()


def fairscale_oss_class() -> type | None:
    """fairscale's ``OSS`` optimizer class if fairscale is importable, else ``None``."""
    try:
        from fairscale.optim import OSS  # type: ignore[import-untyped]
    except ImportError:
        return None
    return OSS


def sharded_optimizer_kind(optimizer: Any, genuine: bool = False) -> str | None:
    """``"zero"`` for torch's ``ZeroRedundancyOptimizer``, ``"oss"`` for fairscale's ``OSS``, else ``None``.

    Args:
        optimizer: the optimizer, or a proxy of one: ``isinstance`` believes the ``__class__`` that a
            ``MagicMock(ZeroRedundancyOptimizer, wraps=optimizer)`` claims.
        genuine: recognise only real instances (of the class or a subclass), whose private lists can be filled.
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer

    def of(cls: type) -> bool:
        return issubclass(type(optimizer), cls) if genuine else isinstance(optimizer, cls)

    if of(ZeroRedundancyOptimizer):
        return "zero"
    if type(optimizer).__module__.startswith("fairscale.") or getattr(
        optimizer, "__class__", object
    ).__module__.startswith("fairscale."):  # avoid importing fairscale (1 s) for others
        oss = fairscale_oss_class()
        if oss is not None and of(oss):
            return "oss"
    return None


def consolidated_state_attribute(optimizer: Any) -> str | None:
    """Name of the private list in which a sharded optimizer keeps the per-rank states it consolidated.

    ``ZeroRedundancyOptimizer.state_dict()`` and fairscale ``OSS.state_dict()`` merge that list (one local
    ``optim.state_dict()`` per group rank, in rank order) into the global state. Filling it ourselves lets
    the optimizer's own code do the merge. ``None`` for any other class: use its ``consolidate_state_dict``.
    """
    name = {"zero": "_all_state_dicts", "oss": "_all_states"}.get(sharded_optimizer_kind(optimizer, genuine=True) or "")
    if name is None or not isinstance(getattr(optimizer, name, None), list) or not hasattr(optimizer, "optim"):
        # Unknown, or the attribute moved upstream: fall back to the optimizer's own consolidation.
        return None
    return name


def zero_awaits_ddp(optimizer: Any) -> bool:
    """Whether a ``ZeroRedundancyOptimizer(overlap_with_ddp=True)`` still waits for DDP to initialise it.

    Such an optimizer builds its local optimizer only once DDP has rebuilt its buckets (after the first
    iterations); until then it has no state to consolidate and ``consolidate_state_dict`` raises.
    """
    if not getattr(optimizer, "_overlap_with_ddp", False):
        return False
    from torch.distributed.optim.zero_redundancy_optimizer import _OverlapStatus

    return optimizer._overlap_info.status != _OverlapStatus.INITIALIZED


def dcp_host_copies() -> tuple[Any, Any]:
    """``torch.distributed.checkpoint``'s functions that allocate host copies of a state (``DTensor`` and
    ``ShardedTensor`` included) and copy a state into them: ``(create(state, pin_memory), copy(state, copies))``.

    DCP's own cached staging pins its buffers unconditionally, which fails on hosts without an accelerator.
    """
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

    return _create_cpu_state_dict, _copy_state_dict


def storage_offset_in_file(storage: torch.UntypedStorage) -> int:
    """Where the bytes of a storage lie in the checkpoint file it was loaded from with ``map_location="meta"``.

    ``torch.load`` records it on each meta storage as ``_checkpoint_offset`` (torch 2.11 to 2.14), the offset of the
    record's data in the zip archive; there is no public accessor.
    """
    offset = getattr(storage, "_checkpoint_offset", None)
    if offset is None:
        raise RuntimeError(
            f"torch {torch.__version__} does not record where a storage lies in its file: ignite_zero cannot read "
            "checkpoint files in parts from an object store with this torch; use the versions it was tested with"
        )
    return int(offset)


def dcp_flatten(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, tuple[Any, ...]]]:
    """A nested state flattened as DCP's default planners flatten it: each entry by the name it is saved under (a
    container without tensors is one entry), and the path of each in ``state``."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, paths = flatten_state_dict(state)
    return dict(flat), {name: tuple(path) for name, path in paths.items()}


def dcp_entry_path(metadata: Any, name: str) -> tuple[Any, ...]:
    """The path, in the nested state it was saved from, of the flattened DCP entry ``name``
    (``("optimizer", "state", "3", "exp_avg")``), from the mapping DCP's default planner keeps in ``planner_data``."""
    planner_data = getattr(metadata, "planner_data", None) or {}
    return tuple(planner_data.get(name, (name,)))


@contextmanager
def serialization_crc32() -> Iterator[None]:
    """Make ``torch.save`` compute the CRC-32 of every record while it writes, whatever the user chose."""
    if torch.serialization.get_crc32_options():
        yield
        return
    torch.serialization.set_crc32_options(True)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(False)


# --------------------------------------------------------------------------------------------------
# DTensor layouts (for ignite_zero.adapters._fsdp2): where a rank's local tensor sits in the full tensor.

__all__ += ["dtensor_block", "unsupported_placement"]


def dtensor_block(tensor: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The global offsets and sizes of this rank's local tensor of the DTensor ``tensor``: one block of the full
    tensor, on any mesh and with any ``Shard``, ``_StridedShard`` and ``Replicate`` placements.

    From torch's own ``compute_local_shape_and_global_offset`` (what DCP records for each DTensor shard), so that
    uneven, empty and strided shards follow torch wherever it changes its rules. A rank outside the tensor's mesh
    holds an empty block.
    """
    mesh = tensor.device_mesh
    key = (tuple(tensor.shape), tuple(tensor.placements), dist.get_rank() if dist.is_initialized() else -1)
    blocks = _blocks.setdefault(mesh, {})
    if key not in blocks:
        blocks[key] = _dtensor_block(tensor.shape, mesh, tensor.placements)
    return blocks[key]


# A model has few distinct shapes and layouts: torch's computation took 30 us a tensor, 3 ms of each load of 96 FSDP2
# shards, for two layouts. Kept by mesh, for as long as the mesh lives (a mesh holds its process groups); the rank is
# part of the key, since meshes of two process groups in turn may compare equal.
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
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if type(placement) in (Shard, Replicate, _StridedShard):
        return None
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


# --------------------------------------------------------------------------------------------------
# FSDP1 internals: the FlatParameter layout (for ignite_zero.adapters.fsdp).
#
# FSDP1 has no public way to read one rank's shard parameter by parameter: its state-dict paths unshard
# whole units and clone every rank's shard. The FlatParameter attributes read below are documented in its
# docstring (torch/distributed/fsdp/_flat_param.py) and unchanged since torch 2.0; `check_fsdp1_layout`
# turns a future change into a clear error instead of a wrong checkpoint.

# Imported here to keep this section self-contained.
from dataclasses import dataclass  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.fsdp import FlatParameter, FullyShardedDataParallel

__all__ += [
    "FlatParamEntry",
    "SharedParamEntry",
    "check_fsdp1_layout",
    "fsdp1_flat_param",
    "fsdp1_local_shard",
    "fsdp1_orig_params",
    "fsdp1_param_entries",
    "fsdp1_shared_entries",
    "is_fsdp_flattened",
    "non_persistent_buffer_names",
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


def non_persistent_buffer_names(module: nn.Module) -> set[str]:
    """Names of ``module``'s own buffers that ``state_dict()`` leaves out."""
    return set(getattr(module, "_non_persistent_buffers_set", ()))


# --------------------------------------------------------------------------------------------------
# fairscale FSDP internals: where fairscale.nn.FullyShardedDataParallel keeps this rank's shards (for
# ignite_zero.adapters.fairscale_fsdp).
#
# fairscale 0.4.13 has no way to read one rank's shard parameter by parameter without collectives on every
# rank: `state_dict()` unshards every unit on every rank's GPU, `local_state_dict()` needs CUDA and gives flat
# shards without their layout. The attributes read below are set by `FullyShardedDataParallel.__init__`,
# `_shard_parameters_` and `_lazy_init`, and by `FlattenParamsWrapper` (fairscale/nn/misc/flatten_params_wrapper.py);
# `check_fairscale_fsdp_layout` turns a change into a clear error instead of a wrong checkpoint. fairscale is
# imported only for objects whose own class comes from it: the import costs about a second.

__all__ += [
    "FairscaleParamEntry",
    "FairscaleSharedEntry",
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
    if not any(cls.__module__.startswith("fairscale.") for cls in type(module).__mro__):
        return False
    cls = fairscale_fsdp_class()
    return cls is not None and isinstance(module, cls)


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


# --------------------------------------------------------------------------------------------------
# torch.save's archive, written by ignite_zero.storage.formats.torch_zip: what its pickler records of a storage.

__all__ += ["SavedStorage", "saved_storage", "storage_alignment", "storage_archive_version"]


@dataclass(frozen=True)
class SavedStorage:
    """What ``torch.save`` records of a storage that the pickled object refers to.

    Attributes:
        storage: its bytes (an untyped storage).
        identity: the same for every reference to the same storage.
        storage_type: the legacy class the loader rebuilds it as (``torch.FloatStorage``...).
        numel: its size in elements of ``storage_type``.
        location: its device as ``torch.load``'s ``map_location`` names it (``"cpu"``, ``"cuda:0"``).
    """

    storage: torch.UntypedStorage
    identity: int
    storage_type: Any
    numel: int
    location: str


def saved_storage(obj: Any) -> SavedStorage | None:
    """What ``torch.save``'s pickler records for ``obj`` when it is a storage (``None`` otherwise): the typed
    storages that tensors reduce to carry their dtype's legacy storage class and size in private attributes
    (``_untyped_storage``, ``_pickle_storage_type``, ``_size``), and storages are told apart by ``_cdata`` (torch
    2.11 to 2.14)."""
    if isinstance(obj, torch.storage.TypedStorage):
        storage = obj._untyped_storage
        storage_type, numel = getattr(torch, obj._pickle_storage_type()), obj._size()
    elif isinstance(obj, torch.UntypedStorage):
        storage, storage_type, numel = obj, torch.UntypedStorage, obj.nbytes()
    else:
        return None
    return SavedStorage(storage, storage._cdata, storage_type, numel, torch.serialization.location_tag(storage))


def storage_alignment() -> int:
    """The alignment of the records' data in an archive ``torch.save`` writes (64 unless configured otherwise)."""
    return int(torch.serialization._get_storage_alignment())


def storage_archive_version() -> bytes:
    """The content of the ``version`` record that ``torch.save`` writes (``b"3\\n"`` with torch 2.11 to 2.14)."""
    return b"3\n"


# --------------------------------------------------------------------------------------------------
# DCP's file layout, written by ignite_zero.storage.formats.dcp_files.

__all__ += ["DCP_VERSION", "dcp_storage_info"]

#: The version ``FileSystemWriter`` records in ``.metadata`` (torch 2.11 to 2.14).
DCP_VERSION = "1.0.0"


def dcp_storage_info(relative_path: str, offset: int, length: int) -> Any:
    """Where an entry lies, as ``.metadata`` records it for DCP's readers: the private ``_StorageInfo`` of its
    file system writer (torch 2.11 to 2.14), which plain ``dcp.load`` and ``dcp_to_torch_save`` unpickle."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(relative_path, offset, length)


__all__ += ["dcp_metadata_globals"]


def dcp_metadata_globals() -> frozenset[tuple[str, str]]:
    """The globals that DCP's ``.metadata`` is made of, by module and name (torch 2.11 to 2.14): its metadata
    dataclasses, the private ``_StorageInfo`` of its file system writer, the enum of memory formats, the function
    that finds a layout by its name, ``torch.Size`` and ``pathlib``'s paths (a ``StorageMeta``'s checkpoint id).
    ``torch.<dtype>`` is admitted beside them. Nothing here runs code beyond building these values."""
    metadata = "torch.distributed.checkpoint.metadata"
    return frozenset(
        {
            (metadata, "Metadata"),
            (metadata, "MetadataIndex"),
            (metadata, "StorageMeta"),
            (metadata, "TensorStorageMetadata"),
            (metadata, "BytesStorageMetadata"),
            (metadata, "ChunkStorageMetadata"),
            (metadata, "TensorProperties"),
            (metadata, "_MEM_FORMAT_ENCODING"),
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
            ("torch.serialization", "_get_layout"),
            ("torch", "Size"),
            ("pathlib", "PosixPath"),
            ("pathlib", "PurePosixPath"),
            ("pathlib", "WindowsPath"),
            ("pathlib", "PureWindowsPath"),
            ("pathlib", "Path"),
        }
    )
