"""ignite's checkpoint events: the ``CheckpointEvents`` that :class:`ignite_zero.Checkpoint` fires.

ignite fires checkpoint events of its own only from 0.5.3 on; with an older ignite the same event is defined
here, so that handlers attached to it work with every supported ignite.
"""

from __future__ import annotations

__all__ = ["CheckpointEvents"]

try:
    from ignite.handlers.checkpoint import CheckpointEvents
except ImportError:  # ignite < 0.5.3 fires no checkpoint events of its own
    from ignite.engine import EventEnum

    class CheckpointEvents(EventEnum):  # type: ignore[no-redef]
        """Events fired by :class:`ignite_zero.Checkpoint`."""

        SAVED_CHECKPOINT = "saved_checkpoint"
