"""Asynchronous saves: the copy that blocks training, and the write that goes on in a thread of its own.

A handler with ``async_save=True`` keeps one :class:`BackgroundSaves`. A save first runs the saver's ``stage``
in the training thread (each rank copies its part into host buffers), then the returned work in a thread, whose
outcome the ranks share on a stream of agreement rounds of its own. The stream is named after the handler's
checkpoints (:attr:`BackgroundSaves.stream`), not after the order in which handlers were created, so ranks that
create their handlers in different orders still pair their rounds correctly; two live handlers that would write
the same checkpoints are refused at their first save.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ignite.engine import Engine, Events

from ignite_zero import collector
from ignite_zero.agreement import busy, together

__all__ = ["BackgroundSaves"]

logger = logging.getLogger(__name__)

# How long the thread of an asynchronous save holds the collector off at most.
_PAUSE_SECONDS = 10.0

# The live handler of each stream: a second one would interleave its rounds with the first one's.
_streams: weakref.WeakValueDictionary[str, BackgroundSaves] = weakref.WeakValueDictionary()


@dataclass
class _Pending:
    """A save under way: what it is, its thread, what to do once it is durable, and its error if it failed."""

    what: str
    durable: Callable[[], None]
    thread: threading.Thread = field(init=False)
    error: BaseException | None = None


class BackgroundSaves:
    """At most one asynchronous save in flight for one handler; the next save, the end of a run and an exception
    in it wait for the one in flight.

    Args:
        timeout: seconds ranks wait for each other (the handler's ``sync_timeout``).
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.stream: str | None = None
        self._pending: _Pending | None = None
        self._followed: weakref.WeakSet[Engine] = weakref.WeakSet()

    def claim(self, identity: str) -> str:
        """The stream of agreement rounds of the checkpoints ``identity`` names (the same on every rank)."""
        stream = f"async/{identity}"
        owner = _streams.get(stream)
        if owner is not None and owner is not self:
            raise ValueError(
                f"Two asynchronous Checkpoint handlers write the same checkpoints ({identity}). Give them different "
                "directories or `filename_prefix`, or use one handler."
            )
        _streams[stream] = self
        self.stream = stream
        return stream

    def follow(self, engine: Engine, wait: Callable[[], None]) -> None:
        """Make the end of ``engine``'s run, and an exception in it, ``wait`` for the save in flight (the handler's
        :meth:`~ignite_zero.Checkpoint.wait`, which wraps :meth:`wait`)."""
        if engine in self._followed:
            return

        def wait_then_raise(_: Engine, error: BaseException) -> None:
            # let a pending save finish (or report its failure), then raise as ignite does
            try:
                wait()
            except Exception as failure:
                logger.error(
                    "The run raised %r while an asynchronous save was pending, which failed: %s", error, failure
                )
            raise error

        engine.add_event_handler(Events.COMPLETED, lambda _: wait())
        engine.add_event_handler(Events.EXCEPTION_RAISED, wait_then_raise)
        self._followed.add(engine)

    def start(
        self,
        stage: Callable[[], Callable[[], None]],
        *,
        what: str,
        ranks: Sequence[int],
        durable: Callable[[], None],
    ) -> None:
        """Run ``stage`` now (on every rank of ``ranks``, which share its outcome), then the work it returns in a
        thread; ``durable`` runs in the caller's thread, by :meth:`wait`, once that work succeeded on every rank."""
        assert self.stream is not None, "claim a stream first"
        started = time.perf_counter()
        with together(f"checkpoint staging of {what}", timeout=self.timeout, ranks=ranks):
            work = stage()
        logger.debug("Checkpoint %s staged in %.3f s", what, time.perf_counter() - started)
        pending = _Pending(what, durable)
        pending.thread = threading.Thread(
            target=self._run, args=(pending, work, ranks), name="ignite_zero-save", daemon=False
        )
        self._pending = pending
        pending.thread.start()

    def _run(self, pending: _Pending, work: Callable[[], None], ranks: Sequence[int]) -> None:
        what = f"checkpoint save of {pending.what}"
        try:
            with together(what, timeout=self.timeout, stream=self.stream or "main", ranks=ranks):
                # held off as in a save in the training thread, whose objects it makes here: each collection would
                # pass over the whole heap, holding the loop's interpreter too; for a while only, since the loop
                # goes on making garbage (a save of many small tensors takes about a second)
                with busy(interval=min(1.0, self.timeout / 4)), collector.paused(at_most=_PAUSE_SECONDS):
                    work()
        except Exception as error:  # raised by wait(), in the training thread
            logger.error("Asynchronous save of %s failed: %s", pending.what, error)
            pending.error = error

    def wait(self) -> None:
        """Block until the save in flight, if any, is durable; raise its error if it failed (on every rank)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        pending.thread.join()
        if pending.error is not None:
            raise pending.error
        pending.durable()
