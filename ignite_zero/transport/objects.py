"""Whole objects between ranks: a skeleton pickled with its tensors replaced by indices (the header), then the
values of its tensors as one stream.

:func:`send_to` / :func:`receive_from` move an object point to point, and :func:`gather_to` (e.g. each rank's local
ZeRO optimizer state) to one rank, which gets views of one flat buffer per (sender, dtype), instead of the pickled
broadcast to every rank of ``ZeroRedundancyOptimizer.consolidate_state_dict``. Headers are unpickled on the receiving
rank: a rank trusts its peers exactly as ``torch.distributed``'s own object collectives do.
"""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import ProcessGroup

from ignite_zero.pickling import join_tensors, split_tensors
from ignite_zero.staging import to_cpu
from ignite_zero.transport.overlap import Overlap
from ignite_zero.transport.peers import Ranks, resolve
from ignite_zero.transport.streams import (
    DEFAULT_CHUNK_BYTES,
    StreamReceiver,
    chunk_bytes_for,
    receive_all,
    send_stream,
)
from ignite_zero.transport.wire import PeerError, receive_bytes, send_bytes, send_error

__all__ = ["gather_to", "receive_from", "send_failure", "send_to"]


@dataclass
class _OutgoingObject:
    header: bytes
    tensors: list[torch.Tensor]
    chunk_bytes: int


def _prepare(obj: Any, chunk_bytes: int) -> _OutgoingObject:
    """Serialize the skeleton; raises before anything is sent if ``obj`` cannot be sent."""
    structure, tensors = split_tensors(obj)
    chunk_bytes = chunk_bytes_for(tensors, chunk_bytes)
    metas = [(t.dtype, tuple(t.shape)) for t in tensors]
    header = pickle.dumps((chunk_bytes, metas, structure), protocol=pickle.HIGHEST_PROTOCOL)
    return _OutgoingObject(header, tensors, chunk_bytes)


def _send_object(outgoing: _OutgoingObject, peer: int, group: ProcessGroup | None, overlap: Overlap | None) -> None:
    """Send the header now, and the tensors' stream now or, given ``overlap``, in its background."""
    send_bytes(outgoing.header, peer, group)
    if overlap is None:
        send_stream(outgoing.tensors, peer, group, outgoing.chunk_bytes)
    else:
        overlap.send(outgoing.tensors, peer, group, outgoing.chunk_bytes)


class _IncomingObject:
    """An object being received: one flat CPU buffer per dtype, and the views its tensors will be."""

    def __init__(self, peer: int, header: bytes) -> None:
        chunk_bytes, metas, self._structure = pickle.loads(header)
        numels: dict[torch.dtype, int] = {}
        offsets = []
        for dtype, shape in metas:
            offsets.append(numels.get(dtype, 0))
            numels[dtype] = offsets[-1] + math.prod(shape)
        buffers = {dtype: torch.empty(numel, dtype=dtype) for dtype, numel in numels.items()}
        self._tensors = [
            buffers[dtype][offset : offset + math.prod(shape)].view(shape)
            for (dtype, shape), offset in zip(metas, offsets)
        ]
        self.receiver = StreamReceiver(peer, self._tensors, chunk_bytes)

    def result(self) -> Any:
        return join_tensors(self._structure, self._tensors)


def send_to(
    obj: Any,
    dst: int,
    group: ProcessGroup | None = None,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    overlap: Overlap | None = None,
) -> None:
    """Send ``obj`` to the global rank ``dst``, which calls :func:`receive_from`; point to point. Given ``overlap``,
    its tensors travel in the background (see :class:`~ignite_zero.transport.overlap.Overlap`): they must stay as
    they are until it is drained.

    Raises:
        TypeError: ``obj`` holds a tensor without plain strided data; ``dst`` is told and raises too.
    """
    ranks = resolve(group, dst, "dst")
    try:
        outgoing = _prepare(obj, chunk_bytes)
    except Exception as error:  # an unpicklable leaf or an unsupported tensor: tell `dst`, then fail here
        send_error(error, dst, ranks.group)
        raise
    _send_object(outgoing, dst, ranks.group, overlap)


def send_failure(error: BaseException, dst: int, group: ProcessGroup | None = None) -> None:
    """Tell the global rank ``dst``, waiting in :func:`receive_from`, that its object will not come: it raises."""
    send_error(error, dst, resolve(group, dst, "dst").group)


def receive_from(src: int, group: ProcessGroup | None = None) -> Any:
    """Receive the object the global rank ``src`` sends with :func:`send_to`.

    Returns:
        The object; its tensors are CPU views of one flat buffer per dtype.

    Raises:
        RuntimeError: ``src`` could not send it.
    """
    ranks = resolve(group, src, "src")
    incoming = _IncomingObject(src, receive_bytes(src, ranks.group, "the object"))
    receive_all([incoming.receiver], ranks.group)
    return incoming.result()


def gather_to(
    obj: Any,
    dst: int,
    group: ProcessGroup | None = None,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    overlap: Overlap | None = None,
) -> list[Any] | None:
    """Gather every rank's object on ``dst``; a collective over ``group``.

    Args:
        obj: this rank's object: dicts, lists, tuples and other picklable containers of tensors and small
            picklable leaves. Its tensors travel as raw bytes, to ``dst`` only.
        dst: global rank that receives the objects.
        group: process group whose CPU backend is gloo (see :func:`~ignite_zero.transport.groups.cpu_group`);
            ``None`` for the default group. Without a process group this is a one-rank gather.
        chunk_bytes: most bytes a sender stages at a time, and the largest message; a sender whose tensors
            hold less than 16 times as much uses 1/16 of their size (1 MiB at least).
        overlap: where given, the tensors travel in its background and the gather returns at once (see
            :class:`~ignite_zero.transport.overlap.Overlap`); ``None``: they have all arrived when it returns.

    Returns:
        On ``dst``, the objects of all ranks in group-rank order: received tensors are CPU views of one flat
        buffer per (sender, dtype); ``dst``'s own object comes back as is (with CPU copies of any device
        tensors). ``None`` on other ranks.

    Raises:
        ValueError: ``dst`` or this rank is not in ``group``.
        TypeError: on a sender, its object holds a tensor without plain strided data (sparse, meta...).
        RuntimeError: on ``dst``, some rank could not send its object; every sender is drained first, so no
            rank hangs and the group stays usable.

    Note:
        ``torch.save`` of received tensors writes their whole flat buffer: save all of a sender's tensors,
        or clone the ones kept.
    """
    ranks = resolve(group, dst, "dst")
    if ranks.rank != ranks.root:
        send_to(obj, dst, group, chunk_bytes=chunk_bytes, overlap=overlap)
        return None
    return _receive_objects(obj, ranks, dst, overlap)


def _receive_objects(obj: Any, ranks: Ranks, dst: int, overlap: Overlap | None) -> list[Any]:
    """:func:`gather_to` on ``dst``: every sender's object (``obj`` is its own), once every sender has been heard.

    Raises:
        RuntimeError: some rank could not send its object.
    """
    incoming: dict[int, _IncomingObject] = {}
    failures: dict[int, str] = {}
    for peer in range(ranks.size):
        if peer != ranks.rank:
            try:
                incoming[peer] = _IncomingObject(
                    ranks.peer(peer), receive_bytes(ranks.peer(peer), ranks.group, "its object")
                )
            except PeerError as error:
                failures[peer] = str(error)
    receivers = [item.receiver for item in incoming.values()]
    if overlap is None:
        receive_all(receivers, ranks.group)
    else:
        overlap.receive(receivers, ranks.group)
    try:
        own = to_cpu(obj)  # also applies the senders' checks, so any rank may be the root
    except Exception as error:  # only now: every sender has been drained, so none of them hangs
        failures[ranks.rank] = f"rank {dst}: {type(error).__name__}: {error}"
    if failures:
        raise RuntimeError("Some ranks could not send their state: " + "; ".join(failures[p] for p in sorted(failures)))
    return [own if peer == ranks.rank else incoming[peer].result() for peer in range(ranks.size)]
