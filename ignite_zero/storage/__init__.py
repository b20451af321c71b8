"""Storage: the saver protocol (:class:`Saver`) between the policy and where checkpoints live, its savers, and the
checkpoint formats (:mod:`ignite_zero.storage.formats`).

=================  ===================================================================================
``base``           the protocol: :class:`Saver`, :class:`SaveRequest`
``consolidated``   savers that gather the full state on the recipient, then write it in one piece
``directory``      what the local savers share: the directory, the writing rank, names, retention
``files``          :class:`DiskSaver`: one durable file per checkpoint
``sharded``        :class:`ShardedSaver`: a DCP directory that every rank writes its part of
``handler``        :class:`HandlerSaver`: any other ignite handler, called as ignite calls it
``formats``        the checkpoint formats, one module each: how each is written, verified, listed and read
``places``         where checkpoints live (a local directory or an object store's prefix), and how a write is
                   committed there
=================  ===================================================================================
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ignite_zero.storage.base import Saver, SaveRequest
from ignite_zero.storage.consolidated import ConsolidatingSaver
from ignite_zero.storage.files import DiskSaver
from ignite_zero.storage.handler import HandlerSaver
from ignite_zero.storage.sharded import ShardedSaver

__all__ = [
    "ConsolidatingSaver",
    "DiskSaver",
    "HandlerSaver",
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
        options: the saver's arguments (``create_dir``, ``require_empty``, ``save_on_rank``, ``torch.save``'s).
    """
    return DiskSaver(place, **options)
