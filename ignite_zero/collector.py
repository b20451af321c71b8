"""Python's cyclic garbage collector, held off while a save or a load makes many objects at once.

The collector runs after every few hundred new container objects, and now and then over every object of the process:
in a training process, whose heap holds the model, its optimizer and everything imported, that pass costs far more
than the objects that set it off. Unpickling DCP's ``.metadata`` of a state of thousands of entries makes hundreds of
thousands of objects, none of them garbage, and spends most of its time in those passes (see the benchmarks page,
"Many tensors"). :func:`paused` holds the collector off for such a step; what becomes garbage meanwhile is collected
after it.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["paused"]


class _Pauses:
    """The steps that hold the collector off now, in any thread: it runs again when the last one ends, if it ran
    before the first began."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._was_enabled = False

    def begin(self) -> None:
        with self._lock:
            if self._count == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._count += 1

    def end(self) -> None:
        with self._lock:
            self._count -= 1
            if self._count == 0 and self._was_enabled:
                gc.enable()


_PAUSES = _Pauses()


@contextmanager
def paused(at_most: float | None = None) -> Iterator[None]:
    """Hold the cyclic garbage collector off for the ``with`` block, or each call of the function it decorates (in
    every thread: the collector is the process's); nested and concurrent pauses may overlap. A collector that was
    disabled before stays disabled.

    Args:
        at_most: seconds after which this pause ends even if the block goes on: for a block that runs beside the
            training loop (an asynchronous save), whose garbage would otherwise wait for the block's end, however
            long a slow disk or a peer makes it.
    """
    lock, ended = threading.Lock(), False

    def end() -> None:
        nonlocal ended
        with lock:
            if not ended:
                ended = True
                _PAUSES.end()

    _PAUSES.begin()
    timer = None if at_most is None else threading.Timer(at_most, end)
    if timer is not None:
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
        end()
