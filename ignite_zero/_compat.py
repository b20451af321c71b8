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
    "default_store",
    "fairscale_oss_class",
    "serialization_crc32",
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
        from fairscale.optim import OSS
    except ImportError:
        return None
    return OSS


def consolidated_state_attribute(optimizer: Any) -> str | None:
    """Name of the private list in which a sharded optimizer keeps the per-rank states it consolidated.

    ``ZeroRedundancyOptimizer.state_dict()`` and fairscale ``OSS.state_dict()`` merge that list (one local
    ``optim.state_dict()`` per group rank, in rank order) into the global state. Filling it ourselves lets
    the optimizer's own code do the merge. ``None`` for any other class: use its ``consolidate_state_dict``.
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        name = "_all_state_dicts"
    elif type(optimizer).__module__.startswith("fairscale."):  # avoid importing fairscale (1 s) for others
        oss = fairscale_oss_class()
        if oss is None or not isinstance(optimizer, oss):
            return None
        name = "_all_states"
    else:
        return None
    if not isinstance(getattr(optimizer, name, None), list) or not hasattr(optimizer, "optim"):
        # The attribute moved upstream: fall back to the optimizer's own consolidation.
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
