"""ignite's ``Engine`` handler lists: a handler placed before the others of its event.

ignite appends every handler to its event's list and has no public way to put one first; the list is
``Engine._event_handlers``, unchanged from ignite 0.4 to 0.5.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ignite.engine import Engine

__all__ = ["add_first_event_handler"]


def add_first_event_handler(engine: Engine, event: Any, handler: Callable[..., Any]) -> None:
    """Add ``handler`` to ``event`` of ``engine`` as ``add_event_handler`` does, but to run before the handlers
    that the event has already."""
    engine.add_event_handler(event, handler)
    handlers = engine._event_handlers[event]
    handlers.insert(0, handlers.pop())
