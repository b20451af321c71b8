"""Any other save handler (a callable, an ignite ``BaseSaveHandler`` such as ``ClearMLSaver`` or ``NeptuneSaver``),
called as ignite calls it."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ignite.handlers import DiskSaver as IgniteDiskSaver
from ignite.handlers.checkpoint import BaseSaveHandler

from ignite_zero.storage.savers.base import SaveRequest
from ignite_zero.storage.savers.consolidated import ConsolidatingSaver

__all__ = ["HandlerSaver"]


class HandlerSaver(ConsolidatingSaver):
    """A save handler that is not one of ours, behind the saver protocol.

    As in ignite, ``handler(checkpoint, filename[, metadata])`` and ``handler.remove(filename)`` run on every rank,
    and the handler decides what its rank does (ignite's ``DiskSaver`` writes on its ``save_on_rank``,
    ``NeptuneSaver.remove`` runs a barrier). Sharded objects are consolidated on the recipient first; on the other
    ranks their entry is ``{}``. ``remove`` follows the new checkpoint on each rank, never precedes it.

    Args:
        handler: the callable or ``BaseSaveHandler``.
    """

    def __init__(self, handler: Callable[..., Any]) -> None:
        self.handler = handler
        self.ext = getattr(handler, "ext", "pt")

    @property
    def requested_rank(self) -> int | None:
        return self.handler.save_on_rank if isinstance(self.handler, IgniteDiskSaver) else None

    @property
    def identity(self) -> str:
        kind = type(self.handler)
        return f"{kind.__module__}.{kind.__qualname__}:{getattr(self.handler, 'dirname', '')}"

    @property
    def directory(self) -> Path | None:
        # as ignite's Checkpoint.last_checkpoint: a path for its DiskSaver, the file name for any other handler
        return self.handler.dirname if isinstance(self.handler, IgniteDiskSaver) else None

    def writes_here(self, request: SaveRequest) -> bool:
        return True

    def write(self, content: Any, request: SaveRequest) -> None:
        self(content, request.filename, request.metadata)

    def __call__(self, checkpoint: Mapping, filename: str, metadata: Mapping | None = None) -> None:
        # Read at every save: a handler reassigned after construction is called with the arity it has now. ignite
        # instead retries without metadata after any TypeError, which would run a collective handler twice.
        if _takes_metadata(self.handler):
            self.handler(checkpoint, filename, None if metadata is None else dict(metadata))
        else:
            self.handler(checkpoint, filename)

    def remove(self, filename: str) -> None:
        if isinstance(self.handler, BaseSaveHandler):
            self.handler.remove(filename)


def _takes_metadata(handler: Callable[..., Any]) -> bool:
    if isinstance(handler, BaseSaveHandler):
        return True
    try:
        parameters = inspect.signature(handler).parameters.values()
    except (TypeError, ValueError):  # a callable whose signature Python cannot read: ignite's full call
        return True
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in parameters)
