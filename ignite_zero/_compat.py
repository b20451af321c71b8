"""The one place where torch, ignite and fairscale versions are compared and their private internals touched.

Everything version- or internals-dependent lives here as a small function or flag, so that raising the
supported floor, or following an upstream change, means editing this file alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from packaging.version import Version

__all__ = [
    "MIN_TORCH_VERSION",
    "TORCH_VERSION",
    "CheckpointEvents",
    "consolidated_state_attribute",
    "dcp_host_copies",
    "default_store",
    "fairscale_oss_class",
    "serialization_crc32",
    "sharded_optimizer_kind",
    "zero_awaits_ddp",
]

#: Oldest torch release this package supports (``fully_shard`` and the state-dict helpers of
#: ``torch.distributed.checkpoint`` are public from it on). CI tests the pinned release.
MIN_TORCH_VERSION = Version("2.6")
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


@contextmanager
def serialization_crc32() -> Iterator[None]:
    """Make ``torch.save`` compute the CRC-32 of every record while it writes, whatever the user chose."""
    get = getattr(torch.serialization, "get_crc32_options", None)
    if get is None or get():
        yield
        return
    torch.serialization.set_crc32_options(True)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(False)


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
