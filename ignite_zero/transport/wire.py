"""Bytes between two ranks: a length-prefixed message, or an error message in its place.

A rank that cannot send tells the receiver instead of leaving it waiting (a negative length announces an error
message), so that an error never turns into a hang.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["PeerError", "receive_bytes", "send_bytes", "send_error"]


class PeerError(RuntimeError):
    """A peer reported that it could not send what was expected of it."""


def send_bytes(data: bytes, peer: int, group: ProcessGroup | None, length: int | None = None) -> None:
    """Send ``data`` to the global rank ``peer``, its length first (``length`` in its place, if given)."""
    dist.send(torch.tensor([len(data) if length is None else length], dtype=torch.int64), peer, group)
    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), peer, group)


def send_error(error: BaseException | str, peer: int, group: ProcessGroup | None) -> None:
    """Send ``error``'s message where ``peer`` waits in :func:`receive_bytes`, which raises :class:`PeerError`."""
    # A negative length announces an error message instead of a header: the peer raises, not hangs.
    text = error if isinstance(error, str) else f"rank {dist.get_rank()}: {type(error).__name__}: {error}"
    message = text.encode()
    send_bytes(message, peer, group, -len(message))


def receive_bytes(peer: int, group: ProcessGroup | None, what: str) -> bytes:
    """Receive a header; raise :class:`PeerError` if the peer sent an error message instead."""
    length = torch.zeros(1, dtype=torch.int64)
    dist.recv(length, peer, group)
    n = int(length.item())
    data = bytearray(abs(n))
    dist.recv(torch.frombuffer(data, dtype=torch.uint8), peer, group)
    if n < 0:
        raise PeerError(f"rank {peer} could not send {what}: {data.decode(errors='replace')}")
    return bytes(data)
