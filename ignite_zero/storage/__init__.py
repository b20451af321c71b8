"""Storage: the savers behind the protocol between the policy and where checkpoints live, the checkpoint formats,
the places that hold them, and the replicas of sharded checkpoints on node-local disks.

=================  ===================================================================================
``savers``         where and when a checkpoint is written (:mod:`ignite_zero.storage.savers`)
``formats``        the checkpoint formats, one module each: how each is written, verified, listed and read
``places``         where checkpoints live (a local directory or an object store's prefix), and how a write is
                   committed there
``replicas``       a sharded directory on node-local disks, kept on several hosts: who keeps whose files, moving
                   them between hosts, completing a host's copy before a load
=================  ===================================================================================
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ignite_zero.storage.savers.base import Saver, SaveRequest
from ignite_zero.storage.savers.consolidated import ConsolidatingSaver
from ignite_zero.storage.savers.disk import DiskSaver
from ignite_zero.storage.savers.ignite_handler import HandlerSaver
from ignite_zero.storage.savers.sharded import ShardedSaver

__all__ = [
    "ConsolidatingSaver",
    "DiskSaver",
    "SaveRequest",
    "Saver",
    "ShardedSaver",
    "as_saver",
    "saver_for",
]


def as_saver(handler: Any) -> Saver:
    """``handler`` itself if it is one of ours, else the handler behind the protocol, called as ignite calls it."""
    return handler if isinstance(handler, Saver) else HandlerSaver(handler)


def saver_for(place: str | Path, **options: Any) -> Saver:
    """The saver of single checkpoint files at ``place``, as a string or path ``save_handler`` makes it.

    Args:
        place: the directory.
        options: the saver's arguments (``create_dir``, ``require_empty``, ``defer_require_empty``,
            ``save_on_rank``, ``torch.save``'s).
    """
    return DiskSaver(place, **options)
