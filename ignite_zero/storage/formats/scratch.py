"""Memory a thread keeps from one file it writes or reads to the next: where archives are made, small pieces gathered
and neighbouring entries read.

Memory new to the process costs a page fault for each 4 KiB when it is first written, as much as copying it a few
times over, and an allocator maps large blocks afresh for each request (glibc past its mmap threshold): a save or a
load of many small tensors that took new memory for each batch spent much of its time in the kernel (the benchmarks
page has figures). A thread's buffer for a use serves each of its calls in turn, so a caller copies out what it keeps
before the next call for the same use, and never holds two at once; buffers of several threads never meet.
"""

from __future__ import annotations

import threading

__all__ = ["KEPT", "thread_buffer"]

#: The most bytes a thread keeps for each use; a larger request takes memory of its own, let go after it.
KEPT = 8 << 20


class _Buffers(threading.local):
    def __init__(self) -> None:
        self.by_use: dict[str, bytearray] = {}


_buffers = _Buffers()


def thread_buffer(use: str, nbytes: int) -> memoryview:
    """``nbytes`` bytes that this thread keeps for ``use``: the same memory at each call while it is large enough (it
    grows at least twofold, up to :data:`KEPT`), its content whatever the last call left.

    Args:
        use: what the memory is for, e.g. ``"small archives"``: each use has its own.
        nbytes: how many bytes the caller needs.
    """
    if nbytes > KEPT:
        return memoryview(bytearray(nbytes))
    kept = _buffers.by_use.get(use)
    if kept is None or len(kept) < nbytes:
        kept = _buffers.by_use[use] = bytearray(max(nbytes, min(2 * len(kept or b""), KEPT)))
    return memoryview(kept)[:nbytes]
