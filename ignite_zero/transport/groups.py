"""Process groups that move host tensors: gloo, whatever backend training uses.

Checkpoint traffic is CPU tensors. Under NCCL it would cost device memory and copies, and an asynchronous save's
traffic must never interleave with training's own collectives on one group; so each such use gets a gloo group of
its own, created once and cached.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["cpu_backend", "cpu_group", "discard_group"]

# Dedicated gloo groups, keyed by the group they stand for and the name of their use; dropped when the default
# group changes.
_gloo_groups: dict[Any, ProcessGroup] = {}
_gloo_groups_owner: list[Any] = [None]


def cpu_group(
    group: ProcessGroup | None = None, timeout: timedelta | None = None, *, dedicated: str | None = None
) -> ProcessGroup:
    """A process group over the ranks of ``group`` (default: all) that moves CPU tensors through gloo.

    That is ``group`` itself when its backend for CPU tensors is gloo (``"gloo"``, ``"cpu:gloo,cuda:nccl"``)
    and no ``dedicated`` use is named; otherwise a dedicated gloo group over the same ranks, created on the first
    call and cached, so that NCCL jobs never allocate device memory to move host data.

    Args:
        group: the group to stand in for; ``None`` for the default group.
        timeout: timeout of a dedicated group's operations; ``None`` keeps torch's default.
        dedicated: the name of a use that gets a group of its own even under gloo, for traffic that runs beside
            training collectives and beside other such uses (each asynchronous handler's saves): messages of
            two threads on one group could interleave.

    .. warning::
        Creating the dedicated group is a collective among the ranks of ``group``: they must all make
        their first call for it at the same point of the program (a checkpoint save does).
    """
    default = dist.group.WORLD
    if default is None:
        raise RuntimeError("`cpu_group` needs an initialized default process group")
    group = default if group is None else group
    if cpu_backend(group) == "gloo" and dedicated is None:
        return group
    if _gloo_groups_owner[0] is not default:
        _gloo_groups.clear()
        _gloo_groups_owner[0] = default
    key = (group, dedicated)
    if key not in _gloo_groups:
        ranks = dist.get_process_group_ranks(group)
        options: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        _gloo_groups[key] = dist.new_group(ranks, backend="gloo", use_local_synchronization=True, **options)
    return _gloo_groups[key]


def discard_group(dedicated: str, group: ProcessGroup | None = None) -> None:
    """Forget the dedicated group ``dedicated`` of ``group`` (see :func:`cpu_group`): the next call for it makes a
    new one. For a group whose connections a failed operation closed (a gloo wait that timed out closes them for
    good). Every rank of the group must discard it at the same point, as it must create it."""
    default = dist.group.WORLD
    _gloo_groups.pop((default if group is None else group, dedicated), None)


def cpu_backend(group: ProcessGroup) -> str:
    """The backend that moves CPU tensors on ``group``, or ``""`` if none does."""
    config = dist.get_backend_config(group)  # "gloo", "cuda:nccl" or "cpu:gloo,cuda:nccl"
    if ":" not in config:
        return config
    return dict(item.split(":", 1) for item in config.split(",")).get("cpu", "")
