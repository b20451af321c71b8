"""Sharded optimizers: torch's ``ZeroRedundancyOptimizer`` and fairscale's ``OSS``, told apart and consolidated.

Both keep the per-rank states they consolidate in a private list, and ``ZeroRedundancyOptimizer`` keeps whether
DDP has initialised it in private attributes; reading them here lets :mod:`ignite_zero.adapters.zero` fill the
list itself and have the optimizer's own code merge it. fairscale is imported only for objects whose class comes
from it, since the import is slow.
"""

from __future__ import annotations

from typing import Any

__all__ = ["consolidated_state_attribute", "sharded_optimizer_kind", "zero_awaits_ddp"]


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
    ).__module__.startswith("fairscale."):  # importing fairscale is slow: only for its own classes
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
