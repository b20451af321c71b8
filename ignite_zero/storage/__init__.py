"""Storage: the saver protocol (:class:`Saver`) between the policy and where checkpoints live, and its savers."""

from __future__ import annotations

from typing import Any

from ignite_zero.storage.base import Saver, SaveRequest
from ignite_zero.storage.consolidated import ConsolidatingSaver
from ignite_zero.storage.handler import HandlerSaver

__all__ = ["ConsolidatingSaver", "HandlerSaver", "SaveRequest", "Saver", "as_saver"]


def as_saver(handler: Any) -> Saver:
    """``handler`` itself if it is one of ours, else the handler behind the protocol, called as ignite calls it."""
    return handler if isinstance(handler, Saver) else HandlerSaver(handler)
