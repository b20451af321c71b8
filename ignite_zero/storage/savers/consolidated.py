"""Savers that write the whole checkpoint from the full state: sharded objects are consolidated on the recipient
(each adapter's collective ``assemble``) and the checkpoint is written in one piece.

The two overlap: the saver passes one :class:`ignite_zero.transport.Overlap` to every adapter's ``assemble``, so that
the recipient receives the other ranks' parts in its background, and a saver that can write a tensor's bytes as they
arrive (:meth:`ConsolidatingSaver.write_arriving`) starts writing at once.
"""

from __future__ import annotations

import functools
import logging
import time
from abc import abstractmethod
from collections.abc import Callable
from typing import Any

from ignite_zero import tree
from ignite_zero.adapters import ShardedState
from ignite_zero.staging import Stager
from ignite_zero.storage.savers.base import Saver, SaveRequest, unwrapped
from ignite_zero.transport import Overlap

__all__ = ["ConsolidatingSaver"]

logger = logging.getLogger(__name__)


class ConsolidatingSaver(Saver):
    """A saver that gathers each sharded object's full state on the recipient, then writes the checkpoint.

    Subclasses say which ranks write (:meth:`writes_here`) and how (:meth:`write`). On a rank that writes and is
    not the recipient, a sharded object's entry is ``{}``, ignite's own convention for ZeRO.
    """

    @functools.cached_property
    def _stager(self) -> Stager:
        return Stager()  # host copies of asynchronous saves, reused from one save to the next

    @abstractmethod
    def writes_here(self, request: SaveRequest) -> bool:
        """Whether this rank writes the checkpoint (and so needs every plain object's state)."""

    @abstractmethod
    def write(self, content: Any, request: SaveRequest) -> None:
        """Write ``content`` (what the checkpoint holds, as ignite lays it out) as ``request.filename``."""

    def write_arriving(self, content: Any, request: SaveRequest, arriving: Overlap) -> None:
        """:meth:`write`, while bytes of ``content``'s tensors may still be arriving from other ranks: a saver that
        writes a tensor's bytes as ``arriving.wait_for`` says they are there overrides it; by default every byte is
        received first."""
        arriving.finish()
        self.write(content, request)

    def write_in_background(self, content: Any, request: SaveRequest, arriving: Overlap) -> None:
        """:meth:`write_arriving`, in the thread of an asynchronous save: a saver that can write elsewhere than in
        this process (and so leave its interpreter to the training loop) overrides it."""
        self.write_arriving(content, request, arriving)

    def save(self, objects: Any, request: SaveRequest) -> None:
        writes = self.writes_here(request)

        def state_of(_: tree.Path, obj: Any, arriving: Overlap) -> Any:
            if isinstance(obj, ShardedState):  # its state_dict(): a collective over its group, bytes arriving
                return obj.assemble(obj.snapshot(), obj.gather_group(), arriving)
            return obj.state_dict() if writes else None

        self._commit(objects, state_of, writes, request)

    def stage(self, objects: Any, request: SaveRequest) -> Callable[[], None]:
        """Copy each sharded object's snapshot, and on the ranks that write every plain object's state; the returned
        work assembles the copies and writes them."""
        writes = self.writes_here(request)
        staged: dict[tree.Path, Any] = {}
        groups: dict[tree.Path, Any] = {}
        for path, obj in tree.leaves(objects):
            if isinstance(obj, ShardedState):
                groups[path] = obj.gather_group(dedicated=request.stream)  # a collective the first time: in this thread
                staged[path] = self._stager.stage(obj.snapshot(), tree.describe(path))
            elif writes:
                staged[path] = self._stager.stage(obj.state_dict(), tree.describe(path))

        def assemble(path: tree.Path, obj: Any, arriving: Overlap) -> Any:
            return (
                obj.assemble(staged[path], groups[path], arriving)
                if isinstance(obj, ShardedState)
                else staged.get(path)
            )

        return lambda: self._commit(objects, assemble, writes, request, self.write_in_background)

    def _commit(
        self,
        objects: Any,
        state_of: Callable[[tree.Path, Any, Overlap], Any],
        writes: bool,
        request: SaveRequest,
        write: Callable[[Any, SaveRequest, Overlap], None] | None = None,
    ) -> None:
        """Gather the checkpoint, ``state_of`` each object, while its bytes arrive in the background, and ``write`` it
        (:meth:`write_arriving` by default) as they arrive."""
        started = time.perf_counter()
        with Overlap() as arriving:  # leaving it waits for every stream: no sender is left waiting
            checkpoint = tree.map_tree(lambda path, obj: state_of(path, obj, arriving), objects)
            if not writes:
                return
            planned = time.perf_counter()
            (write or self.write_arriving)(unwrapped(checkpoint, request), request, arriving)
        for filename in request.removed:  # only now: the new checkpoint is durable
            self.remove(filename)
        logger.info(
            "Checkpoint %s: gather planned in %.2f s, state received and written in %.2f s",
            request.filename,
            planned - started,
            time.perf_counter() - planned,
        )
