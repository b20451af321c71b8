"""Moving sharded state to one rank (and back) as raw tensors, once, in bounded memory.

Every rank sends what the recipient needs, to the recipient only, over point-to-point messages: a small header
(pickled structure and metadata, no tensor data), then the values of its tensors as raw bytes, instead of the
pickled broadcast to every rank of ``ZeroRedundancyOptimizer.consolidate_state_dict`` (and fairscale's ``OSS``).

=============================================  ===================================================================
Module                                         Job
=============================================  ===================================================================
:mod:`~ignite_zero.transport.wire`             bytes between two ranks, length first, or an error in their place
:mod:`~ignite_zero.transport.streams`          the values of a list of tensors as a stream of bounded messages
:mod:`~ignite_zero.transport.peers`            the ranks of one transfer, checked alike on every rank
:mod:`~ignite_zero.transport.objects`          whole objects: point to point, or gathered on one rank
:mod:`~ignite_zero.transport.overlap`          a consolidated save's streams in the background, written from slots
:mod:`~ignite_zero.transport.groups`           the gloo process groups that carry host tensors
=============================================  ===================================================================

:func:`ignite_zero.adapters.regions.gather_pieces` builds on the headers and streams to assemble full tensors from
the regions that ranks hold (FSDP shards).
"""

from ignite_zero.transport.objects import gather_to, receive_from, send_failure, send_to
from ignite_zero.transport.overlap import Overlap
from ignite_zero.transport.peers import Ranks, resolve
from ignite_zero.transport.streams import (
    DEFAULT_CHUNK_BYTES,
    StreamReceiver,
    chunk_bytes_for,
    receive_all,
    send_stream,
)
from ignite_zero.transport.wire import (
    PeerError,
    post_error,
    post_frame,
    receive_bytes,
    receive_frame,
    send_bytes,
    send_error,
)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "Overlap",
    "PeerError",
    "Ranks",
    "StreamReceiver",
    "chunk_bytes_for",
    "gather_to",
    "post_error",
    "post_frame",
    "receive_all",
    "receive_bytes",
    "receive_frame",
    "receive_from",
    "resolve",
    "send_bytes",
    "send_error",
    "send_failure",
    "send_stream",
    "send_to",
]
