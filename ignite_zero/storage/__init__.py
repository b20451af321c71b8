"""Storage: the saver protocol (:class:`Saver`) between the policy and where checkpoints live, and its savers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ignite_zero.storage.base import Saver, SaveRequest
from ignite_zero.storage.consolidated import ConsolidatingSaver
from ignite_zero.storage.handler import HandlerSaver

__all__ = ["ConsolidatingSaver", "HandlerSaver", "SaveRequest", "Saver", "as_saver", "saver_for"]


def as_saver(handler: Any) -> Saver:
    """``handler`` itself if it is one of ours, else the handler behind the protocol, called as ignite calls it."""
    return handler if isinstance(handler, Saver) else HandlerSaver(handler)


def saver_for(place: str | Path, **options: Any) -> Saver:
    """The saver of single checkpoint files at ``place``, as a string or path ``save_handler`` makes it.

    Args:
        place: the directory.
        options: the saver's arguments (``create_dir``, ``require_empty``, ``save_on_rank``, ``torch.save``'s).
    """
    from ignite_zero.savers import DiskSaver

    return DiskSaver(place, **options)
