"""The ranks of one transfer: its process group, this rank and the root, checked alike on every rank."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup

from ignite_zero.transport.groups import cpu_backend

__all__ = ["Ranks", "resolve"]


@dataclass(frozen=True)
class Ranks:
    """The ranks of a transfer over ``group`` (``None`` without a process group), ``size`` of them."""

    group: ProcessGroup | None
    size: int
    rank: int  # this rank, within the group
    root: int  # the gathering (scattering) rank, within the group

    def peer(self, group_rank: int) -> int:
        """Global rank of a group rank (point-to-point calls take global ranks)."""
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank


def resolve(group: ProcessGroup | None, root: int, name: str) -> Ranks:
    """Ranks involved, with the same checks on every rank; ``root`` is a global rank.

    Raises:
        ValueError: ``root`` or this rank is not in ``group``, or ``group`` cannot carry CPU tensors.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None or root != 0:
            raise ValueError(f"Without a process group `{name}` must be 0 and `group` None, but given {root}, {group}")
        return Ranks(None, 1, 0, 0)
    group = dist.group.WORLD if group is None else group
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("This rank is not part of `group`")
    ranks = dist.get_process_group_ranks(group)
    if root not in ranks:
        raise ValueError(f"Argument `{name}` should be a global rank in the group {ranks}, but given {root}")
    if group is not None and cpu_backend(group) in ("", "nccl"):
        raise ValueError("`group` has no backend for CPU tensors (NCCL only?): pass `cpu_group(group)` instead")
    return Ranks(group, len(ranks), rank, ranks.index(root))
